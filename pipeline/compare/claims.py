"""Claimed weight versions against the versions the logprobs actually match.

A fleet tags each token with the weight version it says it served. A multi-version replay
scores each sequence under the version it claims and under that version's neighbours in the
store; where the rollout's logprobs sit much closer to another version than to the claimed
one, the fleet served that other version (a stale hot-load, a lagging replica, a pointer
read too early). Pure numpy over the compared tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MIN_GROUP_TOKENS = 2  # tokens of one sequence claiming one version, before it can be judged
CLOSER_FRACTION = 0.75  # of those tokens, how many must sit closer to the other version
MEAN_RATIO = 0.5  # and the other version's mean |d| at most this fraction of the claimed one's
# A version that changed within a sequence, every token tagged alike: a split's sides
SPLIT_MIN_TOKENS = 8  # tokens each side of a split must hold
SPLIT_ALPHA = 1e-3  # a group's chance, under noise alone, of a split passing the sign tests


@dataclass
class Misclaim:
    """Tokens that claim ``claimed`` but match ``served`` best."""

    claimed: str
    served: str
    tokens: int
    sequences: np.ndarray  # sequence indices, ascending
    mean_abs_claimed: float
    mean_abs_served: float


def misclaimed_versions(
    claimed: np.ndarray,
    train: np.ndarray,
    rollout: np.ndarray,
    offsets: np.ndarray,
    version_channels: dict[str, np.ndarray],
) -> list[Misclaim]:
    """Misclaims, largest first. ``train``: each token scored under its claimed version;
    ``version_channels``: each token scored under other store versions (NaN: not scored).

    Judged per (sequence, claimed version) group, a paired test on its own tokens: the
    other version must be closer on most of them and on average by a wide margin, so
    precision noise (which moves every version alike) never makes a claim look wrong. Each
    group is also searched for a split (`_misclaimed_part`), which names the tokens where
    one is found: an engine that tags every token with the version its request started
    under (or ended under), while the weights changed mid-sequence, misclaims only the
    tokens after (or before) the change."""
    claimed = np.asarray([str(v) for v in claimed], dtype=object)
    if len(claimed) == 0 or not version_channels:
        return []
    seq = np.repeat(np.arange(len(offsets) - 1), np.diff(offsets))
    names, code = np.unique(claimed, return_inverse=True)
    groups, group_of = np.unique(seq * len(names) + code, return_inverse=True)
    n_groups = len(groups)
    size = np.bincount(group_of, minlength=n_groups)
    d_claimed = np.abs(train.astype(np.float64) - rollout.astype(np.float64))
    mean_claimed = np.bincount(group_of, d_claimed, n_groups) / size
    group_claims = names[groups % len(names)]

    best_mean = np.full(n_groups, np.inf)
    best_name = np.full(n_groups, None, dtype=object)
    best_closer = np.zeros(n_groups)
    distances = {}
    for name, values in version_channels.items():
        d = np.abs(values.astype(np.float64) - rollout.astype(np.float64))
        distances[name] = d
        scored = np.isfinite(d)
        covers = np.bincount(group_of, scored, n_groups) == size
        mean = np.bincount(group_of, np.where(scored, d, 0.0), n_groups) / size
        closer = np.bincount(group_of, scored & (d < d_claimed), n_groups) / size
        better = covers & (group_claims != name) & (mean < best_mean)
        best_mean[better], best_name[better], best_closer[better] = (
            mean[better],
            name,
            closer[better],
        )
    wrong = (
        (size >= MIN_GROUP_TOKENS)
        & (best_name != None)  # noqa: E711 - elementwise over an object array
        & (best_closer >= CLOSER_FRACTION)
        & (best_mean <= MEAN_RATIO * mean_claimed)
    )
    # per group found wrong: (group, claimed, served, tokens, sum |d| claimed, sum |d| served)
    parts: list[tuple[int, str, str, int, float, float]] = []
    order = np.argsort(group_of, kind="stable")  # each group's tokens, in sequence order
    starts = np.concatenate([[0], np.cumsum(size)])
    split = set()
    for g in np.flatnonzero(size >= 2 * SPLIT_MIN_TOKENS):
        tokens = order[starts[g] : starts[g + 1]]
        for name, d in distances.items():
            if name == group_claims[g] or not np.isfinite(d[tokens]).all():
                continue
            part = _misclaimed_part(d_claimed[tokens], d[tokens])
            if part is not None:
                claimed_sum, served_sum = d_claimed[tokens][part].sum(), d[tokens][part].sum()
                parts.append((int(g), str(group_claims[g]), name, int(part.stop - part.start),
                              float(claimed_sum), float(served_sum)))  # fmt: skip
                split.add(int(g))
                break
    parts += [
        (int(g), str(group_claims[g]), str(best_name[g]), int(size[g]),
         float(mean_claimed[g] * size[g]), float(best_mean[g] * size[g]))
        for g in np.flatnonzero(wrong) if int(g) not in split
    ]  # fmt: skip
    found: dict[tuple[str, str], list[tuple]] = {}
    for entry in parts:
        found.setdefault((entry[1], entry[2]), []).append(entry)
    misclaims = []
    for (claim, served), members in found.items():
        tokens = sum(m[3] for m in members)
        misclaims.append(
            Misclaim(
                claimed=claim,
                served=served,
                tokens=tokens,
                sequences=np.unique([groups[m[0]] // len(names) for m in members]),
                mean_abs_claimed=sum(m[4] for m in members) / tokens,
                mean_abs_served=sum(m[5] for m in members) / tokens,
            )
        )
    return sorted(misclaims, key=lambda m: -m.tokens)


def _misclaimed_part(d_claimed: np.ndarray, d_other: np.ndarray) -> slice | None:
    """The suffix (or prefix) of one group's tokens that matches the other version while the
    rest matches the claimed one, or None.

    Every split leaving SPLIT_MIN_TOKENS on each side is tried; at the best, each side must
    hold by a one-sided sign test (the version it matches is the closer one on more tokens
    than chance gives, p below SPLIT_ALPHA over the number of splits tried, Bonferroni) and
    the misclaimed side must pass the whole-group test too (CLOSER_FRACTION, MEAN_RATIO).
    Two versions that precision noise cannot tell apart are closer about half the time on
    either side, and no split passes."""
    from scipy.special import bdtrc

    n = len(d_claimed)
    closer = (d_other < d_claimed).astype(np.int64)
    cut = np.arange(SPLIT_MIN_TOKENS, n - SPLIT_MIN_TOKENS + 1)  # prefix lengths
    if len(cut) == 0:
        return None
    before = np.concatenate([[0], np.cumsum(closer)])[cut]  # other closer, in the prefix
    after = closer.sum() - before
    limit = SPLIT_ALPHA / len(cut)

    def tail(k, m):  # P(Bin(m, 1/2) >= k)
        return bdtrc(k - 1, m, 0.5)

    for misclaimed_after in (True, False):
        if misclaimed_after:  # tagged with the version the request started under
            p = np.maximum(tail(cut - before, cut), tail(after, n - cut))
        else:  # tagged with the version it ended under
            p = np.maximum(tail(before, cut), tail((n - cut) - after, n - cut))
        best = int(np.argmin(p))
        if p[best] > limit:
            continue
        part = slice(int(cut[best]), n) if misclaimed_after else slice(0, int(cut[best]))
        share = closer[part].mean()
        if share >= CLOSER_FRACTION and d_other[part].mean() <= MEAN_RATIO * d_claimed[part].mean():
            return part
    return None
