"""Each diagnosis rule on small hand-built batches: the cause, the sequences and the first bad
position it names, and the cause it must not be mistaken for.

The tables are flat arrays as compare hands them over (train, rollout, offsets, positions).
Sampling processing is built from real distributions: random logits over a small vocabulary,
a token sampled from them, its raw logprob and its logprob after temperature/top-k/top-p.
The fault zoo on the real tiny model is tests/verify/test_inject.py; the full matrix is
bench/diagnosis.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.compare.diagnosis import Context, diagnose_region
from pipeline.fixture.table import offsets_from_lengths

TAU = 1e-4  # the float32 profile's
FP32_NOISE = 1e-7
VOCAB = 32


def lm_logprobs(rng, n: int) -> np.ndarray:
    """Selected-token logprobs shaped like a sampled LM's: mostly near 0, a long tail."""
    return -rng.exponential(0.8, n)


def fp32_twin(rng, logprobs: np.ndarray) -> np.ndarray:
    return logprobs + rng.normal(0, FP32_NOISE, len(logprobs))


def diagnose(pairs, *, positions=None, versions=None, tau=TAU, **context):
    """pairs: (rollout, train) per sequence; returns the findings as dicts."""
    rollout = np.concatenate([np.asarray(r, dtype=np.float32) for r, _ in pairs])
    train = np.concatenate([np.asarray(t, dtype=np.float32) for _, t in pairs])
    lengths = [len(r) for r, _ in pairs]
    if positions is None:
        positions = np.concatenate([np.arange(n) for n in lengths])
    context = Context(**{"low_precision_dtype": "float32", **context})
    findings = diagnose_region(
        train,
        rollout,
        offsets_from_lengths(np.array(lengths)),
        np.asarray(positions),
        [f"s{i}" for i in range(len(pairs))],
        None if versions is None else np.asarray(versions),
        tau,
        context,
    )
    return [f.as_dict() for f in findings]


def causes(findings) -> dict:
    return {f["cause"]: f for f in findings}


def clean_batch(rng, sequences=8, length=24):
    pairs = []
    for _ in range(sequences):
        lp = lm_logprobs(rng, length)
        pairs.append((lp, fp32_twin(rng, lp)))
    return pairs


def test_a_clean_batch_has_no_findings():
    assert diagnose(clean_batch(np.random.default_rng(0))) == []


def test_a_logprob_shift_by_one_token_in_one_sequence():
    rng = np.random.default_rng(1)
    pairs = clean_batch(rng)
    rollout = pairs[2][0]
    pairs[2] = (rollout, np.r_[rollout[1:], -0.5])  # train[t] holds rollout[t + 1]
    found = causes(diagnose(pairs))
    assert set(found) == {"token_shift"}
    assert found["token_shift"]["sequences"] == ["s2"]
    assert found["token_shift"]["details"]["shift"] == 1
    assert found["token_shift"]["first_position"] == {"sequence_id": "s2", "position": 0}


def test_a_constant_fill_is_padding_treated_as_active():
    rng = np.random.default_rng(2)
    pairs = clean_batch(rng)
    rollout, train = pairs[5]
    filled = rollout.copy()
    filled[14:] = -1.25  # the rollout side wrote one pad value over its last 10 tokens
    pairs[5] = (filled, train)
    found = causes(diagnose(pairs))
    assert set(found) == {"mask_padding"}
    finding = found["mask_padding"]
    assert finding["sequences"] == ["s5"]
    assert finding["details"] == {"side": "rollout", "fill_value": -1.25}
    assert finding["first_position"] == {"sequence_id": "s5", "position": 14}


def test_labels_off_by_one_lower_one_side_in_every_sequence_from_the_first_token():
    rng = np.random.default_rng(3)
    pairs = [(lp, lp - 3.0 - rng.exponential(2.0, len(lp))) for lp, _ in clean_batch(rng)]
    found = causes(diagnose(pairs))
    assert set(found) == {"token_shift"}
    assert found["token_shift"]["details"]["shift"] == "labels"
    assert found["token_shift"]["details"]["side"] == "replay"
    assert len(found["token_shift"]["sequences"]) == 8


def test_logprobs_rounded_to_bf16_on_one_side_are_named_as_precision():
    rng = np.random.default_rng(4)
    pairs = []
    for lp, _ in clean_batch(rng):
        bits = lp.astype(np.float32).view(np.uint32)
        rounded = ((bits + 0x8000) & 0xFFFF0000).view(np.float32)  # round to nearest bf16
        pairs.append((rounded, lp))
    found = causes(diagnose(pairs))
    assert set(found) == {"dtype"}
    assert found["dtype"]["severity"] == "info"
    assert found["dtype"]["details"] == {"side": "rollout", "dtype": "bfloat16"}


