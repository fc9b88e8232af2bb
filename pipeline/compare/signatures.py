"""Per-sequence drift signatures, computed for every sequence at once.

The diagnosis reasons over these arrays (one value per sequence) rather than over Python
objects per sequence: each signature is a segment reduction over the flat token arrays
(``np.add.reduceat`` over the sequences' offsets, see ``segment_sum``), so a batch of a
million tokens costs a few array passes whatever its number of sequences.

d = train - rollout per active completion token; a token is "bad" when |d| > tau.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

FLOOR = 0.1  # |d| under this fraction of tau: the two sides computed the same thing


@dataclass
class Signatures:
    tokens: np.ndarray  # active completion tokens per sequence
    bad: np.ndarray  # tokens with |d| > tau
    first_bad: np.ndarray  # index of the first bad token within the sequence, -1 if none
    bad_after_onset: np.ndarray  # fraction of tokens from first_bad on that are bad
    mean_diff: np.ndarray
    mean_abs: np.ndarray
    rms: np.ndarray
    # (bad tokens up - bad tokens down) / sqrt(bad tokens): a sign test of the sequence's
    # direction, robust to the heavy-tailed d that would inflate a t statistic's error
    sign_z: np.ndarray
    train_lower: np.ndarray  # fraction of bad tokens where the train side is lower
    shift_fit: dict  # {+1, -1}: fraction of bad tokens where train[t] ~ rollout[t +/- 1]
    constant_fill: dict  # {"rollout", "train"}: fraction of bad tokens repeating a value
    early_late: np.ndarray  # mean |d| over the first half from onset / over the second half
    prefix_floor: np.ndarray  # fraction of the tokens before the onset at the floor (tau / 10)
    relative: np.ndarray  # mean |d| / mean |logprob|: how much of the logprob the drift is
    low_side_gap: np.ndarray  # median-free: mean over bad tokens of max - min side
    gap_slope: np.ndarray  # fit (rollout - train) = s * train + c over bad tokens
    gap_r2: np.ndarray
    bf16_exact: dict  # {"rollout", "train"}: fraction of bad tokens exactly bf16
    fp16_exact: dict

    def __len__(self) -> int:
        return len(self.tokens)


def signatures(
    train: np.ndarray, rollout: np.ndarray, offsets: np.ndarray, tau, floor: float = FLOOR
):
    """Every signature for every sequence; ``offsets`` delimit the sequences' tokens. A
    token is at the floor when |d| <= ``floor`` x tau (with a calibrated per-token tau,
    which is itself a multiple of the measured noise, a larger fraction)."""
    n_seq = len(offsets) - 1
    lengths = np.diff(offsets)
    seq = np.repeat(np.arange(n_seq), lengths)
    local = np.arange(len(train)) - np.repeat(offsets[:-1], lengths)
    t64, r64 = train.astype(np.float64), rollout.astype(np.float64)
    d = t64 - r64
    a = np.abs(d)
    bad = a > tau
    # -inf on both sides makes d NaN; multiplying by a 0/1 mask would keep that NaN.
    finite = bool(np.isfinite(d).all())

    def total(values, where=None):
        if where is not None:
            values = values * where if finite else np.where(where, values, 0.0)
        return segment_sum(values, offsets)

    count = lengths.astype(np.float64)
    n_bad = total(bad)
    safe_count, safe_bad = np.maximum(count, 1), np.maximum(n_bad, 1)
    # the first bad token's index in each sequence: a segment minimum, lengths when none
    onset = np.minimum(segment_min(np.where(bad, local, len(train)), offsets), lengths)
    first_bad = np.where(onset < lengths, onset, -1)
    after = local >= onset[seq]
    tokens_after = np.maximum(total(after), 1)

    mean_d = total(d) / safe_count
    mean_abs = total(a) / safe_count
    mean_sq = total(d * d) / safe_count

    # The two halves of each sequence's stretch from its onset on.
    half = onset + (lengths - onset) // 2
    early = after & (local < half[seq])
    late = local >= half[seq]
    with np.errstate(divide="ignore", invalid="ignore"):
        early_mean = total(a, early) / np.maximum(total(early), 1)
        late_mean = total(a, late) / np.maximum(total(late), 1)
        early_late = np.where(late_mean > 0, early_mean / late_mean, np.inf)

    before = ~after
    n_before = total(before)
    at_floor = total(before & (a <= tau * floor))
    prefix_floor = np.where(n_before > 0, at_floor / np.maximum(n_before, 1), 1.0)
    scale = total(np.abs(r64)) / safe_count

    # Least squares of the gap g = rollout - train on x = train, over bad tokens.
    g = -d
    sx, sg = total(t64, bad), total(g, bad)
    sxx, sgg, sxg = total(t64 * t64, bad), total(g * g, bad), total(t64 * g, bad)
    cov = sxg - sx * sg / safe_bad
    var_x, var_g = sxx - sx * sx / safe_bad, sgg - sg * sg / safe_bad
    with np.errstate(divide="ignore", invalid="ignore"):
        slope = np.where(var_x > 0, cov / var_x, 0.0)
        r2 = np.where((var_x > 0) & (var_g > 0), cov * cov / (var_x * var_g), 0.0)

    return Signatures(
        tokens=lengths,
        bad=n_bad.astype(np.int64),
        first_bad=first_bad,
        bad_after_onset=n_bad / tokens_after,
        mean_diff=mean_d,
        mean_abs=mean_abs,
        rms=np.sqrt(mean_sq),
        train_lower=total(bad & (d < 0)) / safe_bad,
        sign_z=(n_bad - 2 * total(bad & (d < 0))) / np.sqrt(safe_bad),
        shift_fit={s: _shift_fit(t64, r64, seq, bad, tau, s, total) / safe_bad for s in (1, -1)},
        constant_fill={
            "rollout": _repeats(r64, seq, bad, total) / safe_bad,
            "train": _repeats(t64, seq, bad, total) / safe_bad,
        },
        early_late=early_late,
        prefix_floor=prefix_floor,
        relative=np.where(scale > 0, mean_abs / np.maximum(scale, 1e-12), 0.0),
        low_side_gap=total(a, bad) / safe_bad,
        gap_slope=slope,
        gap_r2=r2,
        bf16_exact={
            "rollout": total(bad & _bf16_exact(rollout)) / safe_bad,
            "train": total(bad & _bf16_exact(train)) / safe_bad,
        },
        fp16_exact={
            "rollout": total(bad & _fp16_exact(rollout)) / safe_bad,
            "train": total(bad & _fp16_exact(train)) / safe_bad,
        },
    )


def segment_sum(values: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Sum of ``values`` within each sequence (0 for a sequence with no tokens), as float64.

    ``np.add.reduceat`` is ~15x faster than ``np.bincount`` with weights; it needs the start
    of every non-empty segment only, since an empty one would read its neighbour's first value.
    """
    lengths = np.diff(offsets)
    out = np.zeros(len(lengths), dtype=np.float64)
    nonempty = lengths > 0
    if nonempty.any():
        out[nonempty] = np.add.reduceat(values, offsets[:-1][nonempty], dtype=np.float64)
    return out


