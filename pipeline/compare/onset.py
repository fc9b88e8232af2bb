"""Drift that starts at a position many sequences share: a change point over absolute
positions (prompt + completion, 0-based), found across sequences.

Real mismatches start at a position, not at a token: a sliding window's edge, a RoPE
scaling threshold, a kernel's tile (an FP8 KV cache whose prefill and decode kernels tile it
differently parted from position ~96 in 2026), a chunked-prefill chunk's edge. Each sequence
that reaches such a position is clean before it and drifts after it, whatever its prompt's
length. A clean long completion, whose bf16 drift grows smoothly with position, has no such
step: its drift just before a position is what it is just after.

A token's position here is that of the query that scored it (the token before it): the
position a window's size, a tile or a chunk counts.

The test, per candidate position p and per sequence holding at least MIN_SIDE compared
tokens either side of p, on its |d| in units of its noise floor (capped at CAP):
- before p the sequence is quiet (mean at most QUIET floors);
- after p it drifts at least STEP times as much as before (before counted as >= 1 floor);
- and the step is at p: the LOCAL tokens after p drift STEP times the LOCAL before it (a
  slope passes the first two, never this one).
The onset is the p where most sequences step (at least MIN_SEQUENCES, and SHARE of those
that span p), the sharpest of those (largest pooled local contrast). Pure."""

from __future__ import annotations

import numpy as np

STEP = 4.0
QUIET = 2.0
CAP = 50.0  # floors: one wild token does not make a sequence's level
MIN_SIDE = 8  # tokens: a quiet stretch, not the first few tokens of a completion
LOCAL = 16
MIN_SEQUENCES = 3
SHARE = 0.6
NEAR_BEST = 0.9  # positions stepping in this fraction of the best count compete on sharpness
MAX_SEQUENCES = 2048  # spread evenly: the onset of a batch is seen in any few thousand
SAMPLE = 20  # sequence ids kept in the report


def position_onset(
    absolute_positions: np.ndarray,
    abs_diff: np.ndarray,
    offsets: np.ndarray,
    noise: np.ndarray | float,
    sequence_ids: list[str],
) -> dict | None:
    """The shared onset of drift, or None: {"position", "sequences" (how many step there),
    "spanning" (how many could), "sequence_ids" (a sample), "level_before", "level_after"
    (medians of the stepping sequences' mean |d| in noise floors), "mean_abs_before",
    "mean_abs_after" (their median mean |d|), "jump" (level_after / level_before)}."""
    n = len(offsets) - 1
    if n < MIN_SEQUENCES or len(abs_diff) == 0:
        return None
    chosen = np.unique(np.linspace(0, n - 1, min(n, MAX_SEQUENCES)).round().astype(int))
    starts, ends = offsets[chosen], offsets[chosen + 1]
    take = np.concatenate([np.arange(a, b) for a, b in zip(starts, ends, strict=True)])
    lengths = ends - starts
    seq = np.repeat(np.arange(len(chosen)), lengths)
    pos = np.asarray(absolute_positions, dtype=np.int64)[take]
    raw = np.asarray(abs_diff, dtype=np.float64)[take]
    floor = np.broadcast_to(np.asarray(noise, dtype=np.float64), np.shape(abs_diff))[take]
    z = np.minimum(raw / np.maximum(floor, 1e-12), CAP)
    big = int(pos.max()) + 2 * LOCAL + 2
    keys = seq * big + pos  # sorted: sequences in order, positions rising within each
    order = np.argsort(keys, kind="stable")
    keys, z, raw = keys[order], z[order], raw[order]
    cz = np.concatenate([[0.0], np.cumsum(z)])
    craw = np.concatenate([[0.0], np.cumsum(raw)])
    first = np.concatenate([[0], np.cumsum(lengths)])
    lo, hi = first[:-1], first[1:]
    base = np.arange(len(chosen)) * big
    best = None
    candidates = np.unique(pos)
    for p in candidates[(candidates > pos.min())]:
        at = np.searchsorted(keys, base + p)
        before_n, after_n = at - lo, hi - at
        spanning = (before_n >= MIN_SIDE) & (after_n >= MIN_SIDE)
        if spanning.sum() < MIN_SEQUENCES:
            continue
        before = (cz[at] - cz[lo]) / np.maximum(before_n, 1)
        after = (cz[hi] - cz[at]) / np.maximum(after_n, 1)
        near_lo = np.searchsorted(keys, base + p - LOCAL)
        near_hi = np.searchsorted(keys, base + p + LOCAL)
        local_before = (cz[at] - cz[near_lo]) / np.maximum(at - near_lo, 1)
        local_after = (cz[near_hi] - cz[at]) / np.maximum(near_hi - at, 1)
        steps = (
            spanning
            & (before <= QUIET)
            & (after >= STEP * np.maximum(before, 1.0))
            & (local_after >= STEP * np.maximum(local_before, 1.0))
        )
        count = int(steps.sum())
        if count < MIN_SEQUENCES or count < SHARE * spanning.sum():
            continue
        sharpness = float(np.mean((local_after - local_before)[steps]))
        row = (count, sharpness, int(p), steps, spanning, before, after, at)
        if best is None or count > best[0] / NEAR_BEST:
            best = row
        elif count >= NEAR_BEST * best[0] and sharpness > best[1]:
            best = row
    if best is None:
        return None
    count, _, p, steps, spanning, before, after, at = best
    p = _sharpest(keys, z, base, steps, p)
    raw_before = (craw[at] - craw[lo]) / np.maximum(at - lo, 1)
    raw_after = (craw[hi] - craw[at]) / np.maximum(hi - at, 1)
    level_before = float(np.median(before[steps]))
    level_after = float(np.median(after[steps]))
    return {
        "position": p,
        "measured_in": "the position that computes the logprob (0-based, prompt and "
        "completion together: the scored token's position - 1)",
        "sequences": count,
        "spanning": int(spanning.sum()),
        "sequence_ids": [sequence_ids[chosen[i]] for i in np.flatnonzero(steps)[:SAMPLE]],
        "level_before": round(level_before, 3),
        "level_after": round(level_after, 3),
        "mean_abs_before": float(np.median(raw_before[steps])),
        "mean_abs_after": float(np.median(raw_after[steps])),
        "jump": round(level_after / max(level_before, 1e-12), 2),
    }


