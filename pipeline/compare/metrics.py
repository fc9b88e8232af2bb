"""Token, sequence and batch drift metrics between training-side and rollout-side logprobs.

Sign convention (recorded in every report): d_t = logp_train(t) - logp_rollout(t) over
active completion tokens, r_t = exp(d_t) = pi_train / pi_rollout. Definitions follow
shared/notes/metrics.md: k1 = mean(-d) estimates KL(rollout || train); k2 = 0.5 mean(d^2);
k3 = mean(r - 1 - d) (Schulman's low-variance estimator); ESS = 1 / mean((w / mean w)^2).
NeMo-RL's token_mult_prob_error is mean exp(|d|); its CI gates read the median, the mean
without the top 5 % and the fraction above 1.1 (shared/notes/field-2026.md).

All functions are pure numpy and vectorized; batch metrics stream over fixed-size chunks
so memory stays at a few arrays of the input size whatever the batch.
"""

from __future__ import annotations

import math

import numpy as np

SIGN_CONVENTION = "d = logp_train - logp_rollout; r = exp(d) = pi_train / pi_rollout"
QUANTILES = (0.5, 0.99, 0.999)
CHUNK = 1 << 20
RELATIVE_EPS = 1e-6
# NeMo-RL's gates on exp(|d|): `ratio_above(1.1)` and the mean without the top 5 %.
MULT_PROB_ERROR_THRESHOLD = 1.1
TRIMMED_TOP_FRACTION = 0.05


def batch_metrics(
    train: np.ndarray,
    rollout: np.ndarray,
    tau: float,
    clip_low: float = 0.8,
    clip_high: float = 1.2,
) -> dict[str, float]:
    """Batch-level drift metrics over aligned 1-D logprob arrays of active tokens."""
    n = len(train)
    if n == 0:
        return {"tokens": 0}
    sums = np.zeros(12)
    max_abs = max_rel = max_prob = 0.0
    abs_diff = np.empty(n, dtype=np.float32)
    for start in range(0, n, CHUNK):
        t = train[start : start + CHUNK].astype(np.float64)
        r_lp = rollout[start : start + CHUNK].astype(np.float64)
        with np.errstate(invalid="ignore"):  # -inf on both sides is NaN, kept (see below)
            d = t - r_lp
        a = np.abs(d)
        abs_diff[start : start + len(d)] = a
        mult_prob_error = np.exp(a)  # NeMo-RL's per-token exp(|d|), freed before the rest
        s_mult_prob_error = mult_prob_error.sum()
        above = np.count_nonzero(mult_prob_error > MULT_PROB_ERROR_THRESHOLD)
        del mult_prob_error
        em1 = np.expm1(d)  # r - 1, exact near zero
        ratio = em1 + 1.0
        rel = a / np.maximum(np.abs(t), RELATIVE_EPS)
        prob = np.abs(np.exp(t) - np.exp(r_lp))
        sums += (
            d.sum(),
            (d * d).sum(),
            (em1 - d).sum(),
            ratio.sum(),
            (ratio * ratio).sum(),
            np.count_nonzero((ratio < clip_low) | (ratio > clip_high)),
            np.count_nonzero(a > tau),
            a.sum(),
            rel.sum(),
            prob.sum(),
            s_mult_prob_error,
            above,
        )
        max_abs = _max_keeping_nan(max_abs, float(a.max()))
        max_rel = _max_keeping_nan(max_rel, float(rel.max()))
        max_prob = _max_keeping_nan(max_prob, float(prob.max()))
    (s_d, s_d2, s_k3, s_r, s_r2, clipped, over_tau, s_abs, s_rel, s_prob, s_exp_abs, above) = sums
    mean_ratio = s_r / n
    quantiles, median_exp, trimmed_exp = _order_statistics(abs_diff)
    if math.isnan(max_abs):  # a NaN token sorts last and would be trimmed away: fail instead
        median_exp = trimmed_exp = above = math.nan
    metrics = {
        "tokens": n,
        "max_abs_diff": max_abs,
        "mean_abs_diff": s_abs / n,
        "rms_diff": float(np.sqrt(s_d2 / n)),
        "p50_abs_diff": quantiles[0],
        "p99_abs_diff": quantiles[1],
        "p999_abs_diff": quantiles[2],
        "mean_diff": s_d / n,
        "frac_over_tau": over_tau / n,
        "tau": tau,
        "max_rel_diff": max_rel,
        "mean_rel_diff": s_rel / n,
        "max_prob_diff": max_prob,
        "mean_prob_diff": s_prob / n,
        "k1": -s_d / n,
        "k2": 0.5 * s_d2 / n,
        "k3": s_k3 / n,
        "is_ratio_mean": mean_ratio,
        "chi2_token": s_r2 / n - 1.0,
        "ess": (mean_ratio * mean_ratio) / (s_r2 / n) if s_r2 > 0 else 0.0,
        "clip_frac": clipped / n,
        "token_mult_prob_error": s_exp_abs / n,
        "token_mult_prob_error_median": median_exp,
        "token_mult_prob_error_trimmed_mean": trimmed_exp,
        "token_mult_prob_error_frac_above_1_1": above / n,
    }
    return {name: (int(v) if name == "tokens" else float(v)) for name, v in metrics.items()}


