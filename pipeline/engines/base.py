"""What every engine adapter is given and must return."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol

from pipeline.fixture.table import TokenTable

DTYPES = ("float32", "bfloat16", "float16")
DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}
LOGPROBS_MODES = ("raw", "processed")


def canonical_dtype(name: str) -> str:
    dtype = DTYPE_ALIASES.get(name, name)
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; use one of fp32, bf16, fp16")
    return dtype


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

    def rollout(
        self, model_dir: Path, prompts: list[list[int]], sampling: SamplingParams, knobs: dict
    ) -> TokenTable:
        """Sample completions for token-id prompts; return a fixture (kind 'fixture')."""


class ScoringEngine(Protocol):
    name: str

    def score(self, fixture: TokenTable, model_dir: Path, knobs: dict) -> TokenTable:
        """Teacher-forced logprobs of the fixture's exact tokens (kind 'replay')."""
