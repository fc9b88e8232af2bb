"""Detection as pure functions on seeded synthetic series (no database)."""

import math

import numpy as np
import pytest

from pipeline.history.attribution import changes, point_description, summary
from pipeline.history.detection import (
    ERROR_RUN,
    EXCLUDED,
    INSUFFICIENT,
    OK,
    REGRESSION,
    SUSPICIOUS,
    DetectionConfig,
    metric_spec,
    new_state,
    policy_step,
    robust_boundaries,
    robust_boundary,
    step,
)

CONFIG = DetectionConfig()
BF16_TAU, FP32_TAU = 0.1, 1e-4


def judge(values, name="mean_abs_diff", tau=BF16_TAU, config=CONFIG, flags_at=None):
    """Statuses (and results) of a whole series, point ids 0..n-1; flags_at[i] -> step flags."""
    state, results = new_state(), []
    for i, value in enumerate(values):
        flags = (flags_at or {}).get(i, {})
        state, result = step(state, i, value, metric_spec(name), tau, config, **flags)
        results.append(result)
    return [r.status for r in results], results


def test_band_is_the_documented_formula():
    spec = metric_spec("mean_abs_diff")
    b = robust_boundary([1, 2, 3, 4, 5], spec, BF16_TAU, CONFIG)
    assert b.baseline == 3 and b.points == 5
    assert b.band == pytest.approx(5 * 1.4826 * 1.0)  # MAD term wins
    flat = robust_boundary([0.004] * 10, spec, BF16_TAU, CONFIG)
    assert flat.band == pytest.approx(0.005)  # absolute floor tau/20
    big = robust_boundary([10.0] * 10, spec, BF16_TAU, CONFIG)
    assert big.band == pytest.approx(2.0)  # relative floor 20 % of |median - 0|
    ess = robust_boundary([0.5] * 10, metric_spec("ess"), BF16_TAU, CONFIG)
    assert ess.band == pytest.approx(0.1)  # 20 % of the distance from ess's ideal 1.0
    assert robust_boundary([1.0] * 4, spec, BF16_TAU, CONFIG) is None  # < min_points


def test_the_batch_boundary_equals_the_single_one_exactly():
    rng = np.random.default_rng(1)
    windows = [list(rng.lognormal(-5, 0.5, n)) for n in (3, 5, 6, 20, 20, 19, 7)]
    specs = [
        metric_spec(name)
        for name in (
            "k3",
            "mean_abs_diff",
            "ess",
            "max_abs_diff",
            "k3",
            "mean_diff",
            "top1_flip_rate",
        )
    ]
    batch = robust_boundaries(windows, specs, BF16_TAU, CONFIG)
    single = [robust_boundary(w, s, BF16_TAU, CONFIG) for w, s in zip(windows, specs, strict=True)]
    assert batch == single and batch[0] is None and batch[3] is not None


def test_step_regression_is_flagged_at_the_step_with_last_good_and_first_bad():
    rng = np.random.default_rng(0)
    values = list(0.004 * np.exp(rng.normal(0, 0.05, 40)))
    values[30:] = [v * 3 for v in values[30:]]  # 0.004 -> 0.012: above max(MAD, 20 %, 0.005)
    statuses, results = judge(values)
    assert statuses[:5] == [INSUFFICIENT] * 5
    assert set(statuses[5:30]) == {OK}
    assert statuses[30] == SUSPICIOUS and statuses[31] == REGRESSION
    assert set(statuses[31:]) == {REGRESSION}  # the baseline stays at the old level
    assert results[31].first_bad == 30 and results[31].last_good == 29
    # the window keeps 6 significant digits
    assert results[31].boundary.baseline == pytest.approx(np.median(values[10:30]), rel=1e-5)


