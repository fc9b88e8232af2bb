from __future__ import annotations

import json
from pathlib import Path

import click

# A conversation shape an agent loop produces: thinking, a tool turn, a user follow-up.
DEFAULT_CONVERSATION = [
    {"role": "system", "content": "You are a careful assistant."},
    {"role": "user", "content": "What is two and two?"},
    {"role": "assistant", "content": "<think>\nadd them\n</think>\n\nI will ask the calculator."},
    {"role": "tool", "content": "calculator: 2 + 2 = 4"},
    {"role": "assistant", "content": "It is four."},
    {"role": "user", "content": "And three more?"},
    {"role": "assistant", "content": "<think>\nfour and three\n</think>\n\nSeven."},
]


@click.command("check-template", short_help="Whether a chat template only ever appends.")
@click.argument("model_dir", type=click.Path(file_okay=False, path_type=Path))
@click.option(
    "--conversation",
    type=click.Path(dir_okay=False, path_type=Path),
    help="A JSON list of {role, content} messages (system, user, assistant, tool) to render; "
    "default: system, user, assistant with <think>, tool, assistant, user, assistant.",
)
def check_template(model_dir: Path, conversation: Path | None) -> None:
    """Render a conversation through MODEL_DIR's chat template message by message and whole,
    as text and as token ids, and say whether each longer rendering extends the shorter one:
    what a messages-mode agent loop needs to be token-exact. Exit 0 when it is append-only,
    1 naming the first message and position where it is not (Qwen3's template, which leaves
    out earlier thinking at a user message, is not), 2 on bad input.

    \b
    Example:
      lpx check-template models/tiny
      lpx check-template /models/Qwen3-8B --conversation my-agent-conversation.json
    """
    from pipeline.engines.model_dir import check_model_dir
    from pipeline.trajectory.agent_loop import load_tokenizer
    from pipeline.trajectory.template import append_only

    check_model_dir(model_dir)
    messages = _conversation(conversation) if conversation else DEFAULT_CONVERSATION
    broken = append_only(load_tokenizer(model_dir), messages)
    if broken is None:
        click.echo(f"{model_dir}: append-only over {len(messages)} messages, as text and tokens")
        return
    click.echo(f"{model_dir}: {broken}")
    raise SystemExit(1)


def _conversation(path: Path) -> list[dict]:
    from pipeline.errors import BadInput
    from pipeline.trajectory.shape import ROLES

    try:
        messages = json.loads(path.read_text("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise BadInput(f"{path}: cannot read a JSON list of messages ({error})") from None
    if not isinstance(messages, list) or not messages:
        raise BadInput(f"{path}: expected a JSON list of {{role, content}} messages")
    for k, message in enumerate(messages):
        if (
            not isinstance(message, dict)
            or message.get("role") not in ROLES
            or not isinstance(message.get("content"), str)
        ):
            raise BadInput(
                f"{path}: message {k} needs a role ({', '.join(ROLES)}) and text content"
            )
    return messages
