"""A multi-turn agent loop over any rollout engine, written as a fixture of trajectories.

Each model turn is one call of the engine's own ``rollout`` on every trajectory's current
context (one request each, the seed moved on per turn), so HF, vLLM, SGLang and any plug-in run
the same loop. Between model turns the offline environment answers (environment.py).

Two modes, as agent loops run:
- ``tito`` (token-in-token-out): each context is the previous turns' ids, the environment's
  turn tokenized on its own and appended;
- ``messages``: the message list is re-rendered through the model's chat template and
  re-tokenized every turn.

Either way the trainer's sequence is the turns end to end (what was generated, the
environment's tokens between), its loss mask 1 on generated tokens; the context each engine
call reports it was given is kept where it is not a prefix of that sequence. With ``think``
each model turn is a `<think>` block: the template's generation prompt is followed by
`<think>\\n` and the loop closes the block after the model's tokens.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from pipeline.engines.base import ChatPrompts
from pipeline.errors import BadInput
from pipeline.trajectory.environment import ToolEnvironment
from pipeline.trajectory.template import END_OF_MODEL_TURN, GENERATION_PROMPT, encode, render

MODES = ("tito", "messages")
RENDERERS = ("engine", "lpx")
LPX_RENDERING = "lpx (transformers' apply_chat_template, then the tokenizer)"
THINK_OPEN, THINK_CLOSE = "<think>\n", "\n</think>\n\n"
TURN_SEED_STRIDE = 100_003  # each model turn's seeds: the rollout's, moved on by this


@dataclass(frozen=True)
class LoopSettings:
    turns: int = 4  # model turns per trajectory
    mode: str = "tito"
    think: bool = True
    env_seed: int = 0
    render: str = "engine"  # messages mode: the engine's chat path where it has one, or lpx

    def as_dict(self) -> dict:
        return {"turns": self.turns, "mode": self.mode, "think": self.think,
                "env_seed": self.env_seed}  # fmt: skip


def load_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if not tokenizer.chat_template:
        raise BadInput(
            f"{model_dir}: the tokenizer has no chat template; an agent loop renders its turns "
            "through one (add chat_template.jinja, or use a chat model)"
        )
    return tokenizer


class _Trajectory:
    """One trajectory's state as the loop goes."""

    def __init__(self, sequence_id: str, messages: list[dict], opening: list[list[int]]):
        self.sequence_id = sequence_id
        self.messages = messages
        self.turns: list[dict] = [
            {"role": m["role"], "ids": ids} for m, ids in zip(messages, opening, strict=True)
        ]

    def flat(self) -> list[int]:
        return [i for turn in self.turns for i in turn["ids"]]


def agent_rollout(rollout_with, model_dir: Path, prompt_texts: list[str], sampling, knobs: dict,
                  settings: LoopSettings):  # fmt: skip
    """The fixture (kind 'fixture') of ``settings.turns`` model turns per trajectory: one
    trajectory per prompt and sample."""
    if settings.mode not in MODES:
        raise BadInput(f"agent loop mode {settings.mode!r}: choose one of {', '.join(MODES)}")
    if settings.turns < 1:
        raise BadInput("an agent loop needs at least one model turn (--agent-turns N)")
    if settings.render not in RENDERERS:
        raise BadInput(
            f"agent loop render {settings.render!r}: choose one of {', '.join(RENDERERS)}"
        )
    tokenizer = load_tokenizer(model_dir)
    env = ToolEnvironment(settings.env_seed)
    think = THINK_OPEN if settings.think else ""
    states = []
    for p, text in enumerate(prompt_texts):
        for s in range(sampling.samples_per_prompt):
            messages = env.opening(text)
            opening = opening_ids(tokenizer, messages, think)
            states.append(_Trajectory(f"{p}-{s}", messages, opening))
    longest = max(len(s.flat()) for s in states) + settings.turns * (sampling.max_tokens + 256)
    chat_path = getattr(rollout_with, "renders_chat", None)
    engine_renders = settings.mode == "messages" and settings.render == "engine" and chat_path
    with _engine_session(rollout_with, model_dir, sampling, knobs, longest,
                         bool(engine_renders)) as sample:  # fmt: skip
        table = _turns(sample, tokenizer, states, env, sampling, settings, think,
                       bool(engine_renders))  # fmt: skip
    fixture = _fixture(states, table, sampling, settings)
    if settings.mode == "messages":  # who rendered each turn's context
        fixture.metadata["agent_loop"]["rendered_by"] = (
            chat_path if engine_renders else LPX_RENDERING
        )
    return fixture


def opening_ids(tokenizer, messages: list[dict], think: str) -> list[list[int]]:
    """The system turn's ids and the user turn's, the generation prompt (and the opened
    `<think>`) with it: what the first model turn is generated from."""
    system = encode(tokenizer, render(tokenizer, messages[:1]))
    user = encode(tokenizer, render(tokenizer, messages[1:2]) + GENERATION_PROMPT + think)
    return [system, user]


