"""History-relative regression detection: robust baselines, bands and point statuses.

Pure functions over plain numbers; the history code (evaluate.py) feeds them one series
point at a time and stores what they return. The rule, per series and metric:

* baseline: the median of the last ``lookback`` healthy points (healthy = judged inside
  its band, or judged before the series had ``min_points``; never an excluded point or a
  point of an error run), counted from the latest reset (a "distribution change"
  annotation or an acknowledged alert);
* build segments: a point whose engine builds differ from the previous point's starts a
  new baseline segment, so a band never mixes builds. Until the new segment has
  ``min_points`` of its own, its points are judged against the previous segment's healthy
  points (the *reference*, however few: one night of the old build is enough to see a step),
  so an upgrade in the first nights is judged, and an alert after it names it;
* band: ``max(k * 1.4826 * MAD, relative_floor * |median - ideal|, absolute_floor)``, where
  1.4826 * MAD estimates the standard deviation of normal noise (robust to the spikes that
  mean/std baselines absorb), ``ideal`` is the metric's perfect value (0 for drifts, 1 for
  IS ratios and ESS) and the absolute floor scales with the policy profile's tau, so a
  metric that sits at fp32 noise (1e-6) never alarms on noise;
* status: outside the band on the bad side -> ``suspicious``; ``consecutive`` violating
  points in a row -> ``regression``; fewer than ``min_points`` baseline points ->
  ``insufficient_data`` (judged healthy, so the baseline can form).

References: the PyTorch HUD's regression/suspicious/insufficient_data labels; conbench's
lookback z-score (we use median/MAD instead of mean/std: one spike moves neither);
Bencher's stored per-point boundaries. Defaults and their reasons: docs/history.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

import numpy as np

MAD_TO_SIGMA = 1.4826  # MAD * 1.4826 = sigma for normal noise

OK = "ok"
SUSPICIOUS = "suspicious"
REGRESSION = "regression"
INSUFFICIENT = "insufficient_data"
EXCLUDED = "excluded"
ERROR_RUN = "error_run"
UNTRACKED = "untracked"
# outside the band, but the tokens changed and the tokens both nights share did not move:
# the workload changed, not the numerics; the baseline starts again from this point
WORKLOAD_CHANGED = "workload_changed"
HEALTHY = (OK, INSUFFICIENT, WORKLOAD_CHANGED)
VIOLATING = (SUSPICIOUS, REGRESSION)


@dataclass(frozen=True)
class DetectionConfig:
    lookback: int = 20  # healthy points in the baseline (about three weeks of nightlies)
    min_points: int = 5  # below this the series has insufficient_data
    mad_multiplier: float = 5.0  # k: conbench alerts at |z| >= 5
    relative_floor: float = 0.2  # 20 % of the baseline's distance from ideal
    consecutive: int = 2  # violating points in a row that make a regression


@dataclass(frozen=True)
class MetricSpec:
    """How one metric is judged: its unit, which way is better, its ideal value and the
    absolute floor of its band as a function of the policy profile's tau."""

    unit: str
    better: str  # lower | higher | none (a move either way is drift)
    ideal: float
    floor: Callable[[float], float]
    detect: bool = True


def _diff_tail(tau: float) -> float:  # tails of |d|: one token at tau is the policy's line
    return tau


def _diff_mean(tau: float) -> float:
    # Means of |d| sit well below the tails. fp32: 5e-6, so any value at fp32's 1e-6 noise
    # level never alarms; bf16: 0.005, under bf16's own mean |d| (0.004-0.015), so a
    # 0.004 -> 0.012 drift is seen.
    return tau / 20


def _diff_square(tau: float) -> float:  # k2/k3 ~ mean(d^2)/2
    return _diff_mean(tau) ** 2 / 2


def _fraction(_tau: float) -> float:  # one percentage point of tokens
    return 0.01


