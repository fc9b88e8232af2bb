"""The workload of a series point against the series' previous night: did the two nights
compare the same tokens, and where they did not, what the shared tokens say.

A metric that moves when an engine is upgraded moves for two reasons at once: the engine's
numerics, and the tokens it sampled (under one seed two releases sample differently after a
few tokens). The tokens both nights hold, position for position from the start of each
completion (a shared prefix: the same context, so the same logprob under the same
numerics), separate them: their metrics last night and tonight show the numerics alone;
the rest shows what the new tokens add.

Pure functions over tokens.parquet columns (`read_tokens`); record.py reads the two files
only when the nights' token digests differ (compare/run.py workload_of).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pipeline.compare.metrics import batch_metrics
from pipeline.history import details

# Fewer shared tokens than this tell nothing about the numerics (a p99 of 64 values is the
# second largest; a mean of 64 bf16 |d| is within ~15 % of its expectation).
MIN_SHARED_TOKENS = 64
# The metrics the shared tokens are measured on: those of batch_metrics the history judges.
SPLIT_METRICS = (
    "max_abs_diff", "mean_abs_diff", "rms_diff", "p50_abs_diff", "p99_abs_diff",
    "p999_abs_diff", "mean_diff", "k1", "k2", "k3", "chi2_token", "is_ratio_mean", "ess",
    "max_prob_diff", "mean_prob_diff", "token_mult_prob_error", "frac_over_tau", "clip_frac",
)  # fmt: skip


def read_tokens(path: Path | None) -> dict[str, tuple] | None:
    """Each sequence's completion (token ids, rollout logprobs, train logprobs) by position
    from a tokens.parquet, or None when it is missing or unreadable."""
    if path is None or not Path(path).is_file():
        return None
    table = details.read_tokens(path, extra=("logprob_rollout", "logprob_train"))
    if table is None:
        return None
    keep = table["completion"]
    sequence, position = table["sequence"][keep], table["position"][keep]
    columns = [table[c][keep] for c in ("token_id", "logprob_rollout", "logprob_train")]
    order = np.lexsort((position, sequence))
    sequence, columns = sequence[order], [c[order] for c in columns]
    starts = np.flatnonzero(np.r_[True, sequence[1:] != sequence[:-1]]) if len(sequence) else []
    ends = [*starts[1:], len(sequence)]
    return {
        str(table["names"][sequence[a]]): tuple(c[a:b] for c in columns)
        for a, b in zip(starts, ends, strict=True)
    }


def agreement(previous: dict[str, tuple], current: dict[str, tuple], tau: float) -> dict:
    """How far tonight's tokens are last night's, and the metrics of both nights on the
    tokens they share and of tonight's other tokens."""
    shared_prefix, divergences = {}, []
    for name, (ids, *_rest) in current.items():
        if name not in previous:
            shared_prefix[name] = 0
            continue
        old = previous[name][0]
        n = min(len(ids), len(old))
        differ = np.flatnonzero(ids[:n] != old[:n])
        shared_prefix[name] = int(differ[0]) if len(differ) else n
        if len(differ) or len(ids) != len(old):
            divergences.append((shared_prefix[name], name))
    tokens = sum(len(c[0]) for c in current.values())
    in_common = sum(shared_prefix.values())
    first = min(divergences) if divergences else None
    result = {
        "same_tokens": not divergences and set(previous) == set(current),
        "sequences": len(current),
        "sequences_in_both": sum(1 for name in current if name in previous),
        "sequences_identical": len(current) - len(divergences)
        - sum(1 for name in current if name not in previous),
        "tokens": tokens,
        "tokens_in_common": in_common,
        "fraction_in_common": in_common / tokens if tokens else 1.0,
        "mean_shared_prefix": in_common / len(current) if current else 0.0,
        "first_divergence": None if first is None
        else {"sequence_id": first[1], "position": first[0]},
        "median_divergence": float(np.median([d for d, _ in divergences])) if divergences
        else None,
    }  # fmt: skip
    if in_common >= MIN_SHARED_TOKENS and not result["same_tokens"]:
        result["shared"] = {
            "previous": _metrics(previous, shared_prefix, tau, shared=True),
            "current": _metrics(current, shared_prefix, tau, shared=True),
        }
        if in_common < tokens:
            result["new_tokens"] = _metrics(current, shared_prefix, tau, shared=False)
    return result


def _metrics(tokens: dict[str, tuple], prefix: dict[str, int], tau: float, shared: bool) -> dict:
    rollout, train = [], []
    for name, (_ids, lp_rollout, lp_train) in tokens.items():
        cut = prefix.get(name, 0)
        part = slice(0, cut) if shared else slice(cut, None)
        rollout.append(lp_rollout[part])
        train.append(lp_train[part])
    measured = batch_metrics(np.concatenate(train), np.concatenate(rollout), tau)
    return {name: measured[name] for name in SPLIT_METRICS if name in measured} | {
        "tokens": measured["tokens"]
    }


def same_token_values(workload: dict | None) -> dict[str, tuple[float, float]]:
    """{metric: (last night, tonight)} on the shared tokens, for detection; empty when the
    nights compared the same tokens or shared too few to tell."""
    shared = ((workload or {}).get("agreement") or {}).get("shared")
    if not shared:
        return {}
    before, after = shared["previous"], shared["current"]
    return {
        name: (before[name], after[name])
        for name in SPLIT_METRICS
        if isinstance(before.get(name), float) and isinstance(after.get(name), float)
    }
