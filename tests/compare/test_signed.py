"""The sign tests' statistics (compare/signed.py) on simulated noise, where the truth is known:
a rollout samples its tokens from its own noisy distribution and a trainer scores them with
noise of its own. The noise is heteroscedastic (larger on unlikely tokens, as reduced
precisions make it), so the drift's sign structure under noise alone is not zero: the
calibration's draws (fp64 tokens weighted to the rollout's distribution) must predict it, and
then the tests false-alarm at their stated rate and still see a trainer temperature of 0.97
that no magnitude shows."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.compare.signed import (
    STATISTICS,
    sampled_as_reported,
    signed_null_for,
    signed_statistics,
    signed_tests,
)

VOCAB = 32
SEQUENCES, LENGTH = 32, 32


def _noisy(z, rng, sigma):
    """Logits with noise whose spread grows with the token's true surprisal."""
    true = z - np.log(np.exp(z).sum(-1, keepdims=True))
    return z + rng.normal(size=z.shape) * sigma * (1.0 - true / 4.0)


def _logsoftmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _contexts(rng, n):
    return rng.normal(scale=1.5, size=(n, VOCAB))


def batch(rng, sigma_rollout=0.15, sigma_train=0.05, temperature=1.0, sequences=SEQUENCES) -> dict:
    """One compared batch: tokens sampled by the noisy rollout, scored by a noisy trainer at
    ``temperature`` (sigma 0.15: mean d^2 0.066, an FP8 rollout's on a 24 x 2048 llama)."""
    n = sequences * LENGTH
    z = _contexts(rng, n)
    rollout = _logsoftmax(_noisy(z, rng, sigma_rollout))
    train = _logsoftmax(_noisy(z, rng, sigma_train) / temperature)
    u = rng.random((n, 1))
    token = (np.exp(rollout).cumsum(-1) < u).sum(-1).clip(max=VOCAB - 1)
    rows = np.arange(n)
    return signed_statistics(
        train[rows, token] - rollout[rows, token],
        rollout[rows, token],
        train[rows, token],
        np.tile(np.arange(LENGTH), sequences),
        np.repeat(np.arange(sequences), LENGTH),
    )


def calibrated_null(rng, sigma_rollout=0.15, sigma_train=0.05, draws=4, weighted=True) -> dict:
    """What `lpx calibrate` measures: tokens drawn from the exact distribution, weighted by
    the rollout precision's over the exact one, scored by both precisions."""
    n = SEQUENCES * LENGTH
    z = _contexts(rng, n)
    exact = _logsoftmax(z)
    rollout = _logsoftmax(_noisy(z, rng, sigma_rollout))
    train = _logsoftmax(_noisy(z, rng, sigma_train))
    u = rng.random((n, draws))
    cumulative = np.exp(exact).cumsum(-1)
    tokens = (cumulative[:, None, :] < u[:, :, None]).sum(-1).clip(max=VOCAB - 1)
    rows = np.repeat(np.arange(n), draws)
    picked = tokens.ravel()
    sampled, other = rollout[rows, picked], train[rows, picked]
    return signed_statistics(
        other - sampled,
        sampled,
        other,
        np.repeat(np.tile(np.arange(LENGTH), SEQUENCES), draws),
        np.repeat(np.repeat(np.arange(SEQUENCES), LENGTH), draws),
        np.exp(sampled - exact[rows, picked]) if weighted else None,
    )


@pytest.fixture(scope="module")
def null():
    return calibrated_null(np.random.default_rng(1))


def test_noise_alone_has_a_sign_structure_that_the_calibrated_null_predicts(null):
    """The drift of pure noise is negative on average (the rollout sampled what its noise made
    likelier) and leans on surprisal: a null of zero would call every large clean batch a
    fault; the calibration's weighted draws land on the batches' own values."""
    rng = np.random.default_rng(2)
    batches = [batch(rng) for _ in range(40)]
    slopes = np.array([b["surprisal_slope"]["value"] for b in batches])
    ses = np.array([b["surprisal_slope"]["se"] for b in batches])
    # far from zero at this noise, by many of its own standard errors
    error = ses.mean() / np.sqrt(len(batches))
    assert abs(slopes.mean()) > 5 * error
    assert abs(slopes.mean() - null["surprisal_slope"]["value"]) < 4 * error
    means = np.array([b["ratio_mean"]["value"] for b in batches])
    assert abs(means.mean()) < 3 * np.array([b["ratio_mean"]["se"] for b in batches]).mean()
    # without the draws' importance weights (the fixture's tokens re-scored as they are) the
    # null misses the selection: the slope on the wrong side of zero, the ratio's mean high
    unweighted = calibrated_null(np.random.default_rng(1), weighted=False)
    assert unweighted["surprisal_slope"]["value"] - slopes.mean() > 10 * error
    gap = unweighted["ratio_mean"]["value"] - null["ratio_mean"]["value"]
    assert gap > null["mean_sq"]["value"] / 4