def test_recorded_weight_versions_name_the_index_of_the_change():
    rng = np.random.default_rng(5)
    pairs, versions = [], []
    for lp, twin in clean_batch(rng, sequences=6, length=20):
        drifted = twin.copy()
        drifted[7:] += rng.normal(0, 0.05, 13)  # tokens 7 on came from the next version
        pairs.append((lp, drifted))
        versions += ["v1"] * 7 + ["v2"] * 13
    found = causes(diagnose(pairs, versions=versions, reference_weight_version="v1"))
    assert set(found) == {"version_change"}
    assert found["version_change"]["details"]["at"] == 7
    assert found["version_change"]["details"]["versions"] == ["v2"]
    assert len(found["version_change"]["sequences"]) == 6


def test_a_sequence_sampled_wholly_under_an_old_version_is_stale():
    rng = np.random.default_rng(6)
    pairs = clean_batch(rng, sequences=4, length=20)
    lp, twin = pairs[1]
    pairs[1] = (lp, twin + rng.normal(0, 0.05, 20))
    versions = ["v3"] * 20 + ["v2"] * 20 + ["v3"] * 40
    found = causes(diagnose(pairs, versions=versions, reference_weight_version="v3"))
    assert set(found) == {"stale_weights"}
    assert found["stale_weights"]["sequences"] == ["s1"]


def sampled_batch(rng, temperature=1.0, top_k=0, top_p=1.0, sequences=8, length=32):
    """(processed rollout logprob, raw logprob) pairs of tokens sampled under the processing."""
    pairs = []
    for _ in range(sequences):
        logits = rng.normal(0, 2.5, (length, VOCAB))
        processed = _log_softmax(logits / temperature)
        if top_k:
            kth = np.sort(processed, axis=1)[:, -top_k][:, None]
            processed = np.where(processed >= kth, processed, -np.inf)
        if top_p < 1.0:
            order = np.argsort(-processed, axis=1)
            sorted_p = np.take_along_axis(np.exp(processed), order, axis=1)
            before = np.cumsum(sorted_p, axis=1) - sorted_p  # mass of the tokens ahead
            dropped = np.zeros_like(processed, dtype=bool)
            np.put_along_axis(dropped, order, before >= top_p, axis=1)
            processed = np.where(dropped, -np.inf, processed)
        processed = _log_softmax(processed)
        tokens = [rng.choice(VOCAB, p=np.exp(row)) for row in processed]
        rows = np.arange(length)
        raw = _log_softmax(logits)[rows, tokens]
        pairs.append((processed[rows, tokens], raw))
    return pairs


def _log_softmax(x):
    with np.errstate(invalid="ignore"):
        shifted = x - x.max(axis=1, keepdims=True)
        return shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))


@pytest.mark.parametrize(
    ("sampling", "named"),
    [
        ({"temperature": 0.7}, {"temperature"}),
        ({"temperature": 1.0, "top_k": 4}, {"top_k"}),
        ({"temperature": 1.0, "top_p": 0.8}, {"top_p"}),
        ({"temperature": 1.0, "top_k": 4, "top_p": 0.8}, {"top_k", "top_p"}),
    ],
)
def test_processed_rollout_logprobs_are_named_by_the_recorded_sampling(sampling, named):
    rng = np.random.default_rng(7)
    pairs = sampled_batch(
        rng, sampling["temperature"], sampling.get("top_k", 0), sampling.get("top_p", 1.0)
    )
    found = causes(diagnose(pairs, sampling=sampling))
    assert set(found) == named
    for finding in found.values():
        assert len(finding["sequences"]) == 8
        if finding["cause"] != "temperature":
            assert finding["details"]["processed_side"] == "rollout"
    if "temperature" in found:
        # T < 1 sharpens: the likely tokens are higher on the processed (rollout) side
        fit = found["temperature"]["details"]["temperature_fit"]
        assert fit["sharpened_side"] == "rollout"
        assert fit["agreement"] >= 0.95


def test_a_position_fault_in_one_sequence_names_its_exact_onset_position():
    rng = np.random.default_rng(8)
    pairs = clean_batch(rng, length=30)
    lp, twin = pairs[3]
    scrambled = twin.copy()
    scrambled[9:] += rng.normal(0, 0.6, 21)  # attention scrambled from token 9 on
    pairs[3] = (lp, scrambled)
    # masked tokens are not compared: positions skip them, so index 9 is position 12
    positions = [np.arange(30)] * 8
    positions[3] = np.r_[np.arange(5), np.arange(8, 33)]
    found = causes(diagnose(pairs, positions=np.concatenate(positions)))
    assert set(found) == {"position_ids"}
    assert found["position_ids"]["sequences"] == ["s3"]
    assert found["position_ids"]["first_position"] == {"sequence_id": "s3", "position": 12}


