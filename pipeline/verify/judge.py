"""One hypothesis judged: (at most MAX_SEQUENCES of) a finding's sequences re-scored under
the bug, searched first where its family has free parameters. It verifies when the side it
reproduces then lies within VERIFY_MARGIN of the noise floor those tokens meet, and the bug
removed at least EXPLAINED of the drift. A data bug (written into the logprobs after the
forward) is judged without the model, on the tokens that drift beyond noise.

A model hypothesis is screened first on SCREEN_SEQUENCES of the sequences (the most drifting
and the median one): where it neither explains their drift nor comes within SCREEN_SLACK
times the margin of their floor, it is ruled out there, and the rest are not re-scored. What
passes it is judged on every sequence: first with the parameters the screen's search found
where the family's parameters are the same in every sequence (not a per-sequence pad count
or onset), and only where those do not verify there, searched again on every sequence; so a
true hypothesis costs one search, not two."""

from __future__ import annotations

import time

import numpy as np

from pipeline.compare.calibrated import side_precision
from pipeline.contracts.numerics import without_tf32
from pipeline.verify.families import family_of, is_data
from pipeline.verify.hypothesis import (
    DATA_DRIFT,
    EXPLAINED,
    FILL_EXACT,
    MAX_SEQUENCES,
    MIN_DRIFTING,
    SCREEN_SLACK,
    VERIFY_MARGIN,
    Candidate,
    Outcome,
)
from pipeline.verify.search import mean_abs
from pipeline.verify.sides import moved_side, screen_rows

IMPOSSIBLE = 0.02  # tokens a reproduction may rule out that the observed side scored


def judge(ref, candidate: Candidate, sequence_ids: list[str]) -> Outcome | None:
    """The side the candidate reproduces, the drift before and after, the floor they are
    judged by, and whether it verified; None where nothing can be re-scored."""
    started = time.perf_counter()
    rows = ref.comparable(spread(sequence_ids, MAX_SEQUENCES))
    if not rows:
        return None
    family = family_of(candidate.kind)
    observed = ref.observed(rows)
    if candidate.kind in family.own_judgement:
        return family.judge(ref, candidate, rows, observed)
    if is_data(candidate.kind):
        judged = _judge_data(ref, family, candidate, *observed)
    else:
        screen = screen_rows(rows, *observed) if family.screened else rows
        judged = None
        if len(screen) < len(rows):
            first = _judge_model(ref, family, candidate, screen, *ref.observed(screen))
            if first is not None and _far(first):
                return _outcome(first, started, screened_on=len(screen))
            if first is not None and not family.per_sequence:
                found = _judge_model(ref, family, first[0], rows, *observed, search=False)
                judged = found if found is not None and _verifies(found) else None
        if judged is None:
            judged = _judge_model(ref, family, candidate, rows, *observed)
    if judged is None:
        return None
    return _outcome(judged, started)


def _outcome(judged, started: float, screened_on: int = 0) -> Outcome:
    candidate, side, before, after, floor, explained = judged
    verified = explained and after <= VERIFY_MARGIN * floor and not screened_on
    seconds = time.perf_counter() - started
    return Outcome(candidate, side, before, after, floor, verified, seconds, screened_on)


def _verifies(judged) -> bool:
    *_, after, floor, explained = judged
    return bool(explained) and after <= VERIFY_MARGIN * floor


def _far(judged) -> bool:
    """Whether a screen's judgement is far from verifying: the bug explains none of the
    drift there and leaves more than SCREEN_SLACK times the margin of its floor."""
    *_, after, floor, explained = judged
    return not explained and after > SCREEN_SLACK * VERIFY_MARGIN * floor


def _judge_data(ref, family, candidate, rollout, replay, positions):
    """The rollout's logprobs moved by one token, one side filled with a constant or
    rounded: judged on the tokens that drift beyond DATA_DRIFT times their floor."""
    pair = (side_precision(ref.fixture.metadata), side_precision(ref.replay.metadata))
    token_floor = np.concatenate(ref.token_floors(pair, replay, positions))
    d = np.abs(np.concatenate(rollout) - np.concatenate(replay))
    drifting = d > DATA_DRIFT * token_floor
    side, reproduced, against, judged, exact = family.data(candidate, rollout, replay, drifting)
    if not judged.any():
        return None
    before = float(np.mean(d[judged]))
    if exact:
        # a constant written after the forward: no noise reaches it, so logprobs merely near
        # it (a confident model's near 0) are not it. The median: noise tokens before the
        # bug's onset drift too, and are not it.
        after = float(np.median(np.abs(against - reproduced)[judged]))
        return candidate, side, before, after, FILL_EXACT, after <= EXPLAINED * before
    after = float(np.mean(np.abs(against - reproduced)[judged]))
    floor = float(np.mean(token_floor[judged]))
    return candidate, side, before, after, floor, after <= EXPLAINED * before


