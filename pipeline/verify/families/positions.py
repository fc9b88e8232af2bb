"""Positions: position ids offset from a completion index on (a KV cache or cache reuse
that shifted them), or restarted at the completion (prompt and completion run as separate
segments). The offset is searched, then the onset within two tokens (an onset reads late
when its first tokens drift under tau); each try re-scores one sequence."""

from __future__ import annotations

from dataclasses import replace

from pipeline.verify.hypothesis import Candidate, Family
from pipeline.verify.search import closest, rescored_gap, with_settings

OFFSETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)  # position offsets searched
ONSET_NUDGES = (-2, -1, 1)  # the onset tried this far from the one read


class Positions(Family):
    name = "positions"
    causes = ("position_ids",)
    kinds = ("position_ids", "positions_restart")

    def hypotheses(self, ref, finding: dict) -> list[Candidate]:
        onset = ref.onset(finding)
        if onset <= 1:
            return [_restart(ref)]
        return [_from(ref, onset)]

    def alternatives(self, ref, finding: dict) -> list[Candidate]:
        onset = ref.onset(finding)
        return [_restart(ref), *([_from(ref, onset)] if onset > 1 else [])]

    def search(self, ref, candidate, rows, observed, clean, side) -> Candidate:
        if candidate.kind != "position_ids":
            return candidate
        gap = rescored_gap(ref, rows[0], observed[0])
        at = candidate.settings.at
        best = closest(
            (with_settings(candidate, {"at": at, "offset": o}, position_offset=o) for o in OFFSETS),
            gap,
        )
        offset = best.params["offset"]
        nudged = [
            with_settings(best, {"at": at + n, "offset": offset}, at=at + n)
            for n in ONSET_NUDGES
            if at + n >= 1
        ]
        return closest([best, *nudged], gap)


def _restart(ref) -> Candidate:
    return Candidate("position_ids", "positions_restart", ref.base, {})


def _from(ref, onset: int) -> Candidate:
    return Candidate("position_ids", "position_ids", replace(ref.base, at=onset), {"at": onset})