def bitwise_agreement(train: np.ndarray, rollout: np.ndarray) -> dict[str, float]:
    """How many tokens carry the same float32 logprob bit for bit on both sides.

    The uint32 views are compared, so -inf equals -inf, and 0.0 and -0.0 differ; NaN never
    equals anything, whatever its payload. Batch-invariant and true-on-policy stacks
    (slime's true-on-policy mode, RL-Kernel) promise zero mismatches.
    """
    n = len(train)
    train32 = np.ascontiguousarray(train, dtype=np.float32)
    rollout32 = np.ascontiguousarray(rollout, dtype=np.float32)
    same = train32.view(np.uint32) == rollout32.view(np.uint32)
    equal = int(np.count_nonzero(same & ~np.isnan(train32)))
    return {
        "bitwise_equal_fraction": equal / n if n else 0.0,
        "bitwise_mismatches": n - equal,
    }


def sequence_metrics(
    train: np.ndarray, rollout: np.ndarray, offsets: np.ndarray
) -> dict[str, np.ndarray]:
    """Per-sequence drift over active tokens; ``offsets`` delimit each sequence's tokens."""
    d = train.astype(np.float64) - rollout.astype(np.float64)
    a = np.abs(d)
    lengths = np.diff(offsets)
    sum_d = _segment_sum(d, offsets)
    sum_abs = _segment_sum(a, offsets)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        mean_abs = np.where(lengths > 0, sum_abs / np.maximum(lengths, 1), 0.0)
        chi2 = np.expm1(np.minimum(2.0 * sum_d, 700.0))
    return {
        "tokens": lengths,
        "max_abs_diff": _segment_max(a, offsets),
        "mean_abs_diff": mean_abs,
        "sum_abs_diff": sum_abs,
        "sum_diff": sum_d,
        # mean logp_rollout - mean logp_train
        "log_ppl_diff": np.where(lengths > 0, -sum_d / np.maximum(lengths, 1), 0.0),
        "chi2_seq": chi2,
    }


def _max_keeping_nan(current: float, new: float) -> float:
    """Python's max(0.0, nan) is 0.0: one NaN token (e.g. -inf on both sides) would hide every
    other token's drift and pass. A NaN anywhere makes the maximum NaN, which fails limits."""
    if math.isnan(current) or math.isnan(new):
        return math.nan
    return max(current, new)