@pytest.mark.parametrize("seed", range(20))
def test_noise_inside_the_band_is_not_flagged(seed):
    """4 % night-to-night noise (bf16 on a GPU with the same tokens) never alarms."""
    rng = np.random.default_rng(seed)
    for name, level in (("mean_abs_diff", 0.012), ("max_abs_diff", 0.09), ("k3", 5e-5)):
        values = level * np.exp(rng.normal(0, 0.04, 365))
        statuses, _ = judge(values, name)
        assert SUSPICIOUS not in statuses and REGRESSION not in statuses, name


def test_heavier_noise_is_at_most_an_occasional_suspicious_never_a_regression():
    """8 % noise: a 20-point MAD sometimes comes out low and a 3.5-sigma night is flagged
    suspicious; the two-in-a-row rule keeps that from ever becoming a regression."""
    flagged = points = 0
    for seed in range(20):
        rng = np.random.default_rng(seed)
        for name, level in (("mean_abs_diff", 0.012), ("max_abs_diff", 0.09), ("k3", 5e-5)):
            statuses, _ = judge(level * np.exp(rng.normal(0, 0.08, 365)), name)
            assert REGRESSION not in statuses, (seed, name)
            flagged += statuses.count(SUSPICIOUS)
            points += len(statuses)
    assert flagged / points < 1e-3  # measured: 2 of 21900


def test_one_spike_is_suspicious_not_regression():
    values = [0.004] * 20
    values[12] = 0.5
    statuses, results = judge(values)
    assert statuses[12] == SUSPICIOUS
    assert REGRESSION not in statuses
    assert statuses[13] == OK
    # the spike never entered the baseline
    assert results[19].boundary.baseline == pytest.approx(0.004)


@pytest.mark.parametrize("seed", range(10))
def test_fp32_noise_never_alarms(seed):
    """fp32 engines agree to ~1e-6; GPU nondeterminism moves that by 2-3x night to night."""
    rng = np.random.default_rng(seed)
    for name, level in (
        ("max_abs_diff", 5e-6),
        ("mean_abs_diff", 3e-7),
        ("p999_abs_diff", 2e-6),
        ("k3", 2e-13),
        ("rms_diff", 5e-7),
        ("ess", 1 - 1e-12),
        ("is_ratio_mean", 1 + 1e-7),
    ):
        values = (
            level * np.exp(rng.normal(0, 0.6, 365))
            if level < 0.5
            else (1 + (level - 1) * np.exp(rng.normal(0, 0.6, 365)))
        )
        statuses, _ = judge(values, name, tau=FP32_TAU)
        assert SUSPICIOUS not in statuses, (name, seed)


@pytest.mark.parametrize("seed", range(10))
def test_fp32_chi2_noise_on_either_side_of_zero_never_alarms(seed):
    """chi2_token = E[r^2] - 1 is first order in the signed mean of d: at fp32 noise it
    wanders on both sides of 0 (bench/two_versions.py saw -1e-7 nights, then 1.2e-7 alarm
    when its floor was a square's, 2.5e-11). Its floor is now 2 x the mean's: 1e-5."""
    rng = np.random.default_rng(seed)
    values = rng.normal(0, 1.5e-7, 365)
    statuses, _ = judge(values, "chi2_token", tau=FP32_TAU)
    assert SUSPICIOUS not in statuses and REGRESSION not in statuses
    # a real bf16-sized shift still alarms on an fp32 series
    statuses, _ = judge(list(values[:20]) + [2e-3] * 2, "chi2_token", tau=FP32_TAU)
    assert statuses[-2:] == [SUSPICIOUS, REGRESSION]


def test_fp32_real_drift_still_alarms():
    """slime #830: on-policy diff went from ~0 to mean 4.5e-4: far above the fp32 floor."""
    statuses, _ = judge([3e-7] * 10 + [4.5e-4] * 2, "mean_abs_diff", tau=FP32_TAU)
    assert statuses[-2:] == [SUSPICIOUS, REGRESSION]


