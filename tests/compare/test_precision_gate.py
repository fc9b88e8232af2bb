"""The precision gate (`pipeline/compare/precision_gate.py`) on seeded synthetic noise: its false
alarms stay at the stated rate at every token count, faults of 1.5x and more fail once the
batch is large enough, the design effect is measured, and precision is called verified only
where the data rule out a fault of FAULT_SIZE. Real engines and faults: test_precision_real.py."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.calibrate.run import fit_pair
from pipeline.compare.calibrated import TAU_MARGIN
from pipeline.compare.floor import expect
from pipeline.compare.precision_gate import (
    ALPHA,
    FAULT_SIZE,
    bucket_level_tests,
    design_of,
    failed_tests,
    noise_limits,
    precision_gate,
    rules_out_faults,
)

LENGTH = 128  # tokens per synthetic sequence


def noise(rng, sequences: int, scale: float = 1.0, icc_scale: float = 0.15, surprisal=None):
    """|d| per token like bf16 noise: a sequence's tokens share a lognormal level (sd
    ``icc_scale``), each token's size grows with its surprisal. Returns (|d|, surprisal,
    positions, offsets)."""
    if surprisal is None:
        surprisal = rng.exponential(2.0, (sequences, LENGTH))
    surprisal = np.asarray(surprisal).reshape(sequences, LENGTH)
    level = np.exp(rng.normal(0.0, icc_scale, (sequences, 1)))
    size = 0.004 * (1 + surprisal) * level * scale
    abs_diff = np.abs(rng.standard_t(5, (sequences, LENGTH))) * size
    positions = np.tile(np.arange(LENGTH), sequences)
    offsets = np.arange(sequences + 1) * LENGTH
    return abs_diff.ravel(), surprisal.ravel(), positions, offsets


@pytest.fixture(scope="module")
def floor():
    """A pair's floor from three variants of 32 sequences, as `lpx calibrate` fits one."""
    rng = np.random.default_rng(1)
    abs_diff, surprisal, positions, offsets = noise(rng, 32)
    # three correct scorings of the same tokens
    variants = {"v0": abs_diff}
    for i in (1, 2):
        variants[f"v{i}"] = noise(np.random.default_rng(10 + i), 32, surprisal=surprisal)[0]
    return fit_pair(variants, surprisal, positions, np.diff(offsets))


def judge(floor, abs_diff, surprisal, positions, offsets):
    tau = TAU_MARGIN * np.maximum(expect(floor, surprisal, positions)["q999"], 1e-12)
    return precision_gate(floor, abs_diff, surprisal, positions, offsets, tau)


@pytest.mark.parametrize("sequences", [1, 8, 64])
def test_clean_batches_fail_at_the_stated_rate(floor, sequences):
    rng = np.random.default_rng(sequences)
    failed = sum(not judge(floor, *noise(rng, sequences))["passed"] for _ in range(300))
    # 300 batches at alpha 1e-3: 0.3 false alarms expected; 3 or more has p < 0.004
    assert failed <= 2


@pytest.mark.parametrize(
    ("size", "sequences", "least"), [(1.5, 64, 0.99), (2.0, 8, 0.95), (4.0, 1, 0.95)]
)
def test_faults_fail_once_the_batch_is_large_enough(floor, size, sequences, least):
    rng = np.random.default_rng(7)
    caught = sum(not judge(floor, *noise(rng, sequences, scale=size))["passed"] for _ in range(100))
    assert caught >= least * 100


def test_a_fault_is_a_fault_whatever_multiple_of_the_noise_it_is(floor):
    """The old rule (fail beyond 2x the noise's mean) let a 1.8x fault through at any size;
    at 8,192 tokens the gate's critical value is within ~10 % of the noise's mean."""
    gate = judge(floor, *noise(np.random.default_rng(3), 64, scale=1.3))
    level = gate["tests"][0]
    assert level["name"] == "mean_abs_diff" and not level["passed"]
    assert level["critical"] < 1.12 * level["expected"]
    assert failed_tests(gate)[0]["source"].startswith("precision gate")


def test_a_few_tokens_far_beyond_tau_fail_the_tau_count(floor):
    abs_diff, surprisal, positions, offsets = noise(np.random.default_rng(4), 64)
    clean = judge(floor, abs_diff, surprisal, positions, offsets)
    assert clean["passed"]
    abs_diff = abs_diff.copy()
    abs_diff[100:115] = 5.0  # one sequence's 15 tokens off by 5 nats (a mask bug)
    gate = judge(floor, abs_diff, surprisal, positions, offsets)
    over_tau = next(t for t in gate["tests"] if t["name"] == "tokens_over_tau")
    assert not over_tau["passed"] and over_tau["observed"] == 15


