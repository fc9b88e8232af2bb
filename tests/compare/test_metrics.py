import numpy as np
import pytest

from pipeline.compare.metrics import batch_metrics, kl_input_drift, sequence_metrics


def test_batch_metrics_match_definitions():
    rollout = np.array([-1.0, -0.5, -2.0, -0.1], dtype=np.float32)
    d = np.array([0.1, -0.2, 0.0, 0.3])
    train = (rollout + d).astype(np.float32)
    d = train.astype(np.float64) - rollout.astype(np.float64)
    r = np.exp(d)
    m = batch_metrics(train, rollout, tau=0.15)
    assert m["tokens"] == 4
    assert m["max_abs_diff"] == pytest.approx(0.3, rel=1e-6)
    assert m["mean_abs_diff"] == pytest.approx(np.abs(d).mean())
    assert m["k1"] == pytest.approx(-d.mean())
    assert m["k2"] == pytest.approx(0.5 * (d**2).mean())
    assert m["k3"] == pytest.approx((r - 1 - d).mean())
    assert m["is_ratio_mean"] == pytest.approx(r.mean())
    assert m["chi2_token"] == pytest.approx((r**2).mean() - 1)
    assert m["ess"] == pytest.approx(1 / ((r / r.mean()) ** 2).mean())
    assert m["clip_frac"] == pytest.approx(np.mean((r < 0.8) | (r > 1.2)))
    assert m["frac_over_tau"] == pytest.approx(0.5)
    assert m["token_mult_prob_error"] == pytest.approx(np.exp(np.abs(d)).mean())
    assert m["max_prob_diff"] == pytest.approx(
        np.abs(np.exp(train) - np.exp(rollout)).max(), rel=1e-6
    )


def test_tail_quantiles_are_nearest_rank():
    rng = np.random.default_rng(0)
    rollout = -rng.exponential(1.0, 100_000).astype(np.float32)
    train = rollout + rng.normal(0, 0.01, 100_000).astype(np.float32)
    m = batch_metrics(train, rollout, tau=0.02)
    a = np.sort(np.abs(train.astype(np.float64) - rollout))
    assert m["p50_abs_diff"] == pytest.approx(a[49_999], rel=1e-6)
    assert m["p99_abs_diff"] == pytest.approx(a[98_999], rel=1e-6)
    assert m["p999_abs_diff"] == pytest.approx(a[99_899], rel=1e-6)
    # Gaussian noise: the median |d| of N(0, 0.01) is 0.674 sigma.
    assert m["p50_abs_diff"] == pytest.approx(0.00674, rel=0.03)


def test_chunked_sums_equal_one_pass(monkeypatch):
    import pipeline.compare.metrics as metrics

    rng = np.random.default_rng(1)
    rollout = -rng.exponential(1.0, 10_000).astype(np.float32)
    train = rollout + rng.normal(0, 0.05, 10_000).astype(np.float32)
    whole = batch_metrics(train, rollout, tau=0.05)
    monkeypatch.setattr(metrics, "CHUNK", 999)
    chunked = batch_metrics(train, rollout, tau=0.05)
    for name, value in whole.items():
        assert chunked[name] == pytest.approx(value, rel=1e-9), name


def test_sequence_metrics_per_segment_including_empty():
    rollout = np.array([-1, -1, -1, -2, -2], dtype=np.float32)
    train = np.array([-1.1, -0.9, -1.0, -2.0, -1.5], dtype=np.float32)
    offsets = np.array([0, 3, 3, 5])
    s = sequence_metrics(train, rollout, offsets)
    assert s["tokens"].tolist() == [3, 0, 2]
    assert s["max_abs_diff"] == pytest.approx([0.1, 0.0, 0.5], abs=1e-6)
    assert s["sum_diff"] == pytest.approx([0.0, 0.0, 0.5], abs=1e-6)
    assert s["log_ppl_diff"] == pytest.approx([0.0, 0.0, -0.25], abs=1e-6)
    assert s["chi2_seq"][2] == pytest.approx(np.exp(1.0) - 1, rel=1e-5)


def test_kl_input_drift_moves_with_the_gap():
    rollout = np.array([-1.0, -2.0, -0.5])
    train = rollout + np.array([0.0, 0.3, -0.3])
    ref = rollout - 0.1
    drift = kl_input_drift(train, rollout, {"ref": ref})
    # pi_old from rollout: ratio exp(train - rollout); from train: exactly 1.
    assert drift["ratio"]["max_abs_delta"] == pytest.approx(np.exp(0.3) - 1)
    assert drift["ratio"]["clip_frac_rollout_as_old"] == pytest.approx(2 / 3)
    assert drift["ratio"]["clip_frac_train_as_old"] == 0.0
    k3_rollout = np.expm1(-0.1) + 0.1
    assert drift["ref_kl"]["k3_mean_rollout_as_pi"] == pytest.approx(k3_rollout)
    assert drift["ref_kl"]["mean_abs_delta"] > 0.01


def test_one_nan_token_never_hides_the_drift_of_the_others():
    """-inf on both sides gives d = NaN; Python's max(0.0, nan) is 0.0, which passed."""
    train = np.array([-1.0, -np.inf, -2.0, -0.5])
    rollout = np.array([-1.5, -np.inf, -2.0, -0.5])
    metrics = batch_metrics(train, rollout, tau=0.1)
    assert np.isnan(metrics["max_abs_diff"])
    from pipeline.compare.policy import judge, load_policy

    verdict = judge(load_policy(), "bfloat16", {**metrics, "max_seq_mean_abs_diff": 0.0}, [])
    assert verdict["verdict"] == "fail"
    assert any(v["metric"] == "max_abs_diff" for v in verdict["violations"])