def _sharpest(keys, z, base, steps, p: int) -> int:
    """The onset to the token: the step test places it within a few tokens (the first tokens
    past an edge may drift little, and bf16's noise has spikes), so the split of the stepping
    sequences' tokens near p that best separates two levels of log(1 + z) is taken (the
    change-point statistic n_b n_a / n (mean_a - mean_b)^2, summed over sequences)."""
    best, best_stat = p, -1.0
    spans = []
    for i in np.flatnonzero(steps):
        lo = np.searchsorted(keys, base[i] + p - 2 * LOCAL)
        hi = np.searchsorted(keys, base[i] + p + 2 * LOCAL)
        spans.append((keys[lo:hi] - base[i], np.log1p(z[lo:hi])))
    for q in range(p - LOCAL, p + LOCAL + 1):
        stat = 0.0
        for where, values in spans:
            after = (where >= q) & (where < q + LOCAL)
            before = (where < q) & (where >= q - LOCAL)
            n_a, n_b = after.sum(), before.sum()
            if n_a and n_b:
                gap = values[after].mean() - values[before].mean()
                stat += n_a * n_b / (n_a + n_b) * gap * abs(gap)
        if stat > best_stat:
            best, best_stat = q, stat
    return int(best)


def drift_start(positions: np.ndarray, z: np.ndarray) -> int | None:
    """Where one sequence's drift rises: the position that best splits its tokens into a
    lower level of log(1 + z) before and a higher one after (the change-point statistic
    n_b n_a / n (mean_a - mean_b)^2 of `_sharpest`, over every split), or None where it
    holds under 2 MIN_SIDE tokens or nothing after is higher. Unlike `position_onset` it
    asks for no step: a window's edge drops one key at a time, so under bf16 noise its drift
    ramps up over the next tokens rather than stepping, and the batch may show no onset.
    ``z``: |d| in noise floors, capped at CAP."""
    order = np.argsort(positions, kind="stable")
    where = np.asarray(positions, dtype=np.int64)[order]
    values = np.log1p(np.minimum(np.asarray(z, dtype=np.float64)[order], CAP))
    n = len(values)
    if n < 2 * MIN_SIDE:
        return None
    sums = np.cumsum(values)
    split = np.arange(MIN_SIDE, n - MIN_SIDE + 1)  # tokens before the split
    before = sums[split - 1] / split
    after = (sums[-1] - sums[split - 1]) / (n - split)
    rise = after - before
    stat = split * (n - split) / n * rise * np.abs(rise)
    best = int(np.argmax(stat))
    return int(where[split[best]]) if rise[best] > 0 else None


def onset_of_comparison(fixture, aligned, noise) -> dict | None:
    """The onset of a comparison's completion tokens: each logprob at the position of the
    query that computed it (the token before it: prompt length + completion index - 1)."""
    region = aligned.completion
    rows = fixture.index_of()
    prompt_lengths = np.diff(fixture.prompt_offsets)
    starts = np.asarray([prompt_lengths[rows[s]] for s in aligned.sequence_ids], dtype=np.int64)
    absolute = region.positions.astype(np.int64) + np.repeat(starts, np.diff(region.offsets)) - 1
    diff = np.abs(region.train.astype(np.float64) - region.rollout.astype(np.float64))
    return position_onset(absolute, diff, region.offsets, noise, aligned.sequence_ids)


def onset_words(onset: dict) -> str:
    """One sentence for compare's summary and the run page."""
    return (
        f"drift starts at position {onset['position']} (the logprobs computed there on) in {onset['sequences']} of the "
        f"{onset['spanning']} sequences that reach it: clean before it (median mean |d| "
        f"{onset['mean_abs_before']:.3g}, {onset['level_before']:.2f} noise floors), "
        f"{onset['jump']:.3g}x after it ({onset['mean_abs_after']:.3g}); a position every "
        "sequence shares (a window's edge, a kernel's tile, a chunk's edge, a RoPE table's "
        "length), not a token"
    )


def with_onset(findings: list, onset: dict | None) -> list:
    """The findings with drift carrying the batch's onset (``details.position_onset``), for
    the families whose hypotheses have a position to fit around it (a precision finding
    that fails verification is tested against every family too)."""
    if onset is None:
        return findings
    return [
        f.but(details={**f.details, "position_onset": onset["position"]}) if f.sequences else f
        for f in findings
    ]
