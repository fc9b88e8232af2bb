"""The tiny model's chat template, and whether a template is append-only.

TINY_CHAT_TEMPLATE has Qwen3's structure so that every way a messages-mode agent loop parts
from token-in-token-out can happen on the tiny model for real: role markers written as text
(`<|im_start|>role\\n ... <|im_end|>`; the tiny vocabulary has no chat special tokens, so
they are BPE pieces), tool results wrapped in a user turn as `<tool_response>`, the real
special token `</s>` closing each assistant turn (what `skip_special_tokens` loses), and,
like Qwen3, the `<think>` block of every assistant turn before the last user message left
out of the rendering. So turn N+1 rendered from messages is not turn N's context extended.

`append_only` renders a conversation turn by turn and whole, as text and as tokens, and names
the first turn and token where a longer rendering does not extend a shorter one: the check a
team runs before it trusts a messages-mode agent loop.
"""

from __future__ import annotations

from dataclasses import dataclass

# Written for lpx (Jinja, as transformers renders chat templates); the structure is Qwen3's.
TINY_CHAT_TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- set content = m.content -%}"
    "{%- if m.role == 'assistant' and loop.index0 < ns.last_user and '</think>' in content -%}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') -%}"
    "{%- endif -%}"
    "{%- if m.role == 'tool' -%}"
    "{{ '<|im_start|>user\\n<tool_response>\\n' + content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- elif m.role == 'assistant' -%}"
    "{{ '<|im_start|>assistant\\n' + content + '<|im_end|>' + eos_token + '\\n' }}"
    "{%- else -%}"
    "{{ '<|im_start|>' + m.role + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)

GENERATION_PROMPT = "<|im_start|>assistant\n"
END_OF_MODEL_TURN = "<|im_end|>"  # what a model turn ends with before the template's eos


def render(tokenizer, messages: list[dict], add_generation_prompt: bool = False) -> str:
    """The conversation as the model's own chat template writes it."""
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )


def encode(tokenizer, text: str) -> list[int]:
    """Text to ids as a messages-mode loop does it: no special tokens added around it."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


@dataclass(frozen=True)
class NotAppendOnly:
    turn: int  # the first message whose rendering does not extend the one before
    kind: str  # "text" (the rendered text) or "tokens" (the re-tokenized ids)
    position: int  # character or token position where they part
    before: str  # what the shorter rendering had there
    after: str  # what the longer one has there

    def __str__(self) -> str:
        unit = "character" if self.kind == "text" else "token"
        return (
            f"not append-only at message {self.turn}: the {self.kind} rendered through message "
            f"{self.turn} parts from the rendering before it at {unit} {self.position} "
            f"({self.before!r} became {self.after!r})"
        )


def _parting(a, b) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def append_only(tokenizer, messages: list[dict]) -> NotAppendOnly | None:
    """None when rendering the conversation one message more only ever appends, as text and
    as ids; else the first message, and where, that breaks it. Before each assistant message
    the shorter rendering carries the generation prompt, as an agent loop sends it."""
    previous_text, previous_ids = None, None
    for k in range(1, len(messages) + 1):
        prompt = k < len(messages) and messages[k]["role"] == "assistant"
        text = render(tokenizer, messages[:k], add_generation_prompt=prompt)
        ids = encode(tokenizer, text)
        if previous_text is not None:
            at = _parting(previous_text, text)
            if at < len(previous_text):
                return NotAppendOnly(
                    k - 1, "text", at, previous_text[at : at + 24], text[at : at + 24]
                )
            at = _parting(previous_ids, ids)
            if at < len(previous_ids):
                return NotAppendOnly(
                    k - 1, "tokens", at,
                    tokenizer.decode(previous_ids[at : at + 4]), tokenizer.decode(ids[at : at + 4]),
                )  # fmt: skip
        previous_text, previous_ids = text, ids
    return None
