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
    precision noise (which moves every version alike) never makes a claim look wrong."""
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

    best_mean = np.full(n_groups, np.inf)
    best_name = np.full(n_groups, None, dtype=object)
    best_closer = np.zeros(n_groups)
    for name, values in version_channels.items():
        d = np.abs(values.astype(np.float64) - rollout.astype(np.float64))
        scored = np.isfinite(d)
        covers = np.bincount(group_of, scored, n_groups) == size
        mean = np.bincount(group_of, np.where(scored, d, 0.0), n_groups) / size
        closer = np.bincount(group_of, scored & (d < d_claimed), n_groups) / size
        group_claims = names[groups % len(names)]
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
    found: dict[tuple[str, str], list[int]] = {}
    for g in np.flatnonzero(wrong):
        found.setdefault((str(names[groups[g] % len(names)]), str(best_name[g])), []).append(g)
    misclaims = []
    for (claim, served), members in found.items():
        members = np.array(members)
        tokens = size[members]
        misclaims.append(
            Misclaim(
                claimed=claim,
                served=served,
                tokens=int(tokens.sum()),
                sequences=np.unique(groups[members] // len(names)),
                mean_abs_claimed=float((mean_claimed[members] * tokens).sum() / tokens.sum()),
                mean_abs_served=float((best_mean[members] * tokens).sum() / tokens.sum()),
            )
        )
    return sorted(misclaims, key=lambda m: -m.tokens)