NATS, NATS2, PROB, RATIO, FRACTION = "nats", "nats^2", "prob", "ratio", "fraction"
CATALOG: dict[str, MetricSpec] = {
    "max_abs_diff": MetricSpec(NATS, "lower", 0.0, _diff_tail),
    "p99_abs_diff": MetricSpec(NATS, "lower", 0.0, _diff_tail),
    "p999_abs_diff": MetricSpec(NATS, "lower", 0.0, _diff_tail),
    "p50_abs_diff": MetricSpec(NATS, "lower", 0.0, _diff_mean),
    "mean_abs_diff": MetricSpec(NATS, "lower", 0.0, _diff_mean),
    "rms_diff": MetricSpec(NATS, "lower", 0.0, _diff_mean),
    "max_seq_mean_abs_diff": MetricSpec(NATS, "lower", 0.0, _diff_mean),
    "mean_diff": MetricSpec(NATS, "none", 0.0, _diff_mean),
    "k1": MetricSpec(NATS, "none", 0.0, _diff_mean),
    "k2": MetricSpec(NATS2, "lower", 0.0, _diff_square),
    "k3": MetricSpec(NATS2, "lower", 0.0, _diff_square),
    # E[r^2] - 1 = 2 mean(d) + 2 mean(d^2) + ...: first order in the signed mean, so it sits
    # at fp32 noise on either side of 0 (+-1e-7) and its floor is the mean's, not a square's
    "chi2_token": MetricSpec(RATIO, "lower", 0.0, lambda tau: 2 * _diff_mean(tau)),
    "is_ratio_mean": MetricSpec(RATIO, "none", 1.0, _diff_mean),
    "token_mult_prob_error": MetricSpec(RATIO, "lower", 1.0, _diff_mean),
    "ess": MetricSpec(FRACTION, "higher", 1.0, lambda tau: 2 * _diff_square(tau)),
    "max_prob_diff": MetricSpec(PROB, "lower", 0.0, _diff_tail),
    "mean_prob_diff": MetricSpec(PROB, "lower", 0.0, _diff_mean),
    "frac_over_tau": MetricSpec(FRACTION, "lower", 0.0, _fraction),
    "clip_frac": MetricSpec(FRACTION, "lower", 0.0, _fraction),
    "top1_flip_rate": MetricSpec(FRACTION, "lower", 0.0, _fraction),
    # MoE: tokens routed to other experts on any layer (layer_N.routing_flip_rate per layer)
    "routing_flip_rate": MetricSpec(FRACTION, "lower", 0.0, _fraction),
    # |d| / |logp| explodes near logp = 0: charted, never judged (as in the policy).
    "max_rel_diff": MetricSpec(RATIO, "lower", 0.0, _diff_tail, detect=False),
    "mean_rel_diff": MetricSpec(RATIO, "lower", 0.0, _diff_tail, detect=False),
}
# The correction view's flat metrics (compare/correction.py), under verl's names: judged as
# the drift metrics they follow (an IS weight's spread is a drift's, a masked share a
# fraction of tokens)
CATALOG.update(
    {
        "rollout_corr/rollout_is_mean": MetricSpec(RATIO, "none", 1.0, _diff_mean),
        "rollout_corr/rollout_is_std": MetricSpec(RATIO, "lower", 0.0, _diff_mean),
        "rollout_corr/rollout_is_min": MetricSpec(RATIO, "higher", 1.0, _diff_tail),
        "rollout_corr/rollout_is_max": MetricSpec(RATIO, "lower", 1.0, _diff_tail),
        "rollout_corr/rollout_is_eff_sample_size": CATALOG["ess"],
        "rollout_corr/kl": CATALOG["k1"],
        "rollout_corr/k3_kl": CATALOG["k3"],
        "rollout_corr/chi2_token": CATALOG["chi2_token"],
        "rollout_corr/chi2_seq": MetricSpec(RATIO, "lower", 0.0, _diff_tail),
        "rollout_corr/log_ppl_diff": CATALOG["mean_diff"],
        "rollout_corr/log_ppl_abs_diff": CATALOG["mean_abs_diff"],
        "rollout_corr/ppl_ratio": MetricSpec(RATIO, "none", 1.0, _diff_mean),
        "training/rollout_probs_diff_mean": CATALOG["mean_prob_diff"],
        "training/rollout_probs_diff_max": CATALOG["max_prob_diff"],
        "training/rollout_probs_diff_std": MetricSpec(PROB, "lower", 0.0, _diff_mean),
    }
    | {
        f"{prefix}/{name}": CATALOG["frac_over_tau"]
        for prefix, name in (
            ("rollout_corr", "rollout_is_ratio_fraction_high"),
            ("rollout_corr", "rollout_is_ratio_fraction_low"),
            ("rollout_corr", "rollout_rs_masked_fraction"),
            ("rollout_corr", "rollout_rs_seq_masked_fraction"),
            ("lpx_corr", "truncated_tokens_fraction"),
            ("lpx_corr", "truncated_sequences_fraction"),
            ("lpx_corr", "masked_tokens_fraction"),
            ("lpx_corr", "masked_sequences_fraction"),
        )
    }
)
KEY_METRICS = ("max_abs_diff", "mean_abs_diff", "k3", "top1_flip_rate")


@lru_cache(maxsize=1024)
def metric_spec(name: str) -> MetricSpec:
    """The catalog entry; a metric lpx does not know is judged two-sided with floor tau."""
    base = name.split(".")[-1]  # "prompt.max_abs_diff" is judged like max_abs_diff
    return CATALOG.get(base, MetricSpec("", "none", 0.0, _diff_tail))


