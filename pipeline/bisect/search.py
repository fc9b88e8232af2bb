"""The search: the first bad build between a good one and a bad one, every verdict confirmed.

Pure: the caller hands in ``run(index, attempt)``, which runs the failing pair once on
build ``index`` and returns "good", "bad" or "error". Nothing here knows what a build is.

A probe runs a build ``runs`` times; its verdict holds only when every run agrees. A build
whose runs disagree is *flaky* and is skipped, never blamed (git bisect's `skip`). A run
that errs (an infrastructure failure, a build that does not build) is retried ``retries``
times; a build that keeps erring is skipped too: an error is never a "bad". Before the
answer is given, the last good and the first bad are each run ``reconfirm`` more times; one
that disagrees with itself then is flaky after all, and the search goes on without it.

A build that fails a fraction p of its runs at random is named the first bad only if it
fails all of its ``runs + reconfirm`` runs: p ** (runs + reconfirm), 0.24 % at p = 0.3
with the defaults (2 + 3). With no flaky build the search costs ``runs`` times
(2 + ceil(log2(n - 1))) runs for n builds, plus ``2 * reconfirm``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

GOOD, BAD, ERROR, FLAKY = "good", "bad", "error", "flaky"

RUNS = 2
RECONFIRM = 3
RETRIES = 1


@dataclass
class Judged:
    """One build's verdict and the runs behind it."""

    verdict: str  # good | bad | flaky | error
    runs: list[str] = field(default_factory=list)


@dataclass
class Answer:
    first_bad: int | None
    last_good: int | None
    # builds between them that could not be judged: the first bad may be any of these
    skipped: list[int]
    judged: dict[int, Judged]
    stopped: str | None = None  # why no answer: an end that is not what it was said to be
    order: list[int] = field(default_factory=list)  # builds in the order they were probed


def bisect(
    count: int,
    run: Callable[[int, int], str],
    runs: int = RUNS,
    reconfirm: int = RECONFIRM,
    retries: int = RETRIES,
) -> Answer:
    """Build 0 is said to be good and build ``count - 1`` bad; find where they part."""
    if count < 2:
        raise ValueError("a bisect needs a good and a bad build")
    judged: dict[int, Judged] = {}
    attempts: dict[int, int] = {}
    order: list[int] = []

    def probe(index: int, times: int) -> Judged:
        entry = judged.setdefault(index, Judged(""))
        if index not in order:
            order.append(index)
        for _ in range(times):
            outcome = _one_run(index, run, attempts, retries)
            entry.runs.append(outcome)
            if outcome == ERROR:
                entry.verdict = ERROR
                return entry
            if len(set(entry.runs)) > 1:
                entry.verdict = FLAKY
                return entry
        entry.verdict = entry.runs[0]
        return entry

    good_end, bad_end = probe(0, runs), probe(count - 1, runs)
    if good_end.verdict != GOOD or bad_end.verdict != BAD:
        return Answer(None, None, [], judged, _ends_said(good_end, bad_end, count), order)
    skipped: set[int] = set()
    reconfirmed: set[int] = set()
    low, high = 0, count - 1
    while True:
        while (middle := _middle(low, high, skipped)) is not None:
            verdict = probe(middle, runs).verdict
            if verdict == GOOD:
                low = middle
            elif verdict == BAD:
                high = middle
            else:
                skipped.add(middle)
        # the two builds the answer names, run again: a flaky one must not be named
        moved = False
        for index in (low, high):
            if index in reconfirmed or reconfirm == 0:
                continue
            reconfirmed.add(index)
            if probe(index, reconfirm).verdict == FLAKY:
                skipped.add(index)
                moved = True
        if not moved:
            break
        low = max((i for i in range(0, low + 1) if _holds(judged, i, GOOD)), default=None)
        high = min((i for i in range(high, count) if _holds(judged, i, BAD)), default=None)
        if low is None or high is None:
            return Answer(None, None, sorted(skipped), judged, "an end turned out flaky", order)
    between = sorted(i for i in skipped if low < i < high)
    return Answer(high, low, between, judged, None, order)


def run_count(answer: Answer) -> int:
    """Runs spent, retried errors included in what the caller counted separately."""
    return sum(len(j.runs) for j in answer.judged.values())


def _one_run(index: int, run: Callable[[int, int], str], attempts: dict, retries: int) -> str:
    """One run; an error is tried again up to ``retries`` times before it stands."""
    for _ in range(retries + 1):
        attempt = attempts.get(index, 0)
        attempts[index] = attempt + 1
        outcome = run(index, attempt)
        if outcome != ERROR:
            return outcome
    return ERROR


def _middle(low: int, high: int, skipped: set[int]) -> int | None:
    """The unjudged build nearest the middle of (low, high); None when none is left."""
    candidates = [i for i in range(low + 1, high) if i not in skipped]
    if not candidates:
        return None
    centre = (low + high) / 2
    return min(candidates, key=lambda i: (abs(i - centre), i))


def _holds(judged: dict[int, Judged], index: int, verdict: str) -> bool:
    return index in judged and judged[index].verdict == verdict


def _ends_said(good: Judged, bad: Judged, count: int) -> str:
    problems = []
    if good.verdict != GOOD:
        problems.append(f"the good build (0) is {good.verdict} ({', '.join(good.runs)})")
    if bad.verdict != BAD:
        problems.append(f"the bad build ({count - 1}) is {bad.verdict} ({', '.join(bad.runs)})")
    return "; ".join(problems)
