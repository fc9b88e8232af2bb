"""Reproductions that fit a finding alike: which one explains it. Two bugs can reproduce the
same tokens equally well (a min-p 0.1 and a searched top-p 0.87 keep the same tokens where
most of them keep one, and both then match to float32 rounding), so the closer residual is
no evidence between them. The rule: the one measurably closer on the finding's own tokens;
among those as close, the one that also reproduces more of the batch's other findings (one
bug for the batch, not two); where that still leaves different bugs, they are named
together and neither is claimed."""

from __future__ import annotations

from pipeline.verify.families import family_of
from pipeline.verify.hypothesis import Candidate, Outcome

# Two reproductions whose mean |d| to the observed side differ by less than this share of
# the floor fit alike: the floor is what noise alone gives those tokens, and a tenth of it
# is where processing_fit stops telling fits apart (NOISE_SHARE). One token in n missed by
# m floors (a top-p cutting where a min-p kept) adds m / n floors to the mean: a miss of 30
# floors stands out among up to 300 tokens, a smaller one among fewer.
ALIKE = 0.1
SAME_VALUE = 0.05  # relative: two fits of one bug's number on different tokens agree this well
NOT_SHAPE = ("searched", "what")  # how a search describes what it found, not the bug


def choose(outcomes: list[Outcome], elsewhere: list[list[Candidate]]) -> list[Outcome]:
    """Of one finding's verified ``outcomes``, the explanation: the first of the list, alone,
    where one is; several where different bugs fit alike and reproduce as many other
    findings (``elsewhere``: per other finding, the candidates verified there)."""
    best = min(outcomes, key=lambda o: o.after / max(o.floor, 1e-12))
    close = [o for o in outcomes if o.after <= best.after + ALIKE * best.floor]
    close.sort(key=lambda o: o.after / max(o.floor, 1e-12))

    def reproduces(outcome: Outcome) -> int:
        return sum(any(same_bug(outcome.candidate, c) for c in other) for other in elsewhere)

    most = max(reproduces(o) for o in close)
    chosen: list[Outcome] = []
    for outcome in (o for o in close if reproduces(o) == most):
        if not any(same_bug(outcome.candidate, c.candidate) for c in chosen):
            chosen.append(outcome)
    return chosen


def same_bug(a: Candidate, b: Candidate) -> bool:
    """Whether two reproductions commit one bug: the same kind, the same parameters (numbers
    within SAME_VALUE), leaving out what a search finds per sequence and how it says it."""
    if a.kind != b.kind:
        return False
    skipped = (*NOT_SHAPE, *family_of(a.kind).per_sequence)
    ours = {k: v for k, v in a.params.items() if k not in skipped}
    theirs = {k: v for k, v in b.params.items() if k not in skipped}
    if set(ours) != set(theirs):
        return False
    return all(_same_value(ours[k], theirs[k]) for k in ours)


def _same_value(x, y) -> bool:
    if isinstance(x, bool) or isinstance(y, bool):
        return x == y
    if isinstance(x, int | float) and isinstance(y, int | float):
        return abs(float(x) - float(y)) <= SAME_VALUE * max(abs(float(x)), abs(float(y)), 1e-3)
    return repr(x) == repr(y)
