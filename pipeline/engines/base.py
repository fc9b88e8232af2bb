"""What every engine adapter is given and must return."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol

from pipeline.fixture.table import TokenTable
from pipeline.names import canonical_dtype

LOGPROBS_MODES = ("raw", "processed")


@dataclass(frozen=True)
class SamplingParams:
    """Sampling as requested; adapters record what the engine actually applied."""

    max_tokens: int = 32
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    seed: int = 0
    samples_per_prompt: int = 1
    ignore_eos: bool = False
    # Which logprob the fixture's `rollout` channel holds: of the raw model distribution,
    # or of the distribution after temperature/top-k/top-p (what was sampled from).
    logprobs_mode: str = "raw"

    def as_dict(self) -> dict:
        return asdict(self)


class RolloutEngine(Protocol):
    name: str
    # Its knob dataclass: each field a `--set` knob, with the engine's default. `lpx engines`
    # reads it without running the engine, so its module imports no engine library at the top.
    knobs: type

    def rollout(
        self, model_dir: Path, prompts: list[list[int]], sampling: SamplingParams, knobs: dict
    ) -> TokenTable:
        """Sample completions for token-id prompts; return a fixture (kind 'fixture')."""


class ScoringEngine(Protocol):
    name: str
    knobs: type  # as RolloutEngine.knobs

    def score(self, fixture: TokenTable, model_dir: Path, knobs: dict) -> TokenTable:
        """Teacher-forced logprobs of the fixture's exact tokens (kind 'replay')."""


def knobs_from_dict(cls, knobs: dict, engine: str):
    """A knob dataclass from `--set`-style strings (or typed values), checked by field type.

    Unknown names and unparsable values raise BadInput naming the engine and the knob; a
    `dtype` field is canonicalised (fp32 -> float32).
    """
    from pipeline.errors import BadInput

    fields = cls.__dataclass_fields__
    unknown = set(knobs) - set(fields)
    if unknown:
        raise BadInput(
            f"unknown {engine} knob(s) {', '.join(sorted(unknown))}; known: {', '.join(fields)}."
        )
    values = {
        name: _coerce_knob(engine, name, value, str(fields[name].type))
        for name, value in knobs.items()
    }
    for name, value in values.items():
        _check_range(engine, name, value, fields[name].metadata)
    if values.get("dtype") is not None:
        try:
            values["dtype"] = canonical_dtype(values["dtype"])
        except ValueError as error:
            raise BadInput(f"{engine} knob dtype: {error}") from None
    return cls(**values)


def _check_range(engine: str, name: str, value, bounds) -> None:
    """Numbers are finite and >= 0 (sizes, counts, temperatures, probabilities); a field's
    metadata may raise the minimum ("min") or cap it ("max")."""
    from pipeline.errors import BadInput

    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return
    low, high = bounds.get("min", 0), bounds.get("max")
    if not math.isfinite(value) or value < low or (high is not None and value > high):
        span = f">= {low}" + (f" and <= {high}" if high is not None else "")
        raise BadInput(f"{engine} knob {name}={value!r}: must be a finite number {span}.")


def _coerce_knob(engine: str, name: str, value, annotation: str):
    from pipeline.errors import BadInput

    text = str(value).strip().lower()
    try:
        if value is None or ("None" in annotation and text == "none"):
            return None
        if annotation.startswith("bool"):
            if isinstance(value, bool) or text in (
                "1",
                "true",
                "yes",
                "on",
                "0",
                "false",
                "no",
                "off",
            ):
                return value if isinstance(value, bool) else text in ("1", "true", "yes", "on")
            raise ValueError(text)
        if annotation.startswith("int"):
            return int(value)
        if annotation.startswith("float"):
            return float(value)
        return str(value)
    except ValueError:
        raise BadInput(f"{engine} knob {name}={value!r}: expected {annotation}.") from None


@dataclass(frozen=True)
class ChatPrompts:
    """Conversations for an engine to render through its own chat path (a messages-mode
    agent loop): an adapter whose session's ``sample`` takes these says so with
    ``renders_chat`` (a name for its chat path) and records the ids its path rendered as each
    row's prompt. With ``continue_final`` the last message is an opened assistant turn that
    generation continues (an opened `<think>`), else the template's generation prompt is
    added."""

    conversations: list[list[dict]]
    continue_final: bool = False

    def __len__(self) -> int:
        return len(self.conversations)

    def __iter__(self):
        return iter(self.conversations)


def trajectories(
    prompts: list[list[int]] | ChatPrompts, sampling: SamplingParams
) -> list[tuple[str, list[int], int]]:
    """(sequence id, prompt, seed) for every sample to draw: ids are 'PROMPT-SAMPLE' and
    seeds `seed + index`, the same for every rollout engine so their fixtures line up."""
    n = sampling.samples_per_prompt
    return [
        (
            f"{p}-{s}",
            prompt if isinstance(prompts, ChatPrompts) else list(prompt),
            sampling.seed + p * n + s,
        )  # fmt: skip
        for p, prompt in enumerate(prompts)
        for s in range(n)
    ]


# Knobs that set a side's reduced-precision numerics: one an engine dropped makes the side
# compute other numerics than asked, so the stage fails loudly (exit 2) after writing what ran
NUMERICS_KNOBS = ("quantization", "kv_cache_dtype", "calculate_kv_scales")


def json_object(text, knob: str) -> dict:
    """A knob given as a JSON object (an engine's config overrides), parsed; BadInput naming
    the knob and what is wrong."""
    import json

    from pipeline.errors import BadInput

    if isinstance(text, dict):
        return text
    example = """'{"rope_theta": 500000}'"""
    try:
        value = json.loads(text)
    except ValueError as error:
        raise BadInput(f"{knob}: not JSON ({error}); give an object such as {example}.") from None
    if not isinstance(value, dict):
        raise BadInput(f"{knob}: a JSON object of config.json's keys is needed, not {text!r}.")
    return value


def dropped_numerics(metadata: dict, engine: str) -> str | None:
    """What an engine did not apply of the numerics it was asked for, in words; None when it
    applied them all (metadata.knobs_not_applied, as the engine read itself back)."""
    missed = {
        knob: values
        for knob, values in (metadata.get("knobs_not_applied") or {}).items()
        if knob in NUMERICS_KNOBS
    }
    if not missed:
        return None
    said = "; ".join(
        f"{knob}={values['requested']} (it runs {values['applied']})"
        for knob, values in missed.items()
    )
    return f"{engine} did not apply {said}"
