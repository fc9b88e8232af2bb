"""Gates as practitioners write them: NeMo-RL's token_mult_prob_error statistics."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from pipeline.compare.metrics import batch_metrics
from pipeline.fixture.io import read_table, write_table
from tests.helpers import read_report, run_lpx

DOCS = Path(__file__).resolve().parents[1] / "docs"
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
