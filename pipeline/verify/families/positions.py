"""Positions: position ids offset from some index on (a KV cache of the wrong length, a
prefix cache that resumed at the wrong place), or restarted at the completion (prompt and
completion run as separate segments). A drift that starts inside the completion is offset
from there; one from the completion's first token may start anywhere in the prompt.

The offset is any integer, and the logprobs are not monotone in it (rotary positions
wrap), so it is searched exhaustively over OFFSETS (one row per offset, many rows per
forward, on the tokens up to SEARCH_TOKENS past the onset), then the start within two
tokens; a start inside the prompt is searched over a grid of the prompt, the offset then
refined at the best start, and the start again at that offset. A start inside the prompt is
then told apart: the same prompt index in every sequence (a system prompt's reserved
positions), or the same distance before each completion, by which one fits more sequences."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from pipeline.contracts.causes import Cause
from pipeline.contracts.report import Finding
from pipeline.faults.forward import offset_positions
from pipeline.verify.hypothesis import Candidate, Family
from pipeline.verify.search import closest, mean_abs, rescored_gap, with_settings

# offsets searched: every integer near 0 (a cache off by a few tokens, or short), then
# coarser out to 1,024
OFFSETS = (*range(-32, 0), *range(1, 129), *range(136, 513, 8), *range(544, 1025, 32))
COARSE_OFFSETS = (-16, -8, -4, -2, -1, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
PROMPT_STARTS = 32  # prompt indices tried as the start of an offset inside the prompt
ONSET_NUDGES = (-2, -1, 1)  # the start tried this far from the one found
SEARCH_TOKENS = 32  # completion tokens past the onset a search scores
ROWS = 32  # shapes scored per forward


class Positions(Family):
    name = "positions"
    causes = (Cause.POSITION_IDS,)
    kinds = ("position_ids", "positions_restart")

    def hypotheses(self, ref, finding: Finding) -> list[Candidate]:
        onset = ref.onset(finding)
        if onset <= 1:
            return [_restart(ref), _in_prompt(ref)]
        return [_from(ref, onset)]

    def alternatives(self, ref, finding: Finding) -> list[Candidate]:
        onset = ref.onset(finding)
        shared = finding.details.get("position_onset")
        return [_restart(ref), _from(ref, onset) if onset > 1 else _in_prompt(ref, shared)]

    def search(self, ref, candidate, rows, observed, clean, side) -> Candidate:
        if candidate.kind != Cause.POSITION_IDS:
            return candidate
        row, prompt_length = rows[0], len(ref.fixture.prompt_of(rows[0]))
        at = candidate.settings.at
        gap = _Gaps(ref, row, observed[0], max(at, 1))
        if candidate.params.get("in_prompt"):
            starts = np.unique(np.linspace(1, prompt_length, PROMPT_STARTS).round().astype(int))
            shared = candidate.params.get("position_onset")
            if shared is not None and 1 <= shared <= prompt_length:
                # compare found the position drift starts at in many sequences: the offset
                # starts there, not anywhere in the prompt (32 starts x 15 offsets spared)
                starts = np.arange(max(1, shared - 1), min(prompt_length, shared + 1) + 1)
            start, offset = gap.best([(s, o) for s in starts for o in COARSE_OFFSETS])
            start, offset = gap.best([(start, o) for o in OFFSETS if start + o >= 0])
            nearby = range(max(1, start - 8), min(prompt_length, start + 8) + 1)
            start, offset = gap.best([(s, offset) for s in nearby])
            at = start - prompt_length + 1  # faults.py's onset: <= 0 inside the prompt
        else:
            start = prompt_length + at - 1
            _, offset = gap.best([(start, o) for o in OFFSETS if start + o >= 0])
        best = with_settings(candidate, {"at": at, "offset": offset}, at=at, position_offset=offset)
        nudged = [
            with_settings(best, {"at": at + n, "offset": offset}, at=at + n)
            for n in ONSET_NUDGES
            if prompt_length + at + n - 1 >= 1
        ]
        best = closest([best, *nudged], rescored_gap(ref, row, observed[0]))
        if not candidate.params.get("in_prompt"):
            return best
        start = prompt_length + best.settings.at - 1
        fixed = with_settings(
            best, {"prompt_index": int(start), "offset": offset}, prompt_start=int(start)
        )
        return closest([best, fixed], _gap_over(ref, rows, observed))


class _Gaps:
    """How far each (start, offset) shape of one sequence lies from its observed side, on
    its completion's first tokens up to SEARCH_TOKENS past the onset; many shapes per
    forward."""

    def __init__(self, ref, row: int, observed, onset: int):
        mask = ref.mask(row)
        keep = min(len(mask), onset + SEARCH_TOKENS)
        self.ref, self.row = ref, row
        self.prompt = ref.fixture.prompt_of(row)
        self.completion = ref.fixture.completion_of(row)[:keep]
        self.mask = mask[:keep]
        self.observed = observed[: int(self.mask.sum())]

    def best(self, shapes: list[tuple[int, int]]) -> tuple[int, int]:
        gaps = {}
        for first in range(0, len(shapes), ROWS):
            chunk = shapes[first : first + ROWS]
            scored = offset_positions(self.ref.model, self.prompt, self.completion, chunk)
            for shape, values in zip(chunk, scored, strict=True):
                gaps[shape] = mean_abs([self.observed], [values[self.mask].astype(np.float64)])
        return min(shapes, key=gaps.get)


def _gap_over(ref, rows: list[int], observed: list):
    """gap(candidate) over up to FORM_ROWS of the sequences, those of the most distinct
    prompt lengths first (where a prompt index and a distance from the completion part)."""
    lengths = [len(ref.fixture.prompt_of(r)) for r in rows]
    order = sorted(range(len(rows)), key=lambda i: (lengths.index(lengths[i]) != i, i))
    chosen = order[:FORM_ROWS]

    def gap(candidate) -> float:
        scored = ref.rescore(candidate, [rows[i] for i in chosen])
        return mean_abs([observed[i] for i in chosen], scored)

    return gap


FORM_ROWS = 4  # sequences that tell a prompt index from a distance before the completion


def _restart(ref) -> Candidate:
    return Candidate(Cause.POSITION_IDS, "positions_restart", ref.base, {})


def _from(ref, onset: int) -> Candidate:
    return Candidate(Cause.POSITION_IDS, "position_ids", replace(ref.base, at=onset), {"at": onset})


def _in_prompt(ref, shared: int | None = None) -> Candidate:
    """An offset from somewhere in the prompt (searched; around ``shared``, the position
    compare found drift starting at in many sequences, where it found one): the completion
    drifts from its first token."""
    params = {"in_prompt": True, **({"position_onset": int(shared)} if shared is not None else {})}
    return Candidate(Cause.POSITION_IDS, "position_ids", replace(ref.base, at=1), params)
