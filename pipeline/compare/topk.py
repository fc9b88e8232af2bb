"""KL between the rollout and the training side over the rollout's recorded top-k token ids.

The sampled token's logprob compares one point of each distribution. When the rollout
recorded its top-k alternatives (vLLM's ``logprobs=k``) and the replay scored those same ids,
both sides hold logprobs for the same k tokens at every position, so their distributions can
be compared beyond the sampled token. Each side is restricted to the k ids and renormalised,
p~(i) = p(i) / sum_j p(j) over the k ids, and per token

    forward KL(rollout || train) = sum_i p~_rollout(i) log(p~_rollout(i) / p~_train(i))
    reverse KL(train || rollout) = sum_i p~_train(i) log(p~_train(i) / p~_rollout(i))

with 0 log 0 = 0. This is the KL of the two distributions conditioned on the token being one
of the k ids, not the full-vocabulary KL; ``topk_mass_*`` (sum_i p(i) over the ids) says how
much of each distribution that condition keeps.
"""

from __future__ import annotations

import numpy as np

CHUNK = 1 << 20  # logprob values per streamed block, as in metrics.batch_metrics


def topk_kl(rollout: np.ndarray, train: np.ndarray) -> dict[str, float | int]:
    """Batch means and maxima of the forward and reverse KL over the same k ids per token.

    Parameters
    ----------
    rollout, train : [tokens, k] logprobs of the same token ids (column j is the same id on
        both sides), k >= 2. A NaN on either side makes the token's KLs NaN, so the means and
        maxima are NaN and fail any limit: an unknown alternative never passes silently.

    Returns
    -------
    ``topk_k``, ``topk_tokens``, ``topk_kl_forward_mean``, ``topk_kl_forward_max``,
    ``topk_kl_reverse_mean``, ``topk_kl_reverse_max``, ``topk_mass_rollout_mean``,
    ``topk_mass_train_mean``; an empty dict for no tokens.
    """
    tokens, k = rollout.shape
    if tokens == 0:
        return {}
    sums, maxima = np.zeros(4), []
    rows = max(1, CHUNK // k)
    for start in range(0, tokens, rows):
        log_rollout, mass_rollout = _renormalised(rollout[start : start + rows])
        log_train, mass_train = _renormalised(train[start : start + rows])
        forward = _kl(log_rollout, log_train)
        reverse = _kl(log_train, log_rollout)
        sums += (forward.sum(), reverse.sum(), mass_rollout.sum(), mass_train.sum())
        maxima.append((forward.max(), reverse.max()))
    forward_max, reverse_max = np.max(maxima, axis=0)  # NaN propagates
    forward_sum, reverse_sum, mass_rollout_sum, mass_train_sum = sums
    return {
        "topk_k": int(k),
        "topk_tokens": int(tokens),
        "topk_kl_forward_mean": float(forward_sum / tokens),
        "topk_kl_forward_max": float(forward_max),
        "topk_kl_reverse_mean": float(reverse_sum / tokens),
        "topk_kl_reverse_max": float(reverse_max),
        "topk_mass_rollout_mean": float(mass_rollout_sum / tokens),
        "topk_mass_train_mean": float(mass_train_sum / tokens),
    }


def _renormalised(logprobs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """log p~ over each row's k ids, and the mass sum_i p(i) the row's ids hold."""
    values = logprobs.astype(np.float64)
    with np.errstate(invalid="ignore"):  # a row of -inf (no mass at all) is NaN: it fails
        peak = values.max(axis=1, keepdims=True)
        log_mass = peak + np.log(np.exp(values - peak).sum(axis=1, keepdims=True))
        return values - log_mass, np.exp(log_mass[:, 0])


def _kl(log_p: np.ndarray, log_q: np.ndarray) -> np.ndarray:
    """Per-row sum_i p(i) (log p(i) - log q(i)), taking 0 log 0 = 0."""
    p = np.exp(log_p)
    with np.errstate(invalid="ignore"):
        terms = np.where(p > 0, p * (log_p - log_q), 0.0)
    terms[np.isnan(log_p) | np.isnan(log_q)] = np.nan
    return terms.sum(axis=1)