def test_reset_starts_a_new_baseline_and_the_new_level_stays_quiet():
    values = [0.004] * 10 + [0.03] * 15
    statuses, _ = judge(values, flags_at={10: {"reset": True}})
    assert statuses[10:15] == [INSUFFICIENT] * 5
    assert set(statuses[15:]) == {OK}


def test_excluded_and_error_points_change_nothing():
    values = [0.004] * 10 + [9.0, 9.0] + [0.004] * 3
    statuses, results = judge(values, flags_at={10: {"excluded": True}, 11: {"error_run": True}})
    assert statuses[10] == EXCLUDED and statuses[11] == ERROR_RUN
    assert set(statuses[12:]) == {OK}
    assert results[12].boundary.points == 10  # neither entered the baseline


def test_an_error_run_is_never_a_regression_even_far_outside_the_band():
    statuses, _ = judge(
        [0.004] * 10 + [50.0] * 5, flags_at={i: {"error_run": True} for i in range(10, 15)}
    )
    assert set(statuses[10:]) == {ERROR_RUN}


def test_direction_matters():
    quiet = [0.9999] * 10
    ess, _ = judge(quiet + [0.5], "ess")  # ESS is higher-better: a drop violates
    assert ess[-1] == SUSPICIOUS
    better, _ = judge(quiet + [1.0], "ess")
    assert better[-1] == OK
    lower, _ = judge([0.004] * 10 + [0.0], "mean_abs_diff")  # less drift is never a regression
    assert lower[-1] == OK
    both, _ = judge([0.0] * 10 + [-0.5], "mean_diff")  # signed drift: either way
    assert both[-1] == SUSPICIOUS


def test_non_finite_values_violate_once_a_baseline_exists():
    statuses, _ = judge([0.004] * 10 + [math.nan, None])
    assert statuses[-2:] == [SUSPICIOUS, REGRESSION]


def test_untracked_metrics_are_charted_never_judged():
    statuses, _ = judge([1.0] * 10 + [1e6], "max_rel_diff")
    assert set(statuses) == {"untracked"}


def test_policy_rule_streaks_and_last_good():
    state, verdicts = new_state(), ["pass", "pass", "fail", "fail", "pass"]
    results = []
    for i, verdict in enumerate(verdicts):
        state, result = policy_step(state, i, verdict)
        results.append(result)
    assert [r.status for r in results] == [OK, OK, "policy_violation", "policy_violation", OK]
    assert results[3].first_bad == 2 and results[3].last_good == 1


def test_attribution_names_the_engine_version_change_first():
    def build(engine, version, torch="2.13.0", **versions):
        return {
            "engine": engine,
            "version": version,
            "torch": torch,
            "image_digest": None,
            "versions": {"torch": torch, **versions},
        }

    before = point_description(
        build("vllm", "0.31.0", vllm="0.31.0", triton="3.3"),
        build("hf", "5.19.0", transformers="5.19.0"),
        {"rollout": {"a": 1}},
        "h1",
        "0.1.0",
    )
    after = point_description(
        build("vllm", "0.32.0", vllm="0.32.0", triton="3.4"),
        build("hf", "5.19.0", transformers="5.19.0"),
        {"rollout": {"a": 2}},
        "h1",
        "0.1.0",
    )
    found = changes(before, after)
    assert found[0] == {
        "side": "rollout",
        "engine": "vllm",
        "field": "version",
        "before": "0.31.0",
        "after": "0.32.0",
    }
    assert {
        "side": "rollout",
        "engine": "vllm",
        "field": "triton",
        "before": "3.3",
        "after": "3.4",
    } in found
    assert {"side": "knobs", "engine": "", "field": "rollout.a", "before": 1, "after": 2} in found
    assert not any(c["field"] == "vllm" for c in found)  # the version is not listed twice
    assert summary(found) == "rollout vllm: vllm 0.31.0 -> 0.32.0 (+2 more)"
    assert changes(before, before) == [] and "no engine build" in summary([])
