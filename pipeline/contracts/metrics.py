"""Every metric compare writes into report.json, with the range it can take and whether a
policy may limit it: the one list that compare's policy, the report's schema and the summary
read (field definitions: shared/notes/metrics.md and pipeline/compare/metrics.py).

A metric not listed here (a newer lpx's) only has to be a number.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

INF = math.inf


@dataclass(frozen=True)
class Metric:
    name: str
    low: float = -INF
    high: float = INF
    integer: bool = False
    limited: bool = True  # a policy profile may set a limit on it


def _nonnegative(*names: str) -> tuple[Metric, ...]:
    return tuple(Metric(name, 0.0) for name in names)


def _fractions(*names: str) -> tuple[Metric, ...]:
    return tuple(Metric(name, 0.0, 1.0) for name in names)


METRICS: tuple[Metric, ...] = (
    Metric("tokens", 0, integer=True, limited=False),
    Metric("bitwise_mismatches", 0, integer=True, limited=False),  # judged by --exact
    Metric("tau", 0.0, limited=False),  # the token threshold the batch was judged by
    *_nonnegative(
        "max_abs_diff",
        "mean_abs_diff",
        "rms_diff",
        "p50_abs_diff",
        "p99_abs_diff",
        "p999_abs_diff",
        "max_rel_diff",
        "mean_rel_diff",
        "k2",
        "k3",
        "max_seq_mean_abs_diff",
        "is_ratio_mean",
    ),
    Metric("mean_diff"),  # signed: k1 = -mean_diff
    Metric("k1"),
    Metric("chi2_token"),  # E[r^2] - 1: first order in the signed mean, either side of 0
    *_fractions(
        "max_prob_diff",
        "mean_prob_diff",
        "frac_over_tau",
        "clip_frac",
        "ess",
        "top1_flip_rate",
        "token_mult_prob_error_frac_above_1_1",
    ),
    Metric("routing_flip_rate", 0.0, 1.0, limited=False),  # routing_flip findings judge it
    Metric("bitwise_equal_fraction", 0.0, 1.0, limited=False),
    # exp(|d|) >= 1 for every token, so its mean, median and trimmed mean are too
    Metric("token_mult_prob_error", 1.0),
    Metric("token_mult_prob_error_median", 1.0),
    Metric("token_mult_prob_error_trimmed_mean", 1.0),
    # KL over the renormalised top-k ids both sides returned (compare/topk.py)
    Metric("topk_kl_forward_mean"),
    Metric("topk_kl_reverse_mean"),
    # the configured IS correction, under verl's names (compare/correction.py)
    *_nonnegative(
        "rollout_corr/rollout_is_mean",
        "rollout_corr/rollout_is_std",
        "rollout_corr/rollout_is_min",
        "rollout_corr/rollout_is_max",
        "rollout_corr/k3_kl",
        "rollout_corr/log_ppl_abs_diff",
        "rollout_corr/ppl_ratio",
    ),
    Metric("rollout_corr/kl"),  # signed: KL(rollout || train) estimated on the sampled tokens
    Metric("rollout_corr/log_ppl_diff"),
    Metric("rollout_corr/chi2_token", -1.0),
    Metric("rollout_corr/chi2_seq", -1.0),
    *_fractions(
        "rollout_corr/rollout_is_eff_sample_size",
        "rollout_corr/rollout_is_ratio_fraction_high",
        "rollout_corr/rollout_is_ratio_fraction_low",
        "rollout_corr/rollout_rs_masked_fraction",
        "rollout_corr/rollout_rs_seq_masked_fraction",
        "training/rollout_probs_diff_mean",
        "training/rollout_probs_diff_max",
        "training/rollout_probs_diff_std",
        "lpx_corr/truncated_tokens_fraction",
        "lpx_corr/truncated_sequences_fraction",
        "lpx_corr/masked_tokens_fraction",
        "lpx_corr/masked_sequences_fraction",
    ),
)
BY_NAME = {metric.name: metric for metric in METRICS}
METRIC_NAMES = tuple(BY_NAME)
LIMITED_METRICS = tuple(metric.name for metric in METRICS if metric.limited)
# The rows of summary.md's table, in order; any other metric the policy limits follows them.
SUMMARY_METRICS = (
    "tokens",
    "max_abs_diff",
    "mean_abs_diff",
    "p99_abs_diff",
    "p999_abs_diff",
    "frac_over_tau",
    "k1",
    "k3",
    "is_ratio_mean",
    "ess",
    "clip_frac",
    "max_seq_mean_abs_diff",
    "topk_kl_forward_mean",
    "topk_kl_reverse_mean",
)
# Per recorded weight version (report.metrics.by_weight_version) and per pair of a matrix.
PER_VERSION_METRICS = ("tokens", "max_abs_diff", "mean_abs_diff", "p99_abs_diff", "k3")
MATRIX_METRICS = ("max_abs_diff", "mean_abs_diff", "p99_abs_diff", "k3", "top1_flip_rate")
# A pass stands on these two: compare measures both on every comparison.
VERDICT_METRICS = ("max_abs_diff", "mean_abs_diff")