def test_a_weight_update_in_flight_is_a_shared_onset_of_small_drift():
    rng = np.random.default_rng(9)
    pairs = []
    for lp, twin in clean_batch(rng, length=30):
        drifted = twin.copy()
        # one optimiser step: a few % of each logprob, biased per sequence
        drifted[11:] += lp[11:] * rng.normal(0.03, 0.01) + rng.normal(0, 0.01, 19)
        pairs.append((lp, drifted))
    found = causes(diagnose(pairs))
    assert set(found) == {"version_change"}
    assert found["version_change"]["details"]["at"] == 11
    assert found["version_change"]["first_position"]["position"] == 11
    assert found["version_change"]["runner_up"]["cause"] == "position_ids"


def test_unbiased_noise_at_a_numeric_level_is_precision_not_a_semantic_cause():
    rng = np.random.default_rng(10)
    pairs = [(lp, lp + rng.normal(0, 1e-3, len(lp))) for lp, _ in clean_batch(rng)]
    found = causes(diagnose(pairs))
    assert set(found) == {"dtype"}
    assert found["dtype"]["severity"] == "info"
    assert found["dtype"]["runner_up"]["cause"] == "stale_weights"


def test_drift_biased_per_sequence_in_the_whole_batch_is_stale_weights():
    rng = np.random.default_rng(11)
    pairs = []
    for lp, _ in clean_batch(rng, sequences=12, length=40):
        favoured = rng.choice([-1, 1]) * 0.04  # a step favours or disfavours whole sequences
        pairs.append((lp, lp + favoured + rng.normal(0, 0.02, len(lp))))
    found = causes(diagnose(pairs))
    assert set(found) == {"stale_weights"}
    assert found["stale_weights"]["details"]["bias"] > 10


def test_unbiased_drift_beyond_precision_in_the_whole_batch_is_a_prompt_mismatch():
    rng = np.random.default_rng(12)
    pairs = [(lp, lp + rng.normal(0, 0.05, len(lp))) for lp, _ in clean_batch(rng, 12, 40)]
    found = causes(diagnose(pairs))
    assert set(found) == {"prompt_mismatch"}
    assert found["prompt_mismatch"]["runner_up"]["cause"] == "stale_weights"


def context_batch(rng, drifting):
    pairs = clean_batch(rng, sequences=8, length=24)
    for i in drifting:
        lp, twin = pairs[i]
        pairs[i] = (lp, twin + rng.normal(0, 0.05, len(lp)))
    return pairs


def test_the_shortest_sequences_drifting_from_the_start_is_padding_not_weights():
    rng = np.random.default_rng(13)
    prompt_lengths = np.full(8, 10)
    sequence_lengths = np.array([30, 30, 18, 30, 18, 30, 30, 18])
    found = causes(
        diagnose(
            context_batch(rng, [2, 4, 7]),
            prompt_lengths=prompt_lengths,
            sequence_lengths=sequence_lengths,
        )
    )
    assert set(found) == {"mask_padding"}
    assert found["mask_padding"]["sequences"] == ["s2", "s4", "s7"]
    assert found["mask_padding"]["runner_up"]["cause"] == "stale_weights"


def test_the_longest_prompts_drifting_from_the_start_is_truncation():
    rng = np.random.default_rng(14)
    prompt_lengths = np.array([8, 40, 9, 8, 10, 41, 8, 9])
    found = causes(
        diagnose(
            context_batch(rng, [1, 5]),
            prompt_lengths=prompt_lengths,
            sequence_lengths=prompt_lengths + 24,
        )
    )
    assert set(found) == {"prompt_mismatch"}
    assert found["prompt_mismatch"]["sequences"] == ["s1", "s5"]


def test_different_weight_fingerprints_are_named_even_without_drift():
    rng = np.random.default_rng(15)
    context = {"fixture_weights": "sha256:" + "a" * 64, "replay_weights": "sha256:" + "b" * 64}
    found = causes(diagnose(clean_batch(rng), **context))
    assert set(found) == {"stale_weights"}
    assert found["stale_weights"]["severity"] == "info"
    assert found["stale_weights"]["sequences"] == []


