"""The fault registry: every fault kind, the settings it is committed with, and `rescore`.

A fault is the bug as an engine would commit it, run through the model's own forward, so the
drift it plants has exactly the shape the real bug gives. `lpx inject`, the zoo's benchmarks
and the verifier's re-scoring find each kind here; the kinds themselves are `zoo.py`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from pipeline.faults.forward import score_sequence


class Fault(NamedTuple):
    cause: str | None  # what the diagnosis should name
    bug: str  # the real bug it stands for
    commit: Callable  # (model, pairs, settings) -> each pair's completion logprobs under it


FAULTS: dict[str, Fault] = {}  # kind -> its Fault, in the order the zoo plants them


def register(kind: str, cause: str | None, bug: str, commit: Callable) -> None:
    """A fault kind: `lpx inject`, the zoo and the verifier's re-scoring find it here. A new
    kind is its commit function and this call, nothing else."""
    FAULTS[kind] = Fault(cause, bug, commit)


@dataclass(frozen=True)
class FaultSettings:
    micro_batch: int = 8  # padding and packing faults act within micro-batches of this size
    temperature: float = 0.7
    top_k: int = 8
    top_p: float = 0.8
    at: int = 8  # version_change, position_ids: the completion index where the fault starts
    keep_prompt: float = 0.75  # prompt_truncated: prompts cut to this fraction of the longest
    max_prompt: int | None = None  # prompt_truncated: or to this many tokens, when given
    step_lr: float = 1e-4  # stale_weights / version_change: one AdamW step of this size
    position_offset: int = 16
    # position_ids: where >= 0, the offset starts at this prompt index in every sequence
    # (a system prompt's reserved positions counted twice), not at completion index `at`
    prompt_start: int = -1
    bos_id: int = 1
    presence_penalty: float = 0.5  # penalties
    frequency_penalty: float = 0.3
    repetition_penalty: float = 1.3  # repetition_penalty
    soft_cap: float = 5.0  # soft_cap
    min_p: float = 0.1  # min_p
    logit_bias: float = 2.0  # logit_bias: added to the four commonest completion tokens


def rescore(model, pairs: list, kind: str, settings: FaultSettings) -> list[np.ndarray]:
    """Completion logprobs of every (prompt ids, completion ids) pair under fault ``kind``
    (``clean``: no fault, the reference layout)."""
    import torch

    with torch.no_grad():
        if kind == "clean":  # the reference itself, each sequence in its own row
            return [score_sequence(model, p, c) for p, c in pairs]
        if kind not in FAULTS:
            raise ValueError(f"unknown fault kind {kind!r}; known: {', '.join(FAULTS)}")
        return FAULTS[kind].commit(model, pairs, settings)