def test_clean_batches_fail_at_the_stated_rate_and_a_null_of_zero_would_not(null):
    """400 clean batches of 1,024 tokens (32 sequences): at a per-test rate of 0.01 (so that
    400 batches can show it) the calibrated tests fail about 1 % each; a null of zero fails
    the surprisal slope on 8 % of them already (measured 34 of 400), more as batches grow."""
    rng = np.random.default_rng(3)
    zero = {name: {"value": 0.0, "se": 0.0} for name in (*STATISTICS, "mean_sq")}
    zero["mean_sq"] = null["mean_sq"]
    failed = {name: 0 for name in STATISTICS}
    naive = 0
    for _ in range(400):
        observed = batch(rng)
        for test in signed_tests(null, observed, 0.01, True):
            failed[test["name"]] += not test["passed"]
        naive += not signed_tests(zero, observed, 0.01, True)[0]["passed"]
    # binomial(400, 0.01): 4 expected; P(>= 12) < 1e-3
    assert max(failed.values()) < 12, failed
    assert naive > 20, naive


def test_a_trainer_temperature_of_097_under_fp8_like_noise_is_seen_by_the_slope(null):
    """A temperature of 0.97 moves mean d^2 by about 10 % against this rollout noise, and the
    surprisal slope by about -(1/T - 1): caught in every batch of 4,096 tokens (128
    sequences) at the gate's share, 1e-3 / 7."""
    rng = np.random.default_rng(4)
    share = 1e-3 / 7
    for _ in range(20):
        faulted = batch(rng, temperature=0.97, sequences=128)
        clean = batch(rng, sequences=128)
        assert faulted["mean_sq"]["value"] < 1.25 * clean["mean_sq"]["value"]
        tests = signed_tests(null, faulted, share, True)
        (slope,) = [t for t in tests if t["name"] == "surprisal_slope"]
        assert not slope["passed"] and slope["z"] < -4
        assert slope["observed"] - slope["expected"] == pytest.approx(-(1 / 0.97 - 1), abs=0.012)


def test_too_few_sequences_give_no_tests_and_a_scaled_null_is_bounded(null):
    rng = np.random.default_rng(5)
    observed = batch(rng)
    assert signed_tests(null, {**observed, "sequences": 7}, 1e-3, True) == []
    tests = signed_tests(null, observed, 1e-3, False)
    assert [t["name"] for t in tests] == ["surprisal_slope", "position_slope"]
    loud = {**observed, "mean_sq": {"value": 100 * null["mean_sq"]["value"], "se": 0.0}}
    assert signed_tests(null, loud, 1e-3, False)[0]["scale"] == 4.0


@pytest.mark.parametrize(
    "sampling, applies",
    [
        ({"temperature": 1.0, "top_k": 0, "top_p": 1.0}, True),
        ({"temperature": 0.7, "top_k": 0, "top_p": 1.0}, False),
        ({"temperature": 1.0, "top_k": 50, "top_p": 1.0}, False),
        ({"temperature": 1.0, "top_k": 0, "top_p": 0.9}, False),
        ({"temperature": 0.7, "top_p": 0.9, "logprobs_mode": "processed"}, True),
        (None, False),
        ({}, False),
    ],
)
def test_the_ratio_mean_applies_only_where_the_rollout_reports_what_it_sampled(sampling, applies):
    assert sampled_as_reported(sampling) is applies


def test_a_null_is_used_only_for_the_rollout_precision_and_temperature_it_was_drawn_at(null):
    floor = {"signed": {"temperature": 1.0, "draws": 4, "by_rollout": {"bfloat16": null}}}
    assert signed_null_for(floor, "bfloat16", {"temperature": 1.0})[0] is null
    for precision, sampling, why in [
        ("float32", {"temperature": 1.0}, "no sign statistics with float32 rolling out"),
        ("bfloat16", {"temperature": 0.0}, "a greedy rollout"),
        ("bfloat16", {"temperature": 0.7}, "sampled at temperature 0.7, the calibration drew"),
    ]:
        found, reason = signed_null_for(floor, precision, sampling)
        assert found is None and why in reason
    assert "predates" in signed_null_for({}, "bfloat16", None)[1]
    assert "does not record" in signed_null_for(floor, "bfloat16", {"top_k": 0})[1]


def test_seen_before_reads_the_prompt_and_the_output_before_each_token():
    from pipeline.compare.signed import seen_before

    prompt, completion = [5, 6], [7, 5, 7, 8]
    assert seen_before(prompt, completion).tolist() == [False, True, True, False]
    drawn = [[6, 9], [7, 8], [8, 8], [8, 7]]  # candidates at each position
    assert seen_before(prompt, completion, drawn).tolist() == [
        [True, False], [True, False], [False, False], [False, True],
    ]  # fmt: skip


def test_every_sign_statistic_says_in_words_which_way_the_drift_leans():
    from pipeline.compare.extra_findings import SIGN_WORDS

    assert set(SIGN_WORDS) == set(STATISTICS)
