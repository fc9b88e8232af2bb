"""Which side of a comparison a bug moved, and which of a finding's sequences a hypothesis
is screened on: what the shared judgement and the families that judge themselves (numerics)
both ask before re-scoring."""

from __future__ import annotations

import numpy as np

from pipeline.compare.calibrated import side_precision
from pipeline.verify.hypothesis import SCREEN_SEQUENCES
from pipeline.verify.search import mean_abs


def moved_side(ref, rollout, replay, clean, positions) -> str:
    """The side farther from the clean reference, each side's distance in units of the
    noise its own precision gives against fp32: a bf16 side's noise must not outweigh a
    bug on an fp32 side (over a long completion, a BOS fault in the first tokens moves its
    side's mean less than bf16 noise moves the other's; a top-p on a flat distribution
    moves every token by less than that noise's tail)."""

    def excess(values, meta) -> float:
        noise = ref.token_floors((side_precision(meta), "float32"), clean, positions)
        return mean_abs(values, clean) / max(float(np.mean(np.concatenate(noise))), 1e-12)

    ours = excess(rollout, ref.fixture.metadata)
    theirs = excess(replay, ref.replay.metadata)
    return "rollout" if ours >= theirs else "replay"


def screen_rows(rows: list[int], rollout, replay, positions) -> list[int]:
    """The most drifting row and the one at the median drift (mean |d| of each row), in
    their order among ``rows``; every row where there are no more than SCREEN_SEQUENCES."""
    if len(rows) <= SCREEN_SEQUENCES:
        return rows
    drift = np.array([mean_abs([a], [b]) for a, b in zip(rollout, replay, strict=True)])
    order = np.argsort(-drift, kind="stable")
    picked = {int(order[0]), int(order[len(order) // 2])}
    return [rows[i] for i in sorted(picked)]
