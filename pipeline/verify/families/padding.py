"""Padding and masking: pads attended in the engine's micro-batches (right-padded, the mask
dropped, or sequences packed without a reset), left padding attended with the pad count and
whether positions counted the pads searched per sequence, and a constant (0) written where a
mask said padding (a data bug, tested without the model)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from pipeline.contracts.causes import Cause
from pipeline.contracts.report import Finding
from pipeline.faults import left_padded, rescore
from pipeline.verify.hypothesis import Candidate, Family
from pipeline.verify.search import mean_abs

BATCHED = ("pad_attended", "mask_dropped", "packed_no_reset")
PAD_ROWS = 32  # pad counts scored per forward in the left-padding search


class Padding(Family):
    name = "padding"
    causes = (Cause.MASK_PADDING,)
    kinds = (*BATCHED, "pad_positions", "left_pad_search", "left_pad", "data_fill")
    data_kinds = ("data_fill",)
    per_sequence = ("counts",)  # a left padding's pad count per sequence

    def hypotheses(self, ref, finding: Finding) -> list[Candidate]:
        details = finding.details
        if "fill_value" in details:
            params = {"fill_value": details["fill_value"], "side": details.get("side", "rollout")}
            return [Candidate(Cause.MASK_PADDING, "data_fill", ref.base, params)]
        return _model_kinds(ref)

    def alternatives(self, ref, finding: Finding) -> list[Candidate]:
        kinds = _model_kinds(ref)
        if finding.details.get("position_onset") is not None:
            # drift that starts at one position many sequences share, clean before it, is
            # not left padding attended (that moves every token from the first, by a count
            # of its own per sequence): its search, one forward per sequence and count, is
            # not made (117 s of one verification at 16 x 1024)
            kinds = [c for c in kinds if c.kind != "left_pad_search"]
        return [*fills(ref), *kinds]

    def search(self, ref, candidate, rows, observed, clean, side) -> Candidate:
        if candidate.kind == "left_pad_search":
            return _search_left_padding(ref, candidate, rows, observed)
        if candidate.kind == "left_pad":  # found on other sequences: their own counts
            return _search_left_padding(ref, candidate, rows, observed, candidate.params)
        return candidate

    def commit(self, ref, candidate, rows):
        fixture = ref.fixture
        if candidate.kind == "left_pad":
            params, ids = candidate.params, fixture.sequence_ids
            values = [
                left_padded(ref.model, fixture.prompt_of(r), fixture.completion_of(r),
                            [params["counts"][ids[r]]], params["shifted"], params["pad_id"])[0]
                for r in rows
            ]  # fmt: skip
            return ref.compared(values, rows)
        if candidate.kind in (*BATCHED, "pad_positions"):
            # the micro-batches the engine formed, in fixture order, hold the sequences
            size = candidate.settings.micro_batch
            groups = sorted({row // size for row in rows})
            members = [
                r
                for g in groups
                for r in range(g * size, min((g + 1) * size, fixture.num_sequences))
            ]
            scored = rescore(ref.model, ref.pairs(members), candidate.kind, candidate.settings)
            by_row = dict(zip(members, scored, strict=True))
            return ref.compared([by_row[r] for r in rows], rows)
        return None

    def data(self, candidate, rollout, replay, drifting):
        side = candidate.params.get("side", "rollout")
        filled = np.concatenate(rollout if side == "rollout" else replay)
        value = float(candidate.params["fill_value"])
        return side, np.full(len(filled), value), filled, drifting, True


def fills(ref) -> list[Candidate]:
    """A 0 written into either side's logprobs (where its mask said padding)."""
    return [
        Candidate(Cause.MASK_PADDING, "data_fill", ref.base, {"fill_value": 0.0, "side": side})
        for side in ("rollout", "replay")
    ]


def _model_kinds(ref) -> list[Candidate]:
    size = ref.micro_batch()
    settings = replace(ref.base, micro_batch=size)
    return [
        *(Candidate(Cause.MASK_PADDING, kind, settings, {"micro_batch": size}) for kind in BATCHED),
        Candidate(Cause.MASK_PADDING, "left_pad_search", ref.base, {}),
    ]


def _search_left_padding(ref, candidate, rows, observed, found=None) -> Candidate:
    """Left padding attended (no attention mask), the pads counted in the positions or not,
    searched per sequence. A sequence's pad count is the longest of its batch less its own
    length, and the batch is the engine's, unknown here: every count another sequence of the
    fixture could impose is tried (one forward per sequence, one row per count). The first
    sequence also decides the pad id and whether positions shifted."""
    fixture, ids = ref.fixture, ref.fixture.sequence_ids
    totals = {
        len(fixture.prompt_of(r)) + len(fixture.completion_of(r))
        for r in range(fixture.num_sequences)
    }
    config = ref.model.config
    eos = config.eos_token_id if isinstance(config.eos_token_id, list) else [config.eos_token_id]
    pad_ids = list(dict.fromkeys(i for i in (config.pad_token_id, *eos, 0) if i is not None))

    def gaps(row: int, seen, shifted: bool, pad_id: int) -> dict:
        own = len(fixture.prompt_of(row)) + len(fixture.completion_of(row))
        counts = [0, *sorted({total - own for total in totals if total > own})]
        out = {}
        for start in range(0, len(counts), PAD_ROWS):
            chunk = counts[start : start + PAD_ROWS]
            scored = left_padded(
                ref.model, fixture.prompt_of(row), fixture.completion_of(row),
                chunk, shifted, pad_id,
            )  # fmt: skip
            mask = ref.mask(row)
            out.update({c: mean_abs([seen], [s[mask]]) for c, s in zip(chunk, scored, strict=True)})
        return out

    best = None
    shapes = [(found["shifted"], found["pad_id"])] if found else []
    for shifted, pad_id in shapes or [(s, p) for s in (True, False) for p in pad_ids]:
        tried = gaps(rows[0], observed[0], shifted, pad_id)
        count = min(tried, key=tried.get)
        if best is None or tried[count] < best[0]:
            best = (tried[count], shifted, pad_id, count)
    _, shifted, pad_id, first = best
    counts = {ids[rows[0]]: first}
    for row, seen in zip(rows[1:], observed[1:], strict=True):
        tried = gaps(row, seen, shifted, pad_id)
        counts[ids[row]] = min(tried, key=tried.get)
    params = {"attended": True, "shifted": shifted, "pad_id": pad_id, "counts": counts}
    return replace(candidate, kind="left_pad", params=params)