def test_faults_in_different_sequences_are_all_named_each_to_its_sequences():
    rng = np.random.default_rng(16)
    pairs = clean_batch(rng, sequences=10, length=30)
    lp, _ = pairs[1]
    pairs[1] = (lp, np.r_[lp[1:], -0.5])  # a shifted sequence
    lp, twin = pairs[4]
    filled = lp.copy()
    filled[20:] = -2.0
    pairs[4] = (filled, twin)  # a padded one
    lp, twin = pairs[7]
    pairs[7] = (lp, np.r_[twin[:6], twin[6:] + rng.normal(0, 0.6, 24)])  # positions from 6
    found = causes(diagnose(pairs))
    assert set(found) == {"token_shift", "mask_padding", "position_ids"}
    assert found["token_shift"]["sequences"] == ["s1"]
    assert found["mask_padding"]["sequences"] == ["s4"]
    assert found["position_ids"]["first_position"] == {"sequence_id": "s7", "position": 6}


def test_sporadic_drift_beside_clean_sequences_is_never_a_batch_wide_cause():
    rng = np.random.default_rng(17)
    pairs = clean_batch(rng, sequences=8, length=40)
    lp, twin = pairs[6]
    spiked = twin.copy()
    spiked[[5, 17, 31]] += 0.8  # three isolated tokens: no onset, no context, not the batch
    pairs[6] = (lp, spiked)
    found = causes(diagnose(pairs))
    assert set(found) == {"unexplained"}
    assert found["unexplained"]["sequences"] == ["s6"]


def test_a_shared_onset_beside_clean_long_sequences_is_positions_not_an_update():
    rng = np.random.default_rng(18)
    pairs = clean_batch(rng, sequences=12, length=30)
    for i in (2, 5, 9):  # the same position bug from index 7, in three sequences only
        lp, twin = pairs[i]
        pairs[i] = (lp, np.r_[twin[:7], twin[7:] + lp[7:] * 0.15 * rng.choice([-1, 1], 23)])
    found = causes(diagnose(pairs))
    # an in-flight update would have reached the nine sequences still generating past 7
    assert set(found) == {"position_ids"}
    assert found["position_ids"]["sequences"] == ["s2", "s5", "s9"]
    assert found["position_ids"]["first_position"]["position"] == 7


def calibrated_noise_batch(rng, sequences=12, length=40, noise=0.01):
    """A bf16-like pair: every token moved by noise of mean |d| ~ `noise`, and the
    calibrated context that says so (expected |d| per token, tau 3 x its q999)."""
    pairs = []
    for _ in range(sequences):
        lp = lm_logprobs(rng, length)
        pairs.append((lp, lp + rng.laplace(0, noise, length)))
    n = sequences * length
    expected = np.full(n, noise)  # Laplace(0, b): mean |d| = b, q999 ~ 6.9 b
    return pairs, {"noise_expected": expected}, np.full(n, 3 * 6.9 * noise)


def test_calibrated_noise_alone_names_nothing():
    pairs, context, tau = calibrated_noise_batch(np.random.default_rng(20))
    assert [f["cause"] for f in diagnose(pairs, tau=tau, **context)] in ([], ["dtype"])


def test_an_update_in_flight_under_noise_is_one_batch_change_point():
    """From index 15 on every sequence's drift doubles-plus: each token crosses its tau only
    now and then, but the batch's drift by index steps up there: version_change at 15."""
    rng = np.random.default_rng(21)
    pairs, context, tau = calibrated_noise_batch(rng)
    for i, (rollout, train) in enumerate(pairs):
        step = np.where(np.arange(len(train)) >= 15, rng.choice([-1, 1]) * 0.15, 0.0)
        pairs[i] = (rollout, train + step * (1 + 0.3 * rng.standard_normal(len(train))))
    found = causes(diagnose(pairs, tau=tau, **context))
    assert set(found) == {"version_change"}
    finding = found["version_change"]
    assert finding["details"]["at"] == 15 and finding["first_position"]["position"] == 15
    assert len(finding["sequences"]) >= 10
    assert finding["details"]["level_before"] < 2 <= finding["details"]["level_after"] / 2


def test_drift_from_the_first_tokens_is_no_update_in_flight():
    """The same step from index 1: weights differ from the start, not during generation."""
    rng = np.random.default_rng(22)
    pairs, context, tau = calibrated_noise_batch(rng)
    for i, (rollout, train) in enumerate(pairs):
        step = np.where(np.arange(len(train)) >= 1, rng.choice([-1, 1]) * 0.15, 0.0)
        pairs[i] = (rollout, train + step)
    assert "version_change" not in causes(diagnose(pairs, tau=tau, **context))