def environment_turn_ids(tokenizer, reply: dict, think: str) -> list[int]:
    """The tokens a token-in-token-out loop appends after a model turn: the turn closed (its
    `</think>`, `<|im_end|>` and eos), the environment's message as the template writes it, and
    the next generation prompt; each piece tokenized on its own, never re-tokenized."""
    closing = encode(tokenizer, (THINK_CLOSE if think else "") + END_OF_MODEL_TURN)
    after = encode(tokenizer, "\n" + render(tokenizer, [reply]) + GENERATION_PROMPT + think)
    return closing + [tokenizer.eos_token_id] + after


@contextmanager
def _engine_session(rollout_with, model_dir, sampling, knobs, longest, chat: bool = False):
    """The engine held across turns where its adapter offers a session (vLLM, SGLang: one
    load, one server); else each turn is one call of its ``rollout``."""
    opened = getattr(rollout_with, "session", None)
    if opened is None:
        yield lambda prompts, asked: rollout_with.rollout(model_dir, prompts, asked, knobs)
        return
    with opened(
        model_dir, sampling, knobs, longest=longest, **({"chat": True} if chat else {})
    ) as sample:
        yield sample


def _turns(sample, tokenizer, states, env, sampling, settings: LoopSettings, think: str,
           engine_renders: bool = False):  # fmt: skip
    """Every model turn of every trajectory, the environment answering between them; the
    last turn's fixture (its metadata is the engine's). Where the engine renders, each
    context is the conversation so far (an opened `<think>` as a last assistant message to
    continue) and the engine's fixture reports the ids it rendered."""
    last_table = None
    for t in range(settings.turns):
        if engine_renders:
            opened = [{"role": "assistant", "content": think}] if think else []
            contexts = ChatPrompts([state.messages + opened for state in states], bool(think))
        else:
            contexts = [_context(tokenizer, state, settings, think) for state in states]
        per_turn = replace(sampling, seed=sampling.seed + TURN_SEED_STRIDE * t,
                           samples_per_prompt=1)  # fmt: skip
        table = sample(contexts, per_turn)
        for i, state in enumerate(states):
            ids = [int(v) for v in table.completion_of(i)]
            logprobs = table.channels["rollout"][table.completion_slice(i)].astype(float)
            seen = [int(v) for v in table.prompt_of(i)]
            state.turns.append({"role": "assistant", "ids": ids, "logprobs": logprobs.tolist(),
                                "context_ids": seen})  # fmt: skip
            model_text = tokenizer.decode(ids, skip_special_tokens=True)
            content = f"{think}{model_text}{THINK_CLOSE if think else ''}"
            state.messages.append({"role": "assistant", "content": content})
            if t + 1 < settings.turns:
                reply = env.respond(i, t, model_text)
                state.messages.append(reply)
                ids = environment_turn_ids(tokenizer, reply, think)
                state.turns.append({"role": reply["role"], "ids": ids})
        last_table = table
    return last_table


def _context(tokenizer, state: _Trajectory, settings: LoopSettings, think: str) -> list[int]:
    if settings.mode == "tito":
        return state.flat()
    return encode(tokenizer, render(tokenizer, state.messages, add_generation_prompt=True)
                  + think)  # fmt: skip


def _fixture(states: list[_Trajectory], last_table, sampling, settings: LoopSettings):
    """The trajectories as a fixture: the prompt is what precedes the first model turn, the
    completion every later token, masked to the generated ones; metadata keeps the turns."""
    from pipeline.fixture.table import table_from_sequences

    prompts, completions, masks, logprobs, described = [], [], [], [], {}
    for state in states:
        first_model = next(k for k, turn in enumerate(state.turns) if turn["role"] == "assistant")
        prompt = [i for turn in state.turns[:first_model] for i in turn["ids"]]
        completion, mask, values = [], [], []
        for turn in state.turns[first_model:]:
            completion += turn["ids"]
            model = turn["role"] == "assistant"
            mask += [model] * len(turn["ids"])
            values += turn["logprobs"] if model else [np.nan] * len(turn["ids"])
        prompts.append(prompt)
        completions.append(completion)
        masks.append(mask)
        logprobs.append(values)
        described[state.sequence_id] = describe(state.turns, state.flat())
    metadata = dict(last_table.metadata)
    metadata["sampling"] = {**sampling.as_dict(), "per_turn_seed_stride": TURN_SEED_STRIDE}
    metadata["agent_loop"] = settings.as_dict()
    metadata["trajectories"] = described
    channels = {"rollout": logprobs}
    return table_from_sequences(
        "fixture", [s.sequence_id for s in states], prompts, completions, channels,
        masks=masks, metadata=metadata,
    )  # fmt: skip


def describe(turns: list[dict], flat: list[int]) -> dict:
    """A trajectory's turns for the fixture's metadata: role and [start, end) in the
    sequence; a model turn's context kept whole only where it is not the sequence's prefix."""
    out, start = [], 0
    for turn in turns:
        entry = {"role": turn["role"], "start": start, "end": start + len(turn["ids"])}
        context = turn.get("context_ids")
        if context is not None:
            entry["context_len"] = len(context)
            if flat[: len(context)] != list(context):
                entry["context_ids"] = list(context)
        out.append(entry)
        start += len(turn["ids"])
    return {"turns": out}