def _judge_model(ref, family, candidate, rows, rollout, replay, positions, search=True):
    """The side the bug moved is the one farther from the clean reference; the family's
    search (unless ``search`` is False: the candidate's parameters are taken as they are)
    and the verdict are about reproducing that side."""
    before = mean_abs(rollout, replay)
    clean = ref.clean(rows)
    side = moved_side(ref, rollout, replay, clean, positions)
    observed = rollout if side == "rollout" else replay
    meta = ref.fixture.metadata if side == "rollout" else ref.replay.metadata
    if candidate.params.get("computed_in") == without_tf32(side_precision(meta)):
        return None  # that side declares this precision: the precision test's case
    computed = candidate.params.get("computed_in") or side_precision(meta)
    # a side that declares reduced-precision numerics is reproduced computing with them, and
    # judged against how far two implementations of them lie apart
    in_numerics = bool(ref.numerics.get(side)) and not candidate.params.get("computed_in")
    with ref.computing_as(side if in_numerics else None):
        if in_numerics:
            clean = ref.clean(rows, side)
        if search:
            candidate = family.search(ref, candidate, rows, observed, clean, side)
        reproduced = ref.rescore(candidate, rows)
    tokens = family.judged(ref, rows)
    if tokens is not None:  # the bug moves only these tokens: judged on them
        rollout, replay, observed, clean, reproduced, positions = (
            [a[m] for a, m in zip(values, tokens, strict=True)]
            for values in (rollout, replay, observed, clean, reproduced, positions)
        )
        before = mean_abs(rollout, replay)
    # the precision the reproduction computed in: the side's declared one, or the lower one
    # an undeclared-precision candidate tries; bucketed by the bug's own logprobs (a bug
    # that scores unlikely tokens meets the larger noise of unlikely tokens)
    pair = (computed, computed) if in_numerics else (computed, "float32")
    floors = np.concatenate(ref.token_floors(pair, reproduced, positions))
    after = mean_abs(observed, reproduced)
    explained = _explains(ref, rollout, replay, observed, clean, reproduced, positions, floors)
    return candidate, side, before, after, float(np.mean(floors)), explained


def _explains(ref, rollout, replay, observed, clean, reproduced, positions, floors) -> bool:
    """Whether the bug moves the drift the way it drifts. Judged on the tokens where the
    observed side lies past DATA_DRIFT times its own precision's floor from the clean
    reference, where there are MIN_DRIFTING of them (not where |d| is large: there the other
    side's noise is largest, and it is not the bug's to explain): over a
    long completion a bug that moves a few dozen tokens is diluted by the noise of the
    rest, while on its drifting tokens the evidence grows with their count, whatever the
    length. There the reproduction must move them (by EXPLAINED of their drift), leave at
    most EXPLAINED of it, and match the observed side to VERIFY_MARGIN times their floor;
    over every token it must leave no more drift than there was, and no token the observed
    side scored may be impossible under it (beyond IMPOSSIBLE of them).
    Without enough drifting tokens, over every token: the bug must move them by EXPLAINED
    of the drift."""
    seen, bug, reference = (np.concatenate(x) for x in (observed, reproduced, clean))
    scored = np.isfinite(seen)
    if (np.isneginf(bug) & scored).sum() > IMPOSSIBLE * scored.sum():
        # the bug makes tokens impossible that this side scored (more than a truncation's
        # boundary moves under the other precision's noise): not this bug
        return False
    away = np.abs(seen - reference)  # how far the observed side lies from the clean one
    drifting = np.isfinite(away) & np.isfinite(bug) & (away > DATA_DRIFT * floors)
    if drifting.sum() < MIN_DRIFTING:
        before = mean_abs(rollout, replay)
        moved = mean_abs(reproduced, clean)
        return moved >= EXPLAINED * before and mean_abs(observed, reproduced) <= EXPLAINED * before
    if mean_abs(observed, reproduced) > mean_abs(rollout, replay):
        return False  # over every token it leaves more drift than there was
    before = float(away[drifting].mean())
    left = float(np.abs(seen - bug)[drifting].mean())
    moved = float(np.abs(bug - reference)[drifting].mean())
    return (
        moved >= EXPLAINED * before
        and left <= EXPLAINED * before
        and left <= VERIFY_MARGIN * float(floors[drifting].mean())
    )


def spread(ids: list[str], most: int) -> list[str]:
    """At most ``most`` of the ids, evenly spread over them."""
    if len(ids) <= most:
        return list(ids)
    return [ids[int(i)] for i in np.linspace(0, len(ids) - 1, most).round()]
