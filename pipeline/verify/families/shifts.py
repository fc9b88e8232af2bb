"""Token shifts: the logprobs one side stores sit one token off (a data bug: the dump's
array shifted, tested without the model, from its change point), or the scorer read its
labels one off (logits[t] against token t: re-scored)."""

from __future__ import annotations

import numpy as np

from pipeline.contracts.causes import Cause
from pipeline.contracts.report import Finding
from pipeline.verify.hypothesis import Candidate, Family


class Shifts(Family):
    name = "shifts"
    causes = (Cause.TOKEN_SHIFT,)
    kinds = ("data_shift+1", "data_shift-1", "label_shift")
    data_kinds = ("data_shift+1", "data_shift-1")

    def hypotheses(self, ref, finding: Finding) -> list[Candidate]:
        shift = finding.details.get("shift")
        if shift in (1, -1):
            return [_data(ref, shift)]
        return [_labels(ref)]

    def alternatives(self, ref, finding: Finding) -> list[Candidate]:
        return [_data(ref, 1), _data(ref, -1), _labels(ref)]

    def data(self, candidate, rollout, replay, drifting):
        # replay[t] = rollout[t + shift]: the rollout's logprobs sit one token off; a
        # sequence's last (or first) token has no neighbour there, and its first drifting
        # token's neighbour lies across the onset, where nothing moved: both left out
        shift = candidate.params["shift"]
        moved, inside, start = [], [], 0
        for r in rollout:
            moved.append(np.roll(r, -shift))
            keep = np.ones(len(r), dtype=bool)
            if len(r):
                keep[-1 if shift > 0 else 0] = False
                first = np.flatnonzero(drifting[start : start + len(r)])
                if len(first):
                    keep[first[0]] = False
            inside.append(keep)
            start += len(r)
        judged = drifting & np.concatenate(inside)
        return "rollout", np.concatenate(moved), np.concatenate(replay), judged, False

    def finished(self, ref, finding: Finding, candidate: Candidate) -> Finding:
        return onset_of_shift(ref, finding, candidate)


def _data(ref, shift: int) -> Candidate:
    return Candidate(Cause.TOKEN_SHIFT, f"data_shift{shift:+d}", ref.base, {"shift": shift})


def _labels(ref) -> Candidate:
    return Candidate(Cause.TOKEN_SHIFT, "label_shift", ref.base, {})


def onset_of_shift(ref, finding: Finding, candidate: Candidate) -> Finding:
    """A verified logprob shift starts where the change point says, not at the first token
    past tau: under noise, a token whose neighbour scores alike drifts too little to cross
    it, so the first drifting token can come a few after the shift."""
    spot = finding.first_position
    sid = spot.get("sequence_id")
    if not candidate.kind.startswith("data_shift") or not ref.comparable([sid]):
        return finding
    (rollout,), (replay,), (positions,) = ref.observed(ref.comparable([sid]))
    onset = shift_onset(rollout, replay, candidate.params["shift"])
    if onset is None:
        return finding
    return finding.but(first_position={**spot, "position": int(positions[onset])})


def shift_onset(rollout: np.ndarray, replay: np.ndarray, shift: int) -> int | None:
    """The first index whose rollout logprob belongs to a neighbour (replay[t] =
    rollout[t + shift] from there on): the change point that minimises the total |d| of
    "equal" before it and "shifted" after it."""
    n = len(rollout)
    if n < 2:
        return None
    plain = np.nan_to_num(np.abs(rollout - replay))
    moved = np.abs(rollout - np.roll(replay, shift))  # rollout[t] against replay[t - shift]
    moved[0 if shift > 0 else n - 1] = np.nan  # wrapped around: no neighbour there
    moved = np.where(np.isfinite(moved), moved, plain)
    cost = np.cumsum(np.concatenate([[0.0], plain]))[:n] + np.cumsum(moved[::-1])[::-1]
    return int(np.argmin(cost))
