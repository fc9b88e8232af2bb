"""verify/alike.py: which of several reproductions that verify one finding explains it. The
real case (a min-p 0.1 committed by transformers' sampler, found alike by a searched top-p) is
tests/verify/test_logits_processing.py's min_p case; these pin the rule's edges."""

from __future__ import annotations

from pipeline.verify.alike import ALIKE, choose, same_bug
from pipeline.verify.hypothesis import Candidate, Outcome


def candidate(kind: str, **params) -> Candidate:
    return Candidate(kind, kind, None, params)  # each kind here is its cause's name too


def outcome(kind: str, after: float, floor: float = 1e-3, **params) -> Outcome:
    return Outcome(candidate(kind, **params), "rollout", 0.1, after, floor, True, 0.0)


MIN_P = ("logits_processing", {"min_p": 0.1, "searched": True, "what": "a min-p"})
TOP_P = ("top_p", {"p": 0.867, "searched": True})


def test_the_measurably_closer_reproduction_is_chosen_alone():
    closer = outcome(TOP_P[0], 1e-7, **TOP_P[1])
    farther = outcome(MIN_P[0], 1e-7 + 2 * ALIKE * 1e-3, **MIN_P[1])
    assert choose([farther, closer], []) == [closer]


def test_among_alike_fits_the_one_that_reproduces_another_finding_is_chosen():
    top_p = outcome(TOP_P[0], 3.5e-7, **TOP_P[1])
    min_p = outcome(MIN_P[0], 4.0e-7, **MIN_P[1])  # a hair farther, within ALIKE of the floor
    elsewhere = [[candidate("logits_processing", min_p=0.1, searched=True, what="other words")]]
    assert choose([top_p, min_p], elsewhere) == [min_p]


def test_alike_fits_that_nothing_else_tells_apart_are_both_named():
    top_p = outcome(TOP_P[0], 3.5e-7, **TOP_P[1])
    min_p = outcome(MIN_P[0], 4.0e-7, **MIN_P[1])
    assert choose([min_p, top_p], []) == [top_p, min_p]  # closest first
    # the same bug found twice (numbers within SAME_VALUE) is named once
    again = outcome(MIN_P[0], 3.9e-7, min_p=0.1003, searched=True, what="a min-p")
    assert choose([min_p, again], []) == [again]


def test_same_bug_compares_the_bug_s_numbers_not_how_a_search_said_them():
    a = candidate("logits_processing", min_p=0.1, searched=True, what="x")
    assert same_bug(a, candidate("logits_processing", min_p=0.104, what="y"))
    assert not same_bug(a, candidate("logits_processing", min_p=0.2))
    assert not same_bug(a, candidate("logits_processing", min_p=0.1, top_k=20))
    assert not same_bug(a, candidate("top_p", min_p=0.1))
