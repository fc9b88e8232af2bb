"""One hypothesis judged: (at most MAX_SEQUENCES of) a finding's sequences re-scored under
the bug, searched first where its family has free parameters. It verifies when the side it
reproduces then lies within VERIFY_MARGIN of the noise floor those tokens meet, and the bug
removed at least EXPLAINED of the drift. A data bug (written into the logprobs after the
forward) is judged without the model, on the tokens that drift beyond noise."""

from __future__ import annotations

import time

import numpy as np

from pipeline.compare.calibrated import side_precision
from pipeline.verify.families import family_of
from pipeline.verify.hypothesis import (
    DATA_DRIFT,
    EXPLAINED,
    FILL_EXACT,
    MAX_SEQUENCES,
    MIN_DRIFTING,
    VERIFY_MARGIN,
    Candidate,
    Outcome,
)
from pipeline.verify.search import mean_abs

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
    if candidate.kind == "precision":
        return family.judge(ref, candidate, rows, observed)
    if candidate.kind.startswith("data_"):
        judged = _judge_data(ref, family, candidate, *observed)
    else:
        judged = _judge_model(ref, family, candidate, rows, *observed)
    if judged is None:
        return None
    candidate, side, before, after, floor, explained = judged
    verified = explained and after <= VERIFY_MARGIN * floor
    return Outcome(candidate, side, before, after, floor, verified, time.perf_counter() - started)


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


def _judge_model(ref, family, candidate, rows, rollout, replay, positions):
    """The side the bug moved is the one farther from the clean reference; the family's
    search and the verdict are about reproducing that side."""
    before = mean_abs(rollout, replay)
    clean = ref.clean(rows)
    side = _moved_side(ref, rollout, replay, clean, positions)
    observed = rollout if side == "rollout" else replay
    meta = ref.fixture.metadata if side == "rollout" else ref.replay.metadata
    if candidate.params.get("computed_in") == side_precision(meta).removesuffix("+tf32"):
        return None  # that side declares this precision: the precision test's case
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
    computed = candidate.params.get("computed_in") or side_precision(meta)
    floors = np.concatenate(ref.token_floors((computed, "float32"), reproduced, positions))
    after = mean_abs(observed, reproduced)
    explained = _explains(ref, rollout, replay, observed, clean, reproduced, positions, floors)
    return candidate, side, before, after, float(np.mean(floors)), explained


def _moved_side(ref, rollout, replay, clean, positions) -> str:
    """The side farther from the clean reference, on the drifting tokens where there are
    MIN_DRIFTING of them: over a long completion a bug in its first tokens moves its side's
    mean less than the other side's noise moves the other's."""
    drifting = _drifting(ref, rollout, replay, positions)
    if drifting.sum() < MIN_DRIFTING:
        return "rollout" if mean_abs(rollout, clean) >= mean_abs(replay, clean) else "replay"
    reference = np.concatenate(clean)[drifting]
    ours = np.abs(np.concatenate(rollout)[drifting] - reference)
    theirs = np.abs(np.concatenate(replay)[drifting] - reference)
    keep = np.isfinite(ours) & np.isfinite(theirs)
    return "rollout" if ours[keep].mean() >= theirs[keep].mean() else "replay"


def _drifting(ref, rollout, replay, positions) -> np.ndarray:
    """Tokens whose |d| is past DATA_DRIFT times the floor of the two declared precisions."""
    pair = (side_precision(ref.fixture.metadata), side_precision(ref.replay.metadata))
    noise = np.concatenate(ref.token_floors(pair, replay, positions))
    drift = np.abs(np.concatenate(rollout) - np.concatenate(replay))
    return np.isfinite(drift) & (drift > DATA_DRIFT * noise)


def _explains(ref, rollout, replay, observed, clean, reproduced, positions, floors) -> bool:
    """Whether the bug moves the drift the way it drifts. Judged on the drifting tokens
    (|d| past DATA_DRIFT times their floor) where there are MIN_DRIFTING of them: over a
    long completion a bug that moves a few dozen tokens is diluted by the noise of the
    rest, while on its drifting tokens the evidence grows with their count, whatever the
    length. There the reproduction must move them (by EXPLAINED of their drift), leave at
    most EXPLAINED of it, and match the observed side to VERIFY_MARGIN times their floor;
    over every token it must leave no more drift than there was, and no token the observed
    side scored may be impossible under it (beyond IMPOSSIBLE of them).
    Without enough drifting tokens, over every token: the bug must move them by EXPLAINED
    of the drift."""
    a, b = np.concatenate(rollout), np.concatenate(replay)
    seen, bug, reference = (np.concatenate(x) for x in (observed, reproduced, clean))
    scored = np.isfinite(seen)
    if (np.isneginf(bug) & scored).sum() > IMPOSSIBLE * scored.sum():
        # the bug makes tokens impossible that this side scored (more than a truncation's
        # boundary moves under the other precision's noise): not this bug
        return False
    drift = np.abs(a - b)
    drifting = _drifting(ref, rollout, replay, positions)
    drifting &= np.isfinite(seen - bug) & np.isfinite(bug - reference)
    if drifting.sum() < MIN_DRIFTING:
        before = mean_abs(rollout, replay)
        moved = mean_abs(reproduced, clean)
        return moved >= EXPLAINED * before and mean_abs(observed, reproduced) <= EXPLAINED * before
    if mean_abs(observed, reproduced) > mean_abs(rollout, replay):
        return False  # over every token it leaves more drift than there was
    before = float(drift[drifting].mean())
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