def test_the_design_effect_is_measured_from_the_sequences():
    rng = np.random.default_rng(5)
    shared, alone = noise(rng, 200, icc_scale=0.4), noise(rng, 200, icc_scale=0.0)
    cell_means = [expect(fit_pair({"a": x[0]}, x[1], x[2], np.diff(x[3])), x[1], x[2])["mean"]
                  for x in (shared, alone)]  # fmt: skip
    q = [np.full(len(x[0]), np.inf) for x in (shared, alone)]
    correlated = design_of(shared[0], cell_means[0], q[0], np.diff(shared[3]))
    independent = design_of(alone[0], cell_means[1], q[1], np.diff(alone[3]))
    assert correlated["icc"] > 0.02 and correlated["design_effect"] > 3
    assert independent["icc"] < 0.005


def test_a_variant_measured_on_some_sequences_is_fitted_on_those():
    """Decoding covers a sample of the calibration's sequences (NaN elsewhere): its mean,
    samples and design come from the tokens it measured, and the floor stays finite."""
    rng = np.random.default_rng(7)
    abs_diff, surprisal, positions, offsets = noise(rng, 32)
    wide = noise(np.random.default_rng(8), 32, scale=2.0, surprisal=surprisal)[0]
    sampled = wide.copy()
    sampled[: 16 * LENGTH] = np.nan  # the first 16 sequences not decoded
    fitted = fit_pair({"prefill": abs_diff, "decode": sampled}, surprisal, positions,
                      np.diff(offsets))  # fmt: skip
    assert fitted["variant_means"]["decode"] == pytest.approx(wide[16 * LENGTH :].mean())
    assert fitted["fitted_on"] == ["decode"]  # the wider half of two
    assert fitted["tau_exceedance"]["samples"] == 16 * LENGTH
    assert all(np.isfinite(cell["mean"]) for cell in fitted["cells"].values())
    # the level is the measured tokens' own (times the allowance, 1 with one wide variant)
    assert fitted["all"]["mean"] == pytest.approx(wide[16 * LENGTH :].mean(), rel=1e-9)
    assert fitted["design"]["mean_length"] == LENGTH and fitted["design"]["sequences"] == 32


def test_precision_is_verified_only_where_a_fault_is_ruled_out(floor):
    def level_at_its_expectation(sequences, tokens):
        _, surprisal, positions, _ = noise(np.random.default_rng(6), sequences)
        surprisal, positions = surprisal[:tokens], positions[:tokens]
        at_mean = expect(floor, surprisal, positions)["mean"]  # drift exactly as expected
        offsets = np.append(np.arange(0, tokens, LENGTH), tokens)
        return judge(floor, at_mean, surprisal, positions, offsets)["tests"][0]

    small, large = level_at_its_expectation(1, 24), level_at_its_expectation(64, 64 * LENGTH)
    assert small["passed"] and large["passed"]
    assert not rules_out_faults(small)  # 24 tokens cannot tell noise from 1.5x noise
    assert rules_out_faults(large)
    assert FAULT_SIZE == 1.5


def test_a_fault_in_one_surprisal_bucket_fails_its_level_test(floor):
    abs_diff, surprisal, positions, offsets = noise(np.random.default_rng(8), 32)
    assert all(
        t["passed"] for t in bucket_level_tests(floor, abs_diff, surprisal, positions, offsets)
    )
    confident = surprisal < 0.1  # a fault that moves only the likely tokens, threefold
    abs_diff = np.where(confident, 3 * abs_diff, abs_diff)
    tests = bucket_level_tests(floor, abs_diff, surprisal, positions, offsets)
    assert [t["passed"] for t in tests].count(False) >= 1


def test_noise_limits_grow_with_the_false_alarm_margin_and_shrink_with_tokens(floor):
    _, surprisal, positions, offsets = noise(np.random.default_rng(9), 64)
    expected = expect(floor, surprisal, positions)
    under, limits = noise_limits(floor, expected, offsets)
    few = noise(np.random.default_rng(9), 2)
    _, few_limits = noise_limits(floor, expect(floor, few[1], few[2]), few[3])
    for metric in ("mean_abs_diff", "rms_diff", "k2", "p99_abs_diff", "token_mult_prob_error"):
        assert limits[metric] >= under[metric]
        assert few_limits[metric] >= limits[metric] * 0.999
    assert limits["max_abs_diff"] > under["p999_abs_diff"]
    assert ALPHA == 1e-3