class Boundary(NamedTuple):  # a NamedTuple: built a few hundred thousand times a year
    baseline: float
    band: float
    lower: float
    upper: float
    points: int


def robust_boundary(
    window: Sequence[float],
    spec: MetricSpec,
    tau: float,
    config: DetectionConfig,
    min_points: int | None = None,
) -> Boundary | None:
    """The band around the median of ``window`` (finite values, as ``step`` keeps them);
    None with fewer than ``min_points`` values (the config's by default)."""
    n = len(window)
    if n < (config.min_points if min_points is None else min_points) or n == 0:
        return None
    # Plain sorts on <= lookback floats: ~10x faster than numpy at this size, and recording
    # a year of nightlies judges a few hundred thousand points.
    median = _median(sorted(window))
    mad = _median(sorted([abs(v - median) for v in window]))
    band = max(
        config.mad_multiplier * MAD_TO_SIGMA * mad,
        config.relative_floor * abs(median - spec.ideal),
        spec.floor(tau),
    )
    return Boundary(median, band, median - band, median + band, n)


def robust_boundaries(
    windows: Sequence[Sequence[float]],
    specs: Sequence[MetricSpec],
    tau: float | Sequence[float],
    config: DetectionConfig,
    min_points: Sequence[int] | None = None,
) -> list[Boundary | None]:
    """``robust_boundary`` of many windows at once (a run's metrics), exactly equal to it:
    windows of one length are sorted together in numpy, a tenth of the per-window cost.
    ``tau`` is one value or one per window; ``min_points`` one minimum per window."""
    taus = [tau] * len(windows) if isinstance(tau, (int, float)) else list(tau)
    minimums = [config.min_points] * len(windows) if min_points is None else list(min_points)
    out: list[Boundary | None] = [None] * len(windows)
    by_length: dict[int, list[int]] = {}
    for i, window in enumerate(windows):
        if len(window) >= max(minimums[i], 1):
            by_length.setdefault(len(window), []).append(i)
    for n, rows in by_length.items():
        values = np.array([windows[i] for i in rows], dtype=np.float64)
        median = _medians(np.sort(values, axis=1))
        mad = _medians(np.sort(np.abs(values - median[:, None]), axis=1))
        ideal = np.array([specs[i].ideal for i in rows])
        floor = np.array([specs[i].floor(taus[i]) for i in rows])
        band = np.maximum(
            np.maximum(
                config.mad_multiplier * MAD_TO_SIGMA * mad,
                config.relative_floor * np.abs(median - ideal),
            ),
            floor,
        )
        for row, i in enumerate(rows):
            m, b = float(median[row]), float(band[row])
            out[i] = Boundary(m, b, m - b, m + b, n)
    return out


