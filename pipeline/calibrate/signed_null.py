"""What noise alone gives the drift's sign structure, as `lpx calibrate` measures it
(compare/signed.py judges by it): tokens drawn at each calibrated position from the fp64
distribution at the rollout's temperature (calibrate/run.py `score_exactly`), scored by every
precision's prefills and decoding, and weighted to the distribution the rollout precision
would have sampled them from."""

from __future__ import annotations

import numpy as np

from pipeline.compare.signed import STATISTICS as SIGN_STATISTICS
from pipeline.compare.signed import seen_before, signed_statistics
from pipeline.fixture.table import TokenTable


def drawing_temperature(sampling: dict | None) -> float:
    """The temperature the rollout sampled its tokens at, which the sign statistics' null
    draws at: the fixture's, 1.0 where it does not say; 0 for greedy decoding (its tokens
    were chosen, not drawn: no sign statistics)."""
    value = (sampling or {}).get("temperature", 1.0)
    try:
        value = float(value)
    except (TypeError, ValueError):
        return 1.0
    return value if np.isfinite(value) and value > 0 else 0.0


def seen_drawn(fixture: TokenTable, row: int, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """[compared tokens, draws]: whether each drawn token (``ids``, at the compared positions
    ``mask`` marks) occurred earlier in its context."""
    every = np.zeros((len(mask), ids.shape[1]), dtype=np.int64)  # draws at every position
    every[mask] = ids
    return seen_before(fixture.prompt_of(row), fixture.completion_of(row), every)[mask]


def signed_null(
    scored: dict, a: str, b: str, positions, sequence_of, temperature: float, seen=None
) -> dict:
    """The sign statistics (compare/signed.py) of noise alone for the pair ``a``, ``b``, with
    each side as the rollout: the drawn tokens, as the rollout precision's scoring would have
    drawn them (importance weights (p_rollout / p_fp64) ** (1 / T): a rollout samples the
    tokens its own noise made likelier), scored by both sides. Across precisions the
    rollout's SDPA and eager prefills against the replay's SDPA one, and its SDPA against the
    replay's eager; in one precision eager against SDPA both ways. Clustered by sequence
    across the variants (they share the draws)."""
    exact = scored["float64", "exact@draws"].astype(np.float64)
    draws = exact.shape[1]
    where = np.repeat(np.asarray(positions, dtype=np.float64), draws)
    sequence = np.repeat(np.asarray(sequence_of), draws)
    flags = None if seen is None else np.asarray(seen).ravel()
    out = {"temperature": float(temperature), "draws": int(draws), "by_rollout": {}}
    for rollout, replay in {(a, b), (b, a)}:
        # the rollout decoded, as engines roll out, where it was decoded
        ways = [("decode", "prefill"), ("decode", "eager")]
        if rollout == replay:
            ways += [("eager", "prefill"), ("prefill", "eager")]
        else:
            ways += [("prefill", "prefill"), ("eager", "prefill"), ("prefill", "eager")]
        parts, each = [], []
        for mine, theirs in ways:
            sampled = scored[rollout, f"{mine}@draws"].astype(np.float64).ravel()
            other = scored[replay, f"{theirs}@draws"].astype(np.float64).ravel()
            weight = np.exp(np.clip((sampled - exact.ravel()) / temperature, -30, 30))
            weight[~np.isfinite(sampled)] = np.nan  # not decoded: left out
            parts.append((other - sampled, sampled, other, weight))
            each.append(
                signed_statistics(other - sampled, sampled, other, where, sequence, weight, flags)
            )
        d, sampled, other, weight = (np.concatenate(column) for column in zip(*parts, strict=True))
        pooled = signed_statistics(
            d,
            sampled,
            other,
            np.tile(where, len(ways)),
            np.tile(sequence, len(ways)),
            weight,
            None if flags is None else np.tile(flags, len(ways)),
        )
        # how far correct ways of computing the same numerics lean apart: an engine's kernels
        # are another way, so the null is known no better than this (compare/signed.py)
        for name in (*SIGN_STATISTICS, "mean_sq"):
            values = [statistics[name]["value"] for statistics in each if name in statistics]
            if name in pooled:
                pooled[name]["spread"] = float(np.std(values))
        out["by_rollout"][rollout] = pooled
    return out
