"""Gates as practitioners write them: NeMo-RL's token_mult_prob_error statistics, exact
(bitwise) mode, and forward/reverse KL over the rollout's recorded top-k ids, scored by the
real HF replay on the tiny model."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from pipeline.compare.metrics import batch_metrics, bitwise_agreement
from pipeline.compare.topk import topk_kl
from pipeline.fixture.io import read_table, write_table
from pipeline.fixture.table import REPLAY_TOP1_CHANNEL
from support.helpers import read_report, run_lpx

DOCS = Path(__file__).resolve().parents[2] / "docs"
NEMO_RL_GATES = (
    "token_mult_prob_error_median",
    "token_mult_prob_error_trimmed_mean",
    "token_mult_prob_error_frac_above_1_1",
)


# --- NeMo-RL's token_mult_prob_error gates -------------------------------------------


@pytest.mark.parametrize("n", [10_001, 10_000])  # odd: one middle token; even: two averaged
def test_nemo_rl_gates_match_numpy(n):
    rng = np.random.default_rng(n)
    rollout = -rng.exponential(1.0, n).astype(np.float32)
    # a bf16-like floor plus a heavy tail: some tokens far above exp(|d|) = 1.1
    noise = rng.normal(0, 0.02, n) + (rng.random(n) < 0.08) * rng.exponential(0.5, n)
    train = (rollout + noise).astype(np.float32)
    exp_abs = np.exp(np.abs(train.astype(np.float64) - rollout.astype(np.float64)))
    kept = np.sort(exp_abs)[: n - n // 20]  # all but the top 5 %
    m = batch_metrics(train, rollout, tau=0.1)
    assert m["token_mult_prob_error_median"] == pytest.approx(np.median(exp_abs), rel=1e-7)
    assert m["token_mult_prob_error_trimmed_mean"] == pytest.approx(kept.mean(), rel=1e-6)
    assert m["token_mult_prob_error_frac_above_1_1"] == np.mean(exp_abs > 1.1)
    assert 0.05 < m["token_mult_prob_error_frac_above_1_1"] < 0.1  # the tail is really there
    assert m["token_mult_prob_error_trimmed_mean"] < m["token_mult_prob_error"]


def test_the_trimmed_mean_drops_exactly_the_top_five_percent():
    """5 tokens of 100 with |d| = 60 (exp = 1.1e26) must go, and the 95 at |d| = 0.01 be
    exactly what is left: no cancellation against the huge total."""
    rollout = np.full(100, -70.0, dtype=np.float32)
    train = rollout + np.float32(0.01)
    train[[3, 17, 42, 60, 99]] = -10.0
    m = batch_metrics(train, rollout, tau=0.1)
    small = np.exp(np.float64(np.abs(train[0] - rollout[0])))
    assert m["token_mult_prob_error"] > 1e24
    assert m["token_mult_prob_error_trimmed_mean"] == pytest.approx(small, rel=1e-7)
    assert m["token_mult_prob_error_median"] == pytest.approx(small, rel=1e-7)
    assert m["token_mult_prob_error_frac_above_1_1"] == 0.05
    # 6 such tokens: one stays in, and the trimmed mean moves by exp(60) / 95
    train[5] = -10.0
    m6 = batch_metrics(train, rollout, tau=0.1)
    assert m6["token_mult_prob_error_trimmed_mean"] == pytest.approx(
        (94 * small + np.exp(60.0)) / 95, rel=1e-5
    )


def test_fewer_than_twenty_tokens_trim_nothing():
    rollout = np.array([-1.0, -2.0, -3.0], dtype=np.float32)
    train = np.array([-1.0, -2.5, -3.09], dtype=np.float32)  # |d| 0, 0.5, 0.09
    m = batch_metrics(train, rollout, tau=0.1)
    assert m["token_mult_prob_error_trimmed_mean"] == pytest.approx(m["token_mult_prob_error"])
    assert m["token_mult_prob_error_median"] == pytest.approx(np.exp(0.09), rel=1e-6)
    assert m["token_mult_prob_error_frac_above_1_1"] == pytest.approx(1 / 3)


def test_a_nan_token_fails_the_gates_instead_of_being_trimmed():
    rollout = np.full(40, -1.0, dtype=np.float32)
    train = rollout.copy()
    rollout[7] = train[7] = -np.inf  # -inf on both sides: d is NaN
    m = batch_metrics(train, rollout, tau=0.1)
    for name in NEMO_RL_GATES:
        assert np.isnan(m[name]), name


def _nemo_rl_policy(tmp_path) -> Path:
    """The ready-to-copy snippet from docs/policy.md, exactly as written there."""
    text = (DOCS / "policy.md").read_text()
    section = text[text.index("## NeMo-RL's gates") :]
    snippet = re.search(r"```yaml\n(.*?)```", section, re.S).group(1)
    path = tmp_path / "nemo-rl.yaml"
    path.write_text(snippet)
    return path


def test_the_documented_nemo_rl_policy_passes_clean_runs_and_fails_drift(run_dir, tmp_path):
    policy = _nemo_rl_policy(tmp_path)
    for dtype in ("float32", "bfloat16"):
        out = tmp_path / f"clean-{dtype}"
        result = run_lpx(
            "compare", run_dir / "fixture.parquet", run_dir / f"replay-{dtype}.parquet",
            "--policy", policy, "--out", out,
        )  # fmt: skip
        assert result.exit_code == 0, result.output
        report = read_report(out)
        assert set(report["policy"]["limits"]) == set(NEMO_RL_GATES)
        assert report["metrics"]["token_mult_prob_error_median"] < 1.01
        summary = (out / "summary.md").read_text()
        for name in NEMO_RL_GATES:  # limited metrics are shown next to their limit
            value, limit = report["metrics"][name], report["policy"]["limits"][name]
            assert f"| {name} | {value:.4g} | {limit:.4g} |" in summary
    # every token 0.2 nats lower on the training side: exp(0.2) = 1.22 on every gate
    replay = read_table(run_dir / "replay-bfloat16.parquet")
    replay.channels["replay"] = replay.channels["replay"] - np.float32(0.2)
    write_table(replay, tmp_path / "replay-shifted.parquet")
    result = run_lpx(
        "compare", run_dir / "fixture.parquet", tmp_path / "replay-shifted.parquet",
        "--policy", policy, "--out", tmp_path / "shifted",
    )  # fmt: skip
    assert result.exit_code == 1, result.output
    violations = {v["metric"]: v for v in read_report(tmp_path / "shifted")["policy"]["violations"]}
    assert set(violations) == set(NEMO_RL_GATES)
    assert violations["token_mult_prob_error_frac_above_1_1"]["value"] == 1.0
    assert violations["token_mult_prob_error_median"]["value"] == pytest.approx(
        np.exp(0.2), abs=0.02
    )


# --- exact mode ------------------------------------------------------------------------


def test_bitwise_agreement_on_the_float32_bits():
    rollout = np.array([-1.0, -np.inf, np.nan, 0.0, -2.0, -3.0], dtype=np.float32)
    train = np.array([-1.0, -np.inf, np.nan, -0.0, np.nextafter(-2.0, 0, dtype=np.float32), -3.0])
    # -inf == -inf counts; NaN never; 0.0 and -0.0 differ in their bits; one ulp differs;
    # a float64 side is compared as the float32 it holds
    assert bitwise_agreement(train, rollout) == {
        "bitwise_equal_fraction": 3 / 6,
        "bitwise_mismatches": 3,
    }


def _active(table, channel):
    return table.channels[channel][table.completion_mask]


def test_exact_mode_fails_an_hf_rollout_that_is_close_but_not_bitwise_equal(run_dir, tmp_path):
    """The fixture is an HF rollout with a KV cache: the fp32 replay agrees to ~1e-6 but not
    bit for bit, so the plain compare passes and --exact fails on the mismatches."""
    fixture = read_table(run_dir / "fixture.parquet")
    replay = read_table(run_dir / "replay-float32.parquet")
    rollout, train = _active(fixture, "rollout"), _active(replay, "replay")
    mismatches = int(np.count_nonzero(rollout.view(np.uint32) != train.view(np.uint32)))
    assert 0 < mismatches < len(rollout)
    args = ("compare", run_dir / "fixture.parquet", run_dir / "replay-float32.parquet")
    plain = run_lpx(*args, "--out", tmp_path / "plain")
    assert plain.exit_code == 0, plain.output
    report = read_report(tmp_path / "plain")
    assert report["metrics"]["bitwise_mismatches"] == mismatches
    equal_fraction = (len(rollout) - mismatches) / len(rollout)
    assert report["metrics"]["bitwise_equal_fraction"] == equal_fraction
    assert report["policy"]["exact"] is False and "exact mode" not in plain.output

    exact = run_lpx(*args, "--exact", "--out", tmp_path / "exact")
    assert exact.exit_code == 1, exact.output
    report = read_report(tmp_path / "exact")
    assert report["verdict"] == "fail" and report["policy"]["exact"] is True
    assert report["policy"]["violations"] == [
        {"metric": "bitwise_mismatches", "value": mismatches, "limit": 0}
    ]
    percent = f"{100 * equal_fraction:.2f} %"
    line = f"exact mode (--exact): bitwise equal: {percent} ({mismatches} mismatches of"
    assert line in exact.output
    assert f"- bitwise_mismatches = {mismatches} > 0" in exact.output


def test_exact_mode_passes_a_bitwise_equal_pair_and_catches_one_ulp(run_dir, tmp_path):
    fixture = read_table(run_dir / "fixture.parquet")
    replay = read_table(run_dir / "replay-float32.parquet")
    fixture.channels["rollout"] = replay.channels["replay"].copy()  # the replay's own values
    write_table(fixture, tmp_path / "fixture-equal.parquet")
    args = ("compare", tmp_path / "fixture-equal.parquet", run_dir / "replay-float32.parquet")
    result = run_lpx(*args, "--exact", "--out", tmp_path / "equal")
    assert result.exit_code == 0, result.output
    report = read_report(tmp_path / "equal")
    tokens = int(fixture.completion_mask.sum())
    assert report["metrics"]["bitwise_equal_fraction"] == 1.0
    assert report["metrics"]["bitwise_mismatches"] == 0
    assert f"bitwise equal: 100.00 % (0 mismatches of {tokens} tokens)" in result.output

    # one active token one ulp away: invisible to every limit, not to --exact
    first_active = int(np.flatnonzero(fixture.completion_mask)[0])
    values = fixture.channels["rollout"]
    values[first_active] = np.nextafter(values[first_active], np.float32(0))
    write_table(fixture, tmp_path / "fixture-ulp.parquet")
    args = ("compare", tmp_path / "fixture-ulp.parquet", run_dir / "replay-float32.parquet")
    assert run_lpx(*args, "--out", tmp_path / "ulp-plain").exit_code == 0
    result = run_lpx(*args, "--exact", "--out", tmp_path / "ulp")
    assert result.exit_code == 1
    assert f"bitwise equal: {100 * (tokens - 1) / tokens:.2f} % (1 mismatch of" in result.output
    violations = read_report(tmp_path / "ulp")["policy"]["violations"]
    assert violations == [{"metric": "bitwise_mismatches", "value": 1, "limit": 0}]


def test_exact_mode_over_a_matrix_fails_the_pair_that_differs(run_dir, tmp_path):
    fixture = read_table(run_dir / "fixture.parquet")
    fixture.channels["rollout"] = read_table(run_dir / "replay-float32.parquet").channels["replay"]
    write_table(fixture, tmp_path / "fixture-equal.parquet")
    result = run_lpx(
        "compare", tmp_path / "fixture-equal.parquet", run_dir / "replay-float32.parquet",
        run_dir / "replay-bfloat16.parquet", "--exact", "--out", tmp_path / "matrix",
    )  # fmt: skip
    assert result.exit_code == 1, result.output
    matrix = read_report(tmp_path / "matrix")
    assert [row["verdict"] for row in matrix["pairs"]] == ["pass", "fail"]
    assert matrix["pairs"][0]["bitwise_mismatches"] == 0
    assert matrix["pairs"][1]["bitwise_mismatches"] == int(fixture.completion_mask.sum())
    assert "Exact mode (--exact)" in result.output


# --- top-k KL, scored by the real HF replay ---------------------------------------------


def _model_top_k(fixture, model_dir, k: int, dtype: str = "float32"):
    """The tiny model's own top-k ids and fp32 logprobs at every completion position (one
    unpadded forward per sequence): what a rollout engine with logprobs=k records."""
    import torch

    from pipeline.engines.hf.model import load_model

    model = load_model(model_dir, dtype)
    ids, values = [], []
    with torch.no_grad():
        for i in range(fixture.num_sequences):
            prompt, completion = fixture.prompt_of(i), fixture.completion_of(i)
            tokens = torch.from_numpy(np.concatenate([prompt, completion]).astype(np.int64))
            logits = model(tokens[None]).logits[0, len(prompt) - 1 : -1]
            top = logits.float().log_softmax(-1).topk(k, dim=-1)
            ids.append(top.indices.numpy())
            values.append(top.values.numpy())
    return np.concatenate(ids).astype(np.int32), np.concatenate(values).astype(np.float32)


@pytest.fixture(scope="module")
def topk_run(run_dir, tiny_model, tmp_path_factory):
    """fixture-k4: the HF rollout with the model's top-4 per token; replay-k4: lpx replay of
    it (the replay scores the fixture's ids); fixture-same: fixture-k4 whose top-4 logprobs
    are the replay's own, so both sides hold identical numbers at the same ids."""
    out = tmp_path_factory.mktemp("topk")
    fixture = read_table(run_dir / "fixture.parquet")
    fixture.top_ids, fixture.top_logprobs = _model_top_k(fixture, tiny_model, 4)
    write_table(fixture, out / "fixture-k4.parquet")
    result = run_lpx("replay", out / "fixture-k4.parquet", "--out", out / "replay-k4.parquet")
    assert result.exit_code == 0, result.output
    replay = read_table(out / "replay-k4.parquet")
    fixture.top_logprobs = replay.top_logprobs.copy()
    write_table(fixture, out / "fixture-same.parquet")
    return out


def test_the_hf_replay_scores_the_fixtures_top_k_ids(topk_run, run_dir):
    fixture = read_table(topk_run / "fixture-k4.parquet")
    replay = read_table(topk_run / "replay-k4.parquet")
    assert replay.metadata["top_logprobs"] == "at the fixture's top-k ids"
    assert replay.metadata["knobs"]["score_top_ids"] is True
    assert np.array_equal(replay.top_ids, fixture.top_ids)
    # the replay's fp32 logprobs at those ids: the model's own, to fp32 rounding
    np.testing.assert_allclose(replay.top_logprobs, fixture.top_logprobs, atol=2e-5, rtol=0)
    # the sampled token's logprob is unchanged by scoring the extra ids
    plain = read_table(run_dir / "replay-float32.parquet")
    assert np.array_equal(replay.channels["replay"], plain.channels["replay"])
    # its own most likely token's logprob is the top of its distribution
    assert np.array_equal(replay.channels[REPLAY_TOP1_CHANNEL], plain.top_logprobs[:, 0])


def test_a_top_1_fixture_keeps_the_replays_own_top_1(run_dir, tiny_model):
    """HF rollouts record top-1 only: the replay records its own top-1 as before."""
    replay = read_table(run_dir / "replay-float32.parquet")
    fixture = read_table(run_dir / "fixture.parquet")
    assert fixture.top_ids.shape[1] == 1 and replay.top_ids.shape[1] == 1
    assert "top_logprobs" not in replay.metadata
    assert REPLAY_TOP1_CHANNEL not in replay.channels
    ids, values = _model_top_k(fixture, tiny_model, 1)
    assert np.array_equal(replay.top_ids, ids)
    np.testing.assert_allclose(replay.top_logprobs, values, atol=2e-5, rtol=0)


def test_identical_sides_give_a_top_k_kl_of_exactly_zero(topk_run, tmp_path):
    result = run_lpx(
        "compare", topk_run / "fixture-same.parquet", topk_run / "replay-k4.parquet",
        "--out", tmp_path / "same",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    metrics = read_report(tmp_path / "same")["metrics"]
    assert metrics["topk_k"] == 4
    assert metrics["topk_tokens"] == metrics["tokens"]
    for name in ("forward_mean", "forward_max", "reverse_mean", "reverse_max"):
        assert metrics[f"topk_kl_{name}"] == 0.0, name
    replay = read_table(topk_run / "replay-k4.parquet")
    mass = np.exp(replay.top_logprobs[replay.completion_mask].astype(np.float64)).sum(1).mean()
    assert metrics["topk_mass_rollout_mean"] == metrics["topk_mass_train_mean"]
    assert metrics["topk_mass_train_mean"] == pytest.approx(mass, rel=1e-12)
    assert "| topk_kl_forward_mean | 0 |" in result.output


def test_a_temperature_processed_side_gives_the_kl_numpy_computes(topk_run, tmp_path):
    """The replay at temperature 0.7: restricted to the same ids, its distribution is
    softmax(log p / 0.7) of the T=1 one, so the KL follows from the T=1 logprobs alone."""
    temperature = 0.7
    result = run_lpx(
        "replay", topk_run / "fixture-same.parquet", "--temperature", temperature,
        "--out", tmp_path / "replay-t.parquet",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    run_lpx(
        "compare", topk_run / "fixture-same.parquet", tmp_path / "replay-t.parquet",
        "--out", tmp_path / "t",
    )  # fmt: skip
    metrics = read_report(tmp_path / "t")["metrics"]

    fixture = read_table(topk_run / "fixture-same.parquet")
    log_p = fixture.top_logprobs[fixture.completion_mask].astype(np.float64)
    log_p -= np.log(np.exp(log_p).sum(1, keepdims=True))  # rollout, renormalised on the ids
    log_q = log_p / temperature
    log_q -= np.log(np.exp(log_q).sum(1, keepdims=True))  # T = 0.7, renormalised
    p, q = np.exp(log_p), np.exp(log_q)
    forward = (p * (log_p - log_q)).sum(1)
    reverse = (q * (log_q - log_p)).sum(1)
    assert metrics["topk_kl_forward_mean"] == pytest.approx(forward.mean(), rel=1e-4)
    assert metrics["topk_kl_reverse_mean"] == pytest.approx(reverse.mean(), rel=1e-4)
    assert metrics["topk_kl_forward_max"] == pytest.approx(forward.max(), rel=1e-4)
    assert metrics["topk_kl_reverse_max"] == pytest.approx(reverse.max(), rel=1e-4)
    assert metrics["topk_kl_forward_mean"] > 1e-3  # a real KL, not the rounding floor
    # sharpening moves mass onto the most likely ids
    assert metrics["topk_mass_train_mean"] > metrics["topk_mass_rollout_mean"]


def test_different_ids_report_no_top_k_kl(topk_run, run_dir, tmp_path):
    """A replay that recorded its own top-1 (here of a k=4 fixture, with score_top_ids off)
    holds other ids than the fixture: no KL is reported, the top-1 flip rate still is, and a
    policy limit on the KL is listed as not measured."""
    result = run_lpx(
        "replay", topk_run / "fixture-k4.parquet", "--set", "score_top_ids=false",
        "--out", tmp_path / "own.parquet",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    own = read_table(tmp_path / "own.parquet")
    assert own.top_ids.shape[1] == 1 and "top_logprobs" not in own.metadata
    assert np.array_equal(own.top_ids, read_table(run_dir / "replay-float32.parquet").top_ids)
    policy = tmp_path / "p.yaml"
    policy.write_text(
        "version: 1\nprofiles:\n  float32:\n    tau: 1.0e-4\n"
        "    limits: {topk_kl_forward_mean: 1.0e-6}\n"
    )
    result = run_lpx(
        "compare", topk_run / "fixture-k4.parquet", tmp_path / "own.parquet",
        "--policy", policy, "--out", tmp_path / "cmp",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    report = read_report(tmp_path / "cmp")
    assert not [name for name in report["metrics"] if name.startswith("topk_")]
    assert report["metrics"]["top1_flip_rate"] == 0.0
    assert report["policy"]["not_measured"] == ["topk_kl_forward_mean"]


def test_the_top_1_flip_rate_is_the_same_when_the_replay_scored_the_fixtures_ids(
    topk_run, tmp_path
):
    """A rollout whose recorded top-1 is the model's second choice on every third token: the
    flip rate from a replay that scored the fixture's ids equals the one from a replay that
    recorded its own top-1."""
    fixture = read_table(topk_run / "fixture-k4.parquet")
    swapped = np.arange(len(fixture.top_ids)) % 3 == 0
    fixture.top_ids[swapped] = fixture.top_ids[swapped][:, [1, 0, 2, 3]]
    fixture.top_logprobs[swapped] = fixture.top_logprobs[swapped][:, [1, 0, 2, 3]]
    write_table(fixture, tmp_path / "fixture-swapped.parquet")
    rates = {}
    for name, knobs in (("scored", []), ("own", ["--set", "score_top_ids=false"])):
        result = run_lpx(
            "replay", tmp_path / "fixture-swapped.parquet", *knobs,
            "--out", tmp_path / f"replay-{name}.parquet",
        )  # fmt: skip
        assert result.exit_code == 0, result.output
        run_lpx(
            "compare", tmp_path / "fixture-swapped.parquet", tmp_path / f"replay-{name}.parquet",
            "--out", tmp_path / f"cmp-{name}",
        )  # fmt: skip
        rates[name] = read_report(tmp_path / f"cmp-{name}")["metrics"]["top1_flip_rate"]
    expected = swapped[fixture.completion_mask].mean()
    assert rates["scored"] == rates["own"] == pytest.approx(expected)


def test_topk_kl_is_nan_when_an_alternative_is_unknown():
    rollout = np.log(np.array([[0.5, 0.3, 0.1], [0.6, 0.2, 0.1]]))
    train = rollout.copy()
    rollout[1, 2] = np.nan
    metrics = topk_kl(rollout, train)
    assert metrics["topk_kl_forward_max"] != metrics["topk_kl_forward_max"]  # NaN
    assert np.isnan(metrics["topk_kl_reverse_mean"])
    assert json.dumps(metrics)  # still plain numbers for report.json