def _medians(ordered: np.ndarray) -> np.ndarray:
    n = ordered.shape[1]
    return ordered[:, n // 2] if n % 2 else (ordered[:, n // 2 - 1] + ordered[:, n // 2]) / 2


def _median(ordered: list[float]) -> float:
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def violates(value: float | None, boundary: Boundary, better: str) -> bool:
    """Outside the band on the bad side; a non-finite value always violates."""
    if value is None or not math.isfinite(value):
        return True
    if better == "lower":
        return value > boundary.upper
    if better == "higher":
        return value < boundary.lower
    return not boundary.lower <= value <= boundary.upper


class PointResult(NamedTuple):
    status: str
    boundary: Boundary | None
    first_bad: int | None  # the episode's first violating point (violating statuses)
    last_good: int | None  # the last healthy point before it


def new_state() -> dict:
    """Detection state of one series metric, JSON-able and stored with the series: the
    baseline window (finite values, oldest first), the current violation streak (point ids)
    and the last healthy point; once builds are known, the build segment the window belongs
    to (``build``) and, early in a segment, the previous segments' healthy values
    (``reference``)."""
    return {"window": [], "streak": [], "last_good": None}


def enter_build(state: dict, build: str | None, config: DetectionConfig) -> dict:
    """The state a point of ``build`` is judged from. Another build than the state's starts
    a new segment: its window starts empty, and the old segment's healthy values become the
    reference its first points are judged against (a short old segment adds to the reference
    it had, so builds that change every night still build up a baseline)."""
    if build is None or state.get("build") == build:
        return state
    if state.get("build") is None:  # the first point that knows its build (or an old state)
        return {**state, "build": build}
    window = state.get("window") or []
    if len(window) >= config.min_points:
        reference = window
    else:
        reference = [*(state.get("reference") or []), *window][-config.lookback :]
    return {**state, "window": [], "reference": reference, "build": build}


def judged_window(state: dict, config: DetectionConfig) -> tuple[list[float], int]:
    """The values a point is judged against and how many it needs: the segment's own window
    once it has min_points, else the reference (any number of values), else the window (too
    short: insufficient_data)."""
    window = state.get("window") or []
    reference = state.get("reference") or []
    if len(window) >= config.min_points or not reference:
        return window, config.min_points
    return reference, 1


def step(
    state: dict,
    point_id: int,
    value: float | None,
    spec: MetricSpec,
    tau: float,
    config: DetectionConfig,
    *,
    reset: bool = False,
    excluded: bool = False,
    error_run: bool = False,
    boundary: Boundary | None | bool = False,
    build: str | None = None,
    same_tokens: tuple[float, float] | None = None,
) -> tuple[dict, PointResult]:
    """Judge one new point of a series metric against the state before it.

    Returns the state after it and the point's result. ``reset`` starts a new baseline at
    this point (distribution change, acknowledged alert; the reference is dropped too); an
    excluded point or a point of an error run is recorded with its status and changes
    nothing. ``build`` names the point's engine builds (``enter_build``). ``boundary`` may
    pass in the boundary of ``judged_window`` computed by ``robust_boundaries`` (False:
    compute it here). ``same_tokens`` is the metric last night and tonight on the tokens both
    nights share, where the tokens changed (pipeline/history/workload.py): a point outside
    the band whose shared tokens stayed within it is ``workload_changed``.
    """
    if reset:
        state = {"window": [], "streak": [], "last_good": state.get("last_good")}
        if build is not None:
            state["build"] = build
    if error_run or excluded or not spec.detect:
        status = ERROR_RUN if error_run else EXCLUDED if excluded else UNTRACKED
        return state, PointResult(status, None, None, None)
    state = enter_build(state, build, config)
    if boundary is False:
        judged, needed = judged_window(state, config)
        boundary = robust_boundary(judged, spec, tau, config, needed)
    segment = {k: state[k] for k in ("build", "reference") if state.get(k) is not None}
    window = state.get("window") or []
    if boundary is not None and violates(value, boundary, spec.better):
        # only against a healthy night: a bad night's tokens agreeing with tonight's say
        # nothing about whether the numerics came back
        healthy_before = not state.get("streak")
        if same_tokens is not None and healthy_before and _numerics_held(same_tokens, spec, config):
            # a new level set by new tokens: judge the next nights against it, not the old
            new = {"window": [], "streak": [], "last_good": point_id, **segment}
            new["reference"] = [float(f"{value:.6g}")] if value is not None else []
            return new, PointResult(WORKLOAD_CHANGED, boundary, None, None)
        streak = [*state.get("streak", []), point_id]
        status = REGRESSION if len(streak) >= config.consecutive else SUSPICIOUS
        return (
            {"window": window, "streak": streak, "last_good": state.get("last_good"), **segment},
            PointResult(status, boundary, streak[0], state.get("last_good")),
        )
    if value is not None and math.isfinite(value):
        # 6 significant digits: the state is rewritten with the series on every point, and
        # a median/MAD band never needs more.
        window = [*window, float(f"{value:.6g}")][-config.lookback :]
    if len(window) >= config.min_points:
        segment.pop("reference", None)  # the segment judges by its own points from now on
    new = {"window": window, "streak": [], "last_good": point_id, **segment}
    return new, PointResult(OK if boundary is not None else INSUFFICIENT, boundary, None, None)


def _numerics_held(
    same_tokens: tuple[float, float], spec: MetricSpec, config: DetectionConfig
) -> bool:
    """Whether the tokens both nights share kept their value: within the relative floor of
    last night's (20 %), never the absolute floor. The same tokens in the same context
    under the same numerics score the same up to the engine's nondeterminism, so a tolerance
    made for comparing different samples would let a numeric change pass as new tokens."""
    before, after = same_tokens
    if before is None or after is None or not (math.isfinite(before) and math.isfinite(after)):
        return False
    return abs(after - before) <= config.relative_floor * abs(before - spec.ideal)


def policy_step(
    state: dict, point_id: int, verdict: str, *, excluded: bool = False, error_run: bool = False
) -> tuple[dict, PointResult]:
    """The absolute rule as a series of its own: a failing verdict is a policy_violation."""
    state = {**new_state(), **state}
    if error_run or excluded:
        return state, PointResult(ERROR_RUN if error_run else EXCLUDED, None, None, None)
    if verdict != "pass":
        streak = [*state["streak"], point_id]
        state = {**state, "streak": streak}
        return state, PointResult("policy_violation", None, streak[0], state["last_good"])
    state = {**state, "streak": [], "last_good": point_id}
    return state, PointResult(OK, None, None, None)


def factor(before: float | None, after: float | None) -> float | None:
    """after / before, the regressions table's "factor"; None where it means nothing."""
    if before is None or after is None or not math.isfinite(after) or before == 0:
        return None
    return after / before
