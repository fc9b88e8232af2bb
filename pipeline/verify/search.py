"""The shared search: a family declares the values its free parameters can take (a grid, or
an interval for a continuous one) and how a value commits the bug; the search scores each
value on one observed sequence by mean |d| and keeps the closest. Two ways of scoring: a
re-score of the sequence per value, or (for bugs of the sampler: a temperature, a
truncation) one forward whose logits each value re-processes."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import replace

import numpy as np

from pipeline.faults.forward import completion_logits, select_processed

SEARCH_LOGITS = 1 << 26  # fp32 logits (256 MiB) kept for a search that re-processes them
GOLDEN_STEPS = 45  # golden-section steps: to ~1e-9 of the interval, an fp32 reproduction


def mean_abs(a: list, b: list) -> float:
    """Mean |a - b| over the finite pairs of two lists of per-sequence arrays."""
    a, b = np.concatenate(a), np.concatenate(b)
    keep = np.isfinite(a) & np.isfinite(b)
    return float(np.mean(np.abs(a[keep] - b[keep]))) if keep.any() else 0.0


def closest(values: Iterable, gap: Callable[[object], float]):
    """The value whose commitment leaves the least gap (the first of equals)."""
    return min(values, key=gap)


def golden_section(
    gap: Callable[[float], float], low: float, high: float, steps: int = GOLDEN_STEPS
) -> float:
    """The minimum of a unimodal gap on [low, high], by ``steps`` golden-section steps."""
    ratio = (np.sqrt(5) - 1) / 2
    a, b = high - ratio * (high - low), low + ratio * (high - low)
    ga, gb = gap(a), gap(b)
    for _ in range(steps):
        if ga < gb:
            high, b, gb = b, a, ga
            a = high - ratio * (high - low)
            ga = gap(a)
        else:
            low, a, ga = a, b, gb
            b = low + ratio * (high - low)
            gb = gap(b)
    return (low + high) / 2


def rescored_gap(ref, row: int, observed) -> Callable:
    """gap(candidate): how far one sequence re-scored under the candidate lies from its
    observed side."""

    def gap(candidate) -> float:
        (scored,) = ref.rescore(candidate, [row])
        return mean_abs([observed], [scored])

    return gap


def with_settings(candidate, params: dict, **settings):
    """The candidate committing other parameter values."""
    return replace(candidate, settings=replace(candidate.settings, **settings), params=params)


class Processed:
    """One forward's fp32 logits of a sequence (as many leading completion tokens as
    SEARCH_LOGITS holds), for the searches that re-process them: `gap(processing)` re-scores
    them under a sampler's processing (a temperature, a top-k, a top-p)."""

    def __init__(self, ref, row: int, observed):
        vocab = ref.model.get_output_embeddings().weight.shape[0]
        keep = max(8, SEARCH_LOGITS // vocab)
        self.completion = ref.fixture.completion_of(row)[:keep]
        self.logits = completion_logits(ref.model, ref.fixture.prompt_of(row), self.completion)
        self.mask = ref.mask(row)[:keep]
        self.observed = observed[: int(self.mask.sum())]

    def scores(self, processing: dict | None = None) -> np.ndarray:
        return select_processed(self.logits, self.completion, processing)[self.mask].astype(
            np.float64
        )

    def gap(self, processing: dict) -> float:
        return mean_abs([self.observed], [self.scores(processing)])
