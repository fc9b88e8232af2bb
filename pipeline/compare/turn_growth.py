"""Drift that grows with the turns of a trajectory: a finding of its own (issue 60).

An agent loop's engine scores turn k from a context that grew over k - 1 turns: cached KV of
earlier turns, positions counted across tool turns, a context window that starts to cut. A
bug there leaves the first turns clean and the later ones drifting, and over the whole batch
its drift can stay inside the precision gate. So the drift is also read per turn.

Each compared token's |d| is taken in units of what precision alone gives it (the calibrated
floor's expected |d| for its surprisal and position, so the floor's own growth with position
is not growth), or as it is where there is no calibration. Per trajectory, two contrasts of
its turn means: the slope on the turn index (a drift that builds up), and the later turns'
mean less the first turn's (a drift that starts at a turn and stays: the first tool turn the
engine mishandles). The trajectories are the independent units, so the mean of each contrast
is tested against zero with Student's t over the trajectories (one-sided, each at ALPHA / 2,
Bonferroni), whatever the tokens of one trajectory share. A finding needs one and
two sizes: the last turn's pooled mean at least GROWTH times the first turn's, and beyond what
precision gives it: GROWTH times its floor (the smallest fault the precision gate is built to
catch, `precision_gate.FAULT_SIZE`), or without a calibration the profile's mean |d| limit.
The level matters: bf16 against bf16 drifts more late in an 8-turn trajectory of the tiny
model (0.17x its floor at turn 1, 0.26x at turn 8, t = 4.4 over 16 trajectories), which is
growth, and precision. All must hold, so noise alone raises the finding with probability at
most ALPHA per comparison.

Pure numpy and scipy.stats.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pipeline.compare.precision_gate import FAULT_SIZE

ALPHA = 1e-3  # false alarms per comparison of noise alone
GROWTH = FAULT_SIZE  # last turn over first, pooled over trajectories
MIN_TRAJECTORIES = 3  # trajectories with MIN_TURNS judged turns each
MIN_TURNS = 3
MIN_TURN_TOKENS = 2  # tokens a turn of one trajectory needs to count


@dataclass
class TurnGrowth:
    """The test's numbers: per turn index the pooled ratio to the floor (or mean |d|), the
    mean per-trajectory slope (units per turn), its t over ``trajectories`` and p."""

    turns: list[int]  # the judged turn indexes, 1-based
    ratios: list[float]
    turn_tokens: list[int]
    slope: float  # mean per-trajectory slope, units per turn
    step: float  # mean per-trajectory later turns less the first
    shape: str  # the contrast whose test is the stronger: "slope" or "later_over_first"
    t: float
    p: float
    trajectories: int
    growing: list[int]  # which trajectories (their index) have a positive slope
    calibrated: bool
    level_needed: float  # the last turn's level a finding needs (units of ``ratios``)
    alpha: float = ALPHA

    @property
    def growth(self) -> float:
        first, last = self.ratios[0], self.ratios[-1]
        if first > 0:
            return last / first
        return float("inf") if last > 0 else 0.0  # the first turn bit for bit equal

    @property
    def found(self) -> bool:
        return (
            self.p < self.alpha and self.growth >= GROWTH and self.ratios[-1] >= self.level_needed
        )

    def first_grown_turn(self) -> int:
        """The first turn (1-based) whose pooled ratio reaches GROWTH times the first's."""
        base = self.ratios[0]
        return next(
            (
                k
                for k, r in zip(self.turns, self.ratios, strict=True)
                if r > 0 and r >= GROWTH * base
            ),
            0,
        )


def turn_growth(
    turn, abs_diff, offsets, expected=None, limit: float | None = None, alpha: float = ALPHA
) -> TurnGrowth | None:
    """The growth test on one comparison. Per compared token: ``turn`` (0-based model-turn
    index, -1 for none), ``abs_diff`` and, where calibrated, ``expected`` (its floor's mean
    |d|); ``offsets`` split the tokens into trajectories; ``limit``: the profile's mean |d|
    limit, the level the last turn must pass where there is no calibration. None where too
    few trajectories or turns were judged to test anything, or nothing says what level is
    beyond precision."""
    from scipy.stats import t as student

    if expected is None and limit is None:
        return None
    turn = np.asarray(turn, dtype=np.int64)
    units = np.asarray(abs_diff, dtype=np.float64)
    if expected is not None:
        units = units / np.maximum(np.asarray(expected, dtype=np.float64), 1e-12)
    offsets = np.asarray(offsets, dtype=np.int64)
    turns = int(turn.max(initial=-1)) + 1
    if turns < MIN_TURNS:
        return None
    slopes, steps, rows = _contrasts(turn, units, offsets, turns)
    if len(slopes) < MIN_TRAJECTORIES:
        return None
    growing = [int(j) for j in rows[(slopes > 0) | (steps > 0)]]
    t_slope, t_step = _t(slopes), _t(steps[np.isfinite(steps)])
    m = len(slopes)
    p_slope = float(student.sf(t_slope, m - 1))
    p_step = float(student.sf(t_step, max(1, int(np.isfinite(steps).sum()) - 1)))
    shape, t, p = (
        ("slope", t_slope, p_slope) if p_slope <= p_step else ("later_over_first", t_step, p_step)
    )
    ratios, counts = [], []
    for k in range(turns):
        chosen = units[turn == k]
        ratios.append(float(chosen.mean()) if len(chosen) else float("nan"))
        counts.append(int(len(chosen)))
    judged = [k for k in range(turns) if counts[k] > 0]
    return TurnGrowth(
        turns=[k + 1 for k in judged],
        ratios=[ratios[k] for k in judged],
        turn_tokens=[counts[k] for k in judged],
        slope=float(slopes.mean()),
        step=float(np.nanmean(steps)) if np.isfinite(steps).any() else 0.0,
        shape=shape,
        t=float(t),
        p=min(1.0, 2.0 * p),  # the smaller of two tests' p, Bonferroni
        trajectories=m,
        growing=growing,
        calibrated=expected is not None,
        level_needed=GROWTH if expected is not None else float(limit),
        alpha=alpha,
    )


