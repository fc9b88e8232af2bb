"""The correction view against hand-computed values under verl's definitions, and the policy
that gates it (verl's health check by default)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pipeline.compare.correction import (
    RS_MODES,
    CorrectionSettings,
    correction_view,
    flat_metrics,
    health_violations,
    is_view,
    parse_rs_threshold,
    rejection_view,
)
from pipeline.compare.policy import judge, load_policy
from pipeline.errors import BadInput

# two sequences: ratios r = exp(d) of [1, 3, 0.25] and [1.5]
RATIOS = np.array([1.0, 3.0, 0.25, 1.5])
D = np.log(RATIOS)
LENGTHS = np.array([3, 1])
ROLLOUT = np.array([-1.0, -2.0, -0.5, -3.0])
TRAIN = ROLLOUT + D
OFFSETS = [0, 3, 4]


def test_token_tis_truncates_at_the_cap_and_says_how_much():
    view = is_view(D, LENGTHS, "token", "2.0")
    applied = np.array([1.0, 2.0, 0.25, 1.5])  # 3 truncated to 2
    assert view["rollout_is_mean"] == pytest.approx(applied.mean())
    assert view["rollout_is_std"] == pytest.approx(applied.std())  # ddof 0
    assert view["rollout_is_max"] == 2.0 and view["rollout_is_min"] == 0.25
    ess = applied.mean() ** 2 / (applied**2).mean()
    assert view["rollout_is_eff_sample_size"] == pytest.approx(ess, rel=1e-6)
    assert view["rollout_is_ratio_fraction_high"] == pytest.approx(0.25)  # raw 3 > 2
    assert view["rollout_is_ratio_fraction_low"] == pytest.approx(0.25)  # raw 0.25 < 1/2
    assert view["truncated_tokens_fraction"] == pytest.approx(0.25)
    assert view["truncated_sequences_fraction"] == 0.5
    per_sequence = np.array([np.mean([1.0, 2.0, 0.25]), 1.5])
    assert view["rollout_is_seq_mean"] == pytest.approx(per_sequence.mean())
    assert view["rollout_is_seq_std"] == pytest.approx(per_sequence.std(ddof=1))
    assert view["rollout_is_seq_max_deviation"] == pytest.approx(0.5)


def test_sequence_is_takes_the_product_of_each_sequences_ratios():
    view = is_view(D, LENGTHS, "sequence", "2.0")
    products = np.array([3.0 * 0.25, 1.5])  # 0.75 and 1.5, neither over 2
    applied = np.repeat(products, LENGTHS)
    assert view["rollout_is_mean"] == pytest.approx(applied.mean())
    assert view["rollout_is_max"] == pytest.approx(1.5)
    assert view["rollout_is_min"] == pytest.approx(0.75)
    assert view["truncated_sequences_fraction"] == 0.0


def test_icepop_masks_ratios_outside_its_band():
    view = is_view(D, LENGTHS, "token", "0.5_5.0")
    applied = np.array([1.0, 3.0, 0.0, 1.5])  # 0.25 < 0.5 weighs 0; 3 stays (<= 5)
    assert view["rollout_is_mean"] == pytest.approx(applied.mean())
    assert view["masked_tokens_fraction"] == pytest.approx(0.25)
    assert view["rollout_is_oob_ratio"] == pytest.approx(0.25)
    assert view["masked_sequences_fraction"] == 0.5


def test_rejection_masks_tokens_or_whole_sequences():
    # token_k1 keeps log 0.5 <= -d <= log 2: r = 3 (k1 -1.1) and 0.25 (k1 1.39) are masked
    token = rejection_view(D, LENGTHS, "token_k1", "0.5_2.0")
    assert token["masked_fraction"] == pytest.approx(0.5)
    assert token["seq_masked_fraction"] == 0.5
    # seq_max_k3 with 0.5: k3 of r=3 is 3 - 1 - log 3 = 0.90 > 0.5: its sequence is masked
    whole = rejection_view(D, LENGTHS, "seq_max_k3", "0.5")
    assert whole["masked_fraction"] == pytest.approx(0.75)  # 3 of 4 tokens
    assert whole["max"] == pytest.approx(3 - 1 - math.log(3))
    assert parse_rs_threshold("seq_mean_k1", "2") == pytest.approx((math.log(0.5), math.log(2)))
    with pytest.raises(ValueError, match="takes an upper bound"):
        parse_rs_threshold("token_k3", "0.5_2")


def _rejection_by_hand(d, lengths, mode, threshold):
    """One mode computed sequence by sequence in plain Python, as verl's helper reads: the
    statistic per token (a sequence's value on each of its tokens), then the masks."""
    lower, upper = parse_rs_threshold(mode, threshold)
    kind = mode.rsplit("_", 1)[1]
    values, masked, masked_sequences, start = [], [], [], 0
    for length in lengths:
        e = np.clip(d[start : start + length], -20, 20)
        start += length
        token = {"k1": -e, "k2": 0.5 * e * e, "k3": np.expm1(e) - e}[kind]
        if mode.startswith("token_"):
            statistic = list(token)
        else:
            # verl's masked_mean divides by the count plus 1e-8
            mean = lambda t: np.sum(t) / (len(t) + 1e-8)  # noqa: E731
            reduce = {"sum": np.sum, "mean": mean, "max": np.max}[mode.split("_")[1]]
            statistic = [float(reduce(token))] * length if length else []
        out = [not lower <= value <= upper for value in statistic]
        if mode.startswith("seq_") and any(out):
            out = [True] * length
        values += statistic
        masked += out
        if length:
            masked_sequences.append(any(out))
    return {
        "mean": float(np.mean(values)),
        "max": max(0.0, max(values)),
        "masked_fraction": float(np.mean(masked)),
        "seq_masked_fraction": float(np.mean(masked_sequences)),
    }


@pytest.mark.parametrize("mode", RS_MODES)
def test_every_rejection_mode_of_the_one_pass_equals_the_mode_computed_by_hand(mode):
    """The view computes the statistics every mode reads once (RejectionStatistics); each
    mode's numbers equal that mode computed alone, sequence by sequence, empty sequences
    included."""
    rng = np.random.default_rng(7)
    lengths = rng.integers(0, 40, size=60)
    lengths[[0, 17]] = 0
    d = rng.normal(0, 0.4, size=int(lengths.sum())) * rng.random(int(lengths.sum()))
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    # thresholds that cut this batch somewhere between none and all of it
    threshold = {"token_k1": "0.8_1.25", "seq_sum_k1": "0.5_2.0", "seq_mean_k1": "0.95_1.05"}.get(
        mode, "0.02"
    )
    view = correction_view(d, np.zeros_like(d), offsets, CorrectionSettings(
        rollout_rs=mode, rollout_rs_threshold=threshold))  # fmt: skip
    got = view["views"]["rejection"][mode]
    want = _rejection_by_hand(d, lengths, mode, threshold)
    assert got["threshold"] == threshold
    for name, value in want.items():
        assert got[name] == pytest.approx(value, rel=1e-9, abs=1e-12), name
    assert 0 < want["masked_fraction"] < 1  # the threshold cuts: the masks are tested
    # the configured mode alone is the summary's mask
    assert view["rollout_corr"]["rollout_rs_masked_fraction"] == pytest.approx(
        want["masked_fraction"], rel=1e-9
    )


def test_off_policy_diagnostics_and_probs_diff():
    view = correction_view(TRAIN, ROLLOUT, OFFSETS)
    diagnostics = view["rollout_corr"]
    assert diagnostics["kl"] == pytest.approx(-D.mean())
    assert diagnostics["k3_kl"] == pytest.approx(np.mean(RATIOS - 1 - D))
    assert diagnostics["chi2_token"] == pytest.approx(np.mean(RATIOS**2) - 1)
    sums = np.array([D[:3].sum(), D[3]])
    assert diagnostics["chi2_seq"] == pytest.approx(np.mean(np.exp(2 * sums)) - 1)
    gap = np.array([ROLLOUT[:3].mean() - TRAIN[:3].mean(), ROLLOUT[3] - TRAIN[3]])
    assert diagnostics["log_ppl_diff"] == pytest.approx(gap.mean())
    assert diagnostics["ppl_ratio"] == pytest.approx(np.exp(gap).mean())
    probs = np.abs(np.exp(TRAIN) - np.exp(ROLLOUT))
    assert view["probs_diff"]["rollout_probs_diff_mean"] == pytest.approx(probs.mean())
    assert view["probs_diff"]["rollout_probs_diff_std"] == pytest.approx(probs.std(ddof=1))
    flat = flat_metrics(view)
    assert flat["rollout_corr/kl"] == diagnostics["kl"]
    assert flat["lpx_corr/truncated_tokens_fraction"] == pytest.approx(0.25)


def test_identical_sides_are_healthy_and_a_large_gap_is_not():
    same = correction_view(ROLLOUT, ROLLOUT, OFFSETS)
    metrics = flat_metrics(same)
    assert metrics["rollout_corr/rollout_is_mean"] == pytest.approx(1.0)
    assert metrics["rollout_corr/rollout_is_eff_sample_size"] == pytest.approx(1.0)
    policy = load_policy()
    assert health_violations(metrics, policy.correction_checks) == []
    # every ratio 0.1 (d = -2.3): IS mean 0.1, kl 2.3: both out of verl's healthy ranges
    far = flat_metrics(correction_view(ROLLOUT - 2.3, ROLLOUT, OFFSETS))
    failed = {v["metric"]: v for v in health_violations(far, policy.correction_checks)}
    assert failed["rollout_corr/rollout_is_mean"]["bound"] == "lower"
    assert failed["rollout_corr/rollout_is_mean"]["limit"] == 0.5
    assert failed["rollout_corr/kl"]["bound"] == "upper"


def test_the_bundled_policy_gates_verls_health_check_and_a_file_without_it_none(tmp_path):
    from pipeline.compare.correction import HEALTH_CHECKS

    assert load_policy().correction_checks == HEALTH_CHECKS
    path = tmp_path / "policy.yaml"
    path.write_text("version: 1\nprofiles: {float32: {tau: 1.0}}\n")
    assert load_policy(path).correction_checks == {}


def test_the_policy_configures_and_gates_the_correction(tmp_path):
    path = tmp_path / "policy.yaml"
    path.write_text(
        "version: 1\nprofiles: {float32: {tau: 1.0}}\ncorrection:\n  rollout_is: sequence\n"
        "  rollout_is_threshold: 0.5_5.0\n  rollout_rs: token_k1\n"
        "  checks: {rollout_corr/rollout_is_eff_sample_size: [0.99, null]}\n"
    )
    policy = load_policy(path)
    assert policy.correction == CorrectionSettings("sequence", "0.5_5.0", "token_k1", "")
    view = correction_view(TRAIN, ROLLOUT, OFFSETS, policy.correction)
    metrics = {"max_abs_diff": 0.0, "mean_abs_diff": 0.0, **flat_metrics(view)}
    judged = judge(policy, "float32", metrics, [])
    assert judged["verdict"] == "fail"
    assert [v["metric"] for v in judged["violations"]] == [
        "rollout_corr/rollout_is_eff_sample_size"
    ]
    assert view["rollout_corr"]["rollout_rs_masked_fraction"] == pytest.approx(0.5)
    path.write_text("version: 1\nprofiles: {float32: {tau: 1.0}}\ncorrection: {rollout_is: k}\n")
    with pytest.raises(BadInput, match="correction.rollout_is"):
        load_policy(path)
    path.write_text(
        "version: 1\nprofiles: {float32: {tau: 1.0}}\ncorrection: {rollout_rs: token_k9}\n"
    )
    with pytest.raises(BadInput, match="rollout_rs mode 'token_k9'"):
        load_policy(path)