def segment_min(values: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Minimum of integer ``values`` within each sequence (int64 max for an empty one)."""
    lengths = np.diff(offsets)
    out = np.full(len(lengths), np.iinfo(np.int64).max, dtype=np.int64)
    nonempty = lengths > 0
    if nonempty.any():
        out[nonempty] = np.minimum.reduceat(values, offsets[:-1][nonempty])
    return out


def _shift_fit(train, rollout, seq, bad, tau, shift, total):
    """Bad tokens t where train[t] matches rollout[t + shift] of the same sequence."""
    index = np.arange(len(train)) + shift
    inside = (index >= 0) & (index < len(train))
    index = np.clip(index, 0, len(train) - 1)
    same = inside & (seq[index] == seq)
    fits = bad & same & (np.abs(train - rollout[index]) <= tau)
    return total(fits)


def _repeats(values, seq, bad, total):
    """Bad tokens whose value equals the previous bad token's of the same sequence: a fill."""
    index = np.flatnonzero(bad)
    repeated = np.zeros(len(values), dtype=np.float64)
    if len(index) > 1:
        same = (seq[index[1:]] == seq[index[:-1]]) & (values[index[1:]] == values[index[:-1]])
        repeated[index[1:][same]] = 1.0
        # the first of a run counts too, so a sequence filled throughout scores 1
        repeated[index[:-1][same]] = 1.0
    return total(repeated)


def _bf16_exact(values: np.ndarray) -> np.ndarray:
    """Exactly a bf16 value (0.0, which every format holds, does not count)."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    return ((bits & 0xFFFF) == 0) & (values != 0)


def _fp16_exact(values: np.ndarray) -> np.ndarray:
    values = np.asarray(values, dtype=np.float32)
    with np.errstate(over="ignore"):
        return (values.astype(np.float16).astype(np.float32) == values) & (values != 0)