def _t(values: np.ndarray) -> float:
    if len(values) < 2:
        return 0.0
    mean, sd = float(values.mean()), float(values.std(ddof=1))
    return mean / (sd / np.sqrt(len(values))) if sd > 0 else (np.inf if mean > 0 else 0.0)


def _contrasts(turn, units, offsets, turns: int):
    """Per trajectory with MIN_TURNS judged turns: the least-squares slope of its turn means
    on the turn index, its later turns' mean less its first turn's (NaN without a judged
    first turn), and which trajectories (their index) those are."""
    lengths = np.diff(offsets)
    trajectory = np.repeat(np.arange(len(lengths)), lengths)
    judged = turn >= 0
    cell = trajectory[judged] * turns + turn[judged]
    size = len(lengths) * turns
    counts = np.bincount(cell, minlength=size).reshape(-1, turns)
    sums = np.bincount(cell, weights=units[judged], minlength=size).reshape(-1, turns)
    used = counts >= MIN_TURN_TOKENS
    means = np.where(used, sums / np.maximum(counts, 1), 0.0)
    k = np.arange(1, turns + 1, dtype=np.float64)[None, :]
    n = used.sum(axis=1)
    rows = np.flatnonzero(n >= MIN_TURNS)
    used, means, n = used[rows], means[rows], n[rows]
    k_mean = (k * used).sum(axis=1) / n
    y_mean = (means * used).sum(axis=1) / n
    dk = (k - k_mean[:, None]) * used
    slopes = (dk * (means - y_mean[:, None])).sum(axis=1) / (dk * dk).sum(axis=1)
    later = used[:, 1:].sum(axis=1)
    later_mean = (means[:, 1:] * used[:, 1:]).sum(axis=1) / np.maximum(later, 1)
    steps = np.where(used[:, 0] & (later > 0), later_mean - means[:, 0], np.nan)
    return slopes, steps, rows


_named = {"slope": "slope's", "later_over_first": "later turns'"}


def growth_finding(test: TurnGrowth, sequence_ids: list[str]):
    """The `turn_growth` finding of a test that found growth."""
    from pipeline.contracts.causes import Cause, Severity, Status
    from pipeline.contracts.report import Finding

    def level(k: int) -> str:
        value = test.ratios[k]
        return f"{value:.2f}x its floor" if test.calibrated else f"mean |d| {value:.3g}"

    first = test.first_grown_turn()
    finite = np.isfinite(test.growth)
    growth = (
        f"{test.growth:.1f}x the first; {GROWTH:g}x the first from turn {first}"
        if finite
        else f"turn {test.turns[0]} bit for bit equal; drifting from turn {first}"
    )
    chosen = [sequence_ids[j] for j in test.growing]
    return Finding(
        cause=Cause.TURN_GROWTH,
        sequences=chosen,
        sequence_count=len(chosen),
        first_position={"turn": first},
        evidence=(
            f"the drift grows with the turns: turn {test.turns[0]} at {level(0)}, turn "
            f"{test.turns[-1]} at {level(-1)} ({growth}); per trajectory, a slope of {test.slope:+.3g} per turn and the later "
            f"turns {test.step:+.3g} over the first, t = {test.t:.1f} (the {_named[test.shape]}) over "
            f"{test.trajectories} trajectories (p = {test.p:.1e}; noise alone does this in at "
            f"most {test.alpha:g} of comparisons). "
            "What grows with the context an engine carries across turns: its cached KV "
            "(precision, reuse), positions counted across tool turns, a window that cuts."
        ),
        severity=Severity.FAULT,
        status=Status.PLAUSIBLE,
        details={
            "per_turn": [
                {
                    "turn": k,
                    "tokens": n,
                    ("ratio_to_floor" if test.calibrated else "mean_abs_diff"): r,
                }
                for k, r, n in zip(test.turns, test.ratios, test.turn_tokens, strict=True)
            ],
            "test": test.shape,
            "slope_per_turn": test.slope,
            "later_over_first": test.step,
            "t": test.t,
            "p": test.p,
            "trajectories": test.trajectories,
            "growth": test.growth if finite else None,  # None: turn 1 bit for bit equal
            "growth_needed": GROWTH,
            "last_turn_level_needed": test.level_needed,
            "alpha": test.alpha,
            "calibrated": test.calibrated,
        },
    )


def growth_findings(turn, aligned, expected=None, limit: float | None = None) -> list:
    """A `turn_growth` finding where the drift grows with the turns beyond what noise does,
    else none: ``turn`` each compared token's model turn (`trajectory.fixture.token_turns`),
    ``expected`` each token's calibrated mean |d|, or ``limit`` the profile's mean |d|
    limit."""
    region = aligned.completion
    abs_diff = np.abs(region.train.astype(np.float64) - region.rollout.astype(np.float64))
    test = turn_growth(turn, abs_diff, region.offsets, expected, limit)
    if test is None or not test.found:
        return []
    return [growth_finding(test, list(aligned.sequence_ids))]
