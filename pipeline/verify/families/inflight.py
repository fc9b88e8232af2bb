"""In-flight updates: the weights changed while sequences were being generated, so each
sequence was scored by the old weights up to a change point and by the new ones after it.
With a weight store, each version is tried from the finding's onset (an update every
sequence met at the same completion index), then from each sequence's own change point (an
engine batching continuously starts sequences at different times, so one update falls at a
different index in each); the change point is read by scoring both versions once. Without a
store the update cannot be re-scored: `version_change` stays the signatures' answer."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from pipeline.contracts.causes import Cause
from pipeline.contracts.report import Finding
from pipeline.verify.families.weights import published, scored_under
from pipeline.verify.hypothesis import Candidate, Family


class InFlight(Family):
    name = "in-flight"
    causes = (Cause.VERSION_CHANGE,)
    kinds = ("store_version_from",)
    per_sequence = ("onsets",)  # each sequence's change point

    def hypotheses(self, ref, finding: Finding) -> list[Candidate]:
        at = ref.onset(finding)
        names = published(ref)
        common = [
            Candidate(Cause.VERSION_CHANGE, "store_version_from", replace(ref.base, at=at),
                      {"version": name, "at": at})
            for name in names
        ]  # fmt: skip
        own = [
            Candidate(Cause.VERSION_CHANGE, "store_version_from", ref.base,
                      {"version": name, "onsets": "searched"})
            for name in names
        ]  # fmt: skip
        return [*common, *own]

    def search(self, ref, candidate, rows, observed, clean, side) -> Candidate:
        onsets = candidate.params.get("onsets")
        ids = ref.fixture.sequence_ids
        if onsets is None or (isinstance(onsets, dict) and all(ids[r] in onsets for r in rows)):
            return candidate  # one shared onset, or these sequences' own ones already read
        later = scored_under(ref, candidate.params["version"], rows)
        onsets = {
            ids[row]: _onset(ref, row, seen, before, after)
            for row, seen, before, after in zip(rows, observed, clean, later, strict=True)
        }
        params = {"version": candidate.params["version"], "onsets": onsets}
        return replace(candidate, params=params)

    def commit(self, ref, candidate, rows):
        later = scored_under(ref, candidate.params["version"], rows)
        ids = ref.fixture.sequence_ids
        onsets = candidate.params.get("onsets")
        out = []
        for row, before, after in zip(rows, ref.clean(rows), later, strict=True):
            at = onsets.get(ids[row], 0) if isinstance(onsets, dict) else candidate.params["at"]
            cut = int(ref.mask(row)[:at].sum())  # compared tokens before the update
            out.append(np.concatenate([before[:cut], after[cut:]]))
        return out


def _onset(ref, row: int, seen, before, after) -> int:
    """The completion index a sequence's update fell at (its length: it never did)."""
    mask = ref.mask(row)
    positions = np.flatnonzero(mask)
    k = change_point(seen, before, after)
    return int(positions[k]) if k < len(positions) else len(mask)


def change_point(observed, before, after) -> int:
    """The index from which ``observed`` follows ``after`` rather than ``before``: the one
    that minimises the total |d| of "before" up to it and "after" from it."""
    old = np.nan_to_num(np.abs(np.asarray(observed) - before))
    new = np.nan_to_num(np.abs(np.asarray(observed) - after))
    cost = np.concatenate([[0.0], np.cumsum(old)]) + np.concatenate(
        [np.cumsum(new[::-1])[::-1], [0.0]]
    )
    return int(np.argmin(cost))