def _order_statistics(abs_diff: np.ndarray) -> tuple[list[float], float, float]:
    """From one in-place partition of |d| (np.quantile would sort a copy per call): the
    nearest-rank p50/p99/p99.9 of |d|, the median of exp(|d|) (the two middle tokens
    averaged when n is even, as np.median does) and the mean of exp(|d|) over all tokens but
    the floor(5 % of n) with the largest |d|. exp is monotonic, so ranking |d| ranks exp(|d|).
    """
    n = len(abs_diff)
    quantile_ranks = [min(n - 1, max(0, int(np.ceil(q * n)) - 1)) for q in QUANTILES]
    median_ranks = ((n - 1) // 2, n // 2)
    kept = n - int(n * TRIMMED_TOP_FRACTION)
    abs_diff.partition(sorted({*quantile_ranks, *median_ranks, kept - 1}))
    quantiles = [float(abs_diff[rank]) for rank in quantile_ranks]
    with np.errstate(over="ignore"):  # |d| > 88 (float32) or 709 (float64): inf, which fails
        middle = np.exp(abs_diff[list(median_ranks)].astype(np.float64))
        # float32 exp, float64 sum: the kept tokens are the small ones, and one pass stays cheap
        trimmed = float(np.exp(abs_diff[:kept]).sum(dtype=np.float64)) / kept
    return quantiles, float(middle.mean()), trimmed


def _segment_sum(values: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    return _segment_reduce(np.add, values, offsets)


def _segment_max(values: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    return _segment_reduce(np.maximum, values, offsets)


def _segment_reduce(ufunc, values: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """ufunc.reduceat over each [offsets[i], offsets[i+1]) segment; empty segments give 0."""
    lengths = np.diff(offsets)
    out = np.zeros(len(lengths))
    nonempty = lengths > 0
    if nonempty.any():
        out[nonempty] = ufunc.reduceat(values, offsets[:-1][nonempty])
    return out


def kl_input_drift(
    train: np.ndarray, rollout: np.ndarray, channels: dict[str, np.ndarray], clip: float = 0.2
) -> dict[str, dict[str, float]]:
    """How much the GRPO/PPO loss inputs move when rollout-side logprobs stand in for
    training-side ones.

    - ``old`` (or the replay itself when absent) is pi_old; the PPO ratio pi/pi_old with
      pi = ``current`` (else the replay) is computed once with the rollout logprobs as
      pi_old and once with the training-side ones; reported: mean and max |delta ratio| and
      both clip fractions.
    - ``ref``: the per-token KL(pi || pi_ref) k3 penalty computed with pi = rollout vs
      pi = train; reported: both means and mean |delta|.
    """
    out: dict[str, dict[str, float]] = {}
    if not len(train):
        return out
    train64, rollout64 = train.astype(np.float64), rollout.astype(np.float64)
    current = channels.get("current")
    policy = train64 if current is None else current.astype(np.float64)
    old = train64 if channels.get("old") is None else channels["old"].astype(np.float64)
    ratio_rollout_old = np.exp(policy - rollout64)
    ratio_train_old = np.exp(policy - old)
    delta = np.abs(ratio_rollout_old - ratio_train_old)
    out["ratio"] = {
        "pi": "current" if current is not None else "replay",
        "pi_old": "old" if "old" in channels else "replay",
        "mean_abs_delta": float(delta.mean()),
        "max_abs_delta": float(delta.max()),
        "clip_frac_rollout_as_old": float(np.mean(np.abs(ratio_rollout_old - 1) > clip)),
        "clip_frac_train_as_old": float(np.mean(np.abs(ratio_train_old - 1) > clip)),
    }
    if "old" in channels:
        gap = np.abs(old - train64)
        out["old_vs_replay"] = {
            "max_abs_diff": float(gap.max()),
            "mean_abs_diff": float(gap.mean()),
        }
    if "ref" in channels:
        ref = channels["ref"].astype(np.float64)
        kl_rollout = _k3(ref - rollout64)
        kl_train = _k3(ref - train64)
        out["ref_kl"] = {
            "k3_mean_rollout_as_pi": float(kl_rollout.mean()),
            "k3_mean_train_as_pi": float(kl_train.mean()),
            "mean_abs_delta": float(np.abs(kl_rollout - kl_train).mean()),
        }
    return out


def _k3(log_ratio: np.ndarray) -> np.ndarray:
    """Per-token k3 = r - 1 - log r with log r = logp_ref - logp_pi (>= 0, unbiased for KL)."""
    return np.expm1(log_ratio) - log_ratio
