"""Numerics: a side computed with reduced-precision numerics it does not declare (its linear
layers in FP8, MXFP8 or INT8, its KV cache in FP8), or other numerics than it declares (an
engine that fell back to a bf16 KV cache, per-tensor activations where per-token were set).

The search re-scores the most drifting sequences in the side's declared dtype under each
format of `FORMATS` with each KV cache of `KV_CACHES`, and each alone
(pipeline/numerics/emulate.py computes them exactly), and keeps the one whose logprobs lie
nearest the side's. Formats are far
apart: re-scored under the wrong one, a rollout stays 4 to 20 times further than under its
own (docs/reduced-precision.md), except where the mathematics makes two alike (power-of-two
scales round every value alike whatever the block, so `fp8-block-ue8m0` and `mxfp8` differ
only in their smallest values): those are named together. The best is then judged on every
sequence the way precision is: the rows re-scored three correct ways in those numerics
(`lpx calibrate` on exactly these rows) give how far two implementations of them lie apart,
and the side's distance from the reproduction must pass the precision gate against it.

Per-tensor dynamic activation scales are taken over whatever batch the engine ran: a
re-score cannot give the same batch, so such a rollout is reproduced only as far as its
batch-to-batch noise allows (and said so).
"""

from __future__ import annotations

import time
from dataclasses import replace

import numpy as np

from pipeline.compare.calibrated import TAU_MARGIN, side_precision
from pipeline.compare.floor import expect
from pipeline.compare.precision_gate import precision_gate
from pipeline.contracts.causes import Cause, Severity, Status
from pipeline.contracts.numerics import Numerics, precision_text, split_precision
from pipeline.contracts.report import Finding
from pipeline.verify import numerics_search
from pipeline.verify.hypothesis import EXPLAINED, Candidate, Family, Outcome
from pipeline.verify.sides import moved_side, screen_rows

# formats whose screen residual lies within this factor of the best one's are named with it
INDISTINGUISHABLE = 1.25
# the layers around the best format are searched where it came this much nearer the side
# than its declared numerics (or where its family ranks ahead: numerics_search.py)
CLOSER = 1.1
# Named `plausible` with no reproduction at the floor: the leading format family's nearest
# numerics came this many times nearer the side than every other family's and the declared
# numerics (an engine's arithmetic that lpx's emulation does not give to the floor)
PLAUSIBLE_MARGIN = 1.5


class NumericsFamily(Family):
    name = "numerics"
    causes = (Cause.QUANTIZATION, Cause.KV_CACHE_PRECISION)
    kinds = ("numerics",)
    own_judgement = ("numerics",)
    # what one finding's search saw, not the bug's shape: findings one format verified merge
    per_sequence = ("screen", "indistinguishable", "critical_mean_abs", "failed")

    def any_shape(self, ref, finding: Finding) -> list[Candidate]:
        """Offered for drift of any shape: numerics move every token a little, and only the
        tokens that cross tau make a finding (an FP8 KV cache on the tiny model: 3 of 24
        sequences). Its screen costs a forward of two sequences per format."""
        return [Candidate(Cause.QUANTIZATION, "numerics", ref.base, _onset(finding))]

    def hypotheses(self, ref, finding: Finding) -> list[Candidate]:
        return [Candidate(finding.cause, "numerics", ref.base, _onset(finding))]

    def untestable(self, ref, finding: Finding) -> Finding | None:
        """After every reproduction failed: the leading format family, `plausible`, where the
        search on this finding's sequences ranked it PLAUSIBLE_MARGIN ahead of every other
        family and of the declared numerics (an engine's arithmetic lpx's emulation does not
        give to the floor: INT8 W8A8 on bf16-dequantized weights)."""
        drifting = set(finding.sequences)
        searched = [
            (ids, search)
            for ids, search in getattr(ref, "numerics_searches", {}).items()
            if ids <= drifting  # judged on a spread of this finding's sequences
        ]
        if not searched:
            return None
        residuals, declared, side = max(searched, key=lambda item: len(item[0]))[1]
        rows = numerics_search.ranking(residuals)
        first = rows[0]
        if first[0] in ("kv", "none") or first[2] == declared:
            return None
        others = [r for f, r, t in rows[1:]] + [residuals.get(declared, float("inf"))]
        if any(first[1] * PLAUSIBLE_MARGIN > other for other in others):
            return None
        nearest = _parsed(first[2])
        order = ", ".join(f"{f} {_label(t)} {r:.3g}" for f, r, t in rows[:4])
        cause = Cause.QUANTIZATION if nearest.linear else Cause.KV_CACHE_PRECISION
        return finding.but(
            cause=cause,
            severity=Severity.FAULT,
            status=Status.PLAUSIBLE,
            evidence=(
                f"the {side} side lies nearest {first[0].upper()} numerics ({nearest.label}: "
                f"mean |d| {first[1]:.3g}), at least {PLAUSIBLE_MARGIN:g}x nearer than every "
                f"other format family and than its declared numerics "
                f"({_label(declared)} {residuals.get(declared, float('nan')):.3g}); ranking by "
                f"family: {order}. No emulation reproduced it to the floor: the engine's "
                "arithmetic differs from lpx's (a GEMM on dequantized operands, another "
                "accumulation or scale rule)"
            ),
            details={**finding.details, "numerics_ranking": [
                {"family": f, "numerics": _label(t), "mean_abs": round(r, 6)} for f, r, t in rows
            ], "found": nearest.text, "side": side},
        )  # fmt: skip

    def judge(self, ref, candidate: Candidate, rows, observed) -> Outcome:
        started = time.perf_counter()
        rollout, replay, positions = observed
        side = moved_side(ref, rollout, replay, ref.clean(rows), positions)
        meta = ref.fixture.metadata if side == "rollout" else ref.replay.metadata
        seen = rollout if side == "rollout" else replay
        dtype, _, declared = split_precision(side_precision(meta))
        before = _mean_abs(rollout, replay)
        screen = screen_rows(rows, rollout, replay, positions)
        screened = [seen[rows.index(r)] for r in screen]
        found = candidate.params.get("found")
        if found is not None and candidate.params.get("side") == side:
            # verified on another finding: that format against the declared ones, no search
            residuals = {
                numerics.text: _residual(ref, ref.in_precision(dtype), numerics, screen, screened)
                for numerics in (declared, _parsed("" if found == "none" else found))
            }
        else:
            onset = candidate.params.get("onset") or _pooled_onset(ref, rows, observed)
            residuals = _search(ref, dtype, declared, screen, screened, onset)
            searches = ref.__dict__.setdefault("numerics_searches", {})
            judged = frozenset(ref.fixture.sequence_ids[r] for r in rows)
            searches[judged] = (residuals, declared.text, side)
        best_text = min(residuals, key=residuals.get)
        best = _parsed(best_text)
        alike = sorted(t for t, v in residuals.items()
                       if t != best_text and v <= INDISTINGUISHABLE * residuals[best_text])  # fmt: skip
        params = {
            "side": side,
            "declared": declared.text or "none",
            "found": best.text or "none",
            "label": best.label,
            "description": best.description,
            "screen": {
                _label(t): round(v, 6) for t, v in sorted(residuals.items(), key=lambda i: i[1])
            },
            **({"indistinguishable": [_label(t) for t in alike]} if alike else {}),
        }
        cause = Cause.QUANTIZATION if best.linear != declared.linear else Cause.KV_CACHE_PRECISION
        candidate = replace(candidate, cause=cause, params=params)
        if best == declared or INDISTINGUISHABLE * residuals[best_text] > residuals[declared.text]:
            # nothing clearly closer than what the side declares
            seconds = time.perf_counter() - started
            return Outcome(candidate, side, before, residuals[best_text], 0.0, False, seconds)
        precision = precision_text(dtype, best)
        ref.say(f"verify: re-scoring {len(rows)} sequences in {precision}, three ways")
        surprisal = -np.concatenate(ref.clean(rows))
        from pipeline.calibrate.run import same_precision_floor

        floor, reproduced = same_precision_floor(
            ref.fixture, rows, ref.model_dir, precision, surprisal, ref.device
        )
        where = np.concatenate(positions)
        residual = np.abs(np.concatenate(seen) - reproduced)
        offsets = np.concatenate([[0], np.cumsum([len(r) for r in seen])])
        tau = TAU_MARGIN * np.maximum(expect(floor, surprisal, where)["q999"], 1e-12)
        gate = precision_gate(floor, residual, surprisal, where, offsets, tau)
        level = next(t for t in gate["tests"] if t["name"] == "mean_abs_diff")
        after = float(residual.mean()) if len(residual) else 0.0
        failed = [t["name"] for t in gate["tests"] if not t["passed"]]
        # within what two implementations of the numerics differ by, and at most half as
        # far from the side as the declared numerics are (the gate alone would pass a
        # reproduction of a drift as small as that noise; a loose 1.25x let the nearest of
        # ~90 numerics, chosen and judged on one 24-token sequence of a repetition penalty,
        # verify as FP4 weight-only)
        verified = not failed and after <= EXPLAINED * before
        candidate.params.update(
            precision=precision,
            critical_mean_abs=round(level["critical"], 6),
            **({"failed": failed} if failed else {}),
        )
        seconds = time.perf_counter() - started
        return Outcome(candidate, side, before, after, level["expected"], verified, seconds)

    def words(self, outcome: Outcome, how: str) -> tuple[str, str]:
        params = outcome.candidate.params
        declared = params["declared"]
        said = (
            "it does not declare"
            if declared == "none"
            else f"not the {_label(declared)} it declares"
        )
        alike = params.get("indistinguishable")
        lost = numerics_search.lost_scale_words(
            _parsed("" if params["found"] == "none" else params["found"]),
            _parsed("" if declared == "none" else declared),
        )
        if lost:
            said = f"it does not declare: {lost}"
        return (
            f"the {params['side']} side computed with numerics {said}: {params['description']} "
            f"({params['found']}). Re-scored so, three correct ways, its logprobs lie within "
            f"what two implementations of them differ by (mean |d| {outcome.after:.3g}, "
            f"expected {outcome.floor:.3g}, critical {params['critical_mean_abs']:.3g}; the "
            f"drift was {outcome.before:.3g})"
            + (f"; these tokens cannot tell it from {', '.join(alike)}" if alike else ""),
            Severity.FAULT,
        )

    def tried_words(self, tried: dict) -> str | None:
        params = tried["params"]
        if not params.get("found"):
            return None
        nearest = ", ".join(f"{k} {v:.3g}" for k, v in list(params["screen"].items())[:3])
        return (
            f"numerics: re-scored in every format ({len(params['screen'])}), the "
            f"{params['side']} side lies nearest {params['label']}, at mean |d| "
            f"{tried['residual_after']:.3g} against a drift of {tried['residual_before']:.3g} "
            f"({nearest}): not reproduced"
        )


def _search(ref, dtype: str, declared: Numerics, rows, observed, onset) -> dict[str, float]:
    """Each numerics tried (canonical text -> mean |d| between the side and its re-score):
    `numerics_search.search` says which, in what order.

    Every pair of format and KV cache, not the pairs of those nearest alone: a KV cache
    rounds what the linear layers computed, so only the side's own pair gives its rounding
    back; with the cache right and the format wrong (or the reverse) the rounding falls anew,
    and either alone lies about as far as the declared numerics, nearer or further by
    chance. A bf16 rollout with FP8 blocks and an FP8 cache, per sequence of 24 on the tiny
    model: the nearest single format or cache came 0.81x to 2.5x nearer than plain bf16 (a
    screen of two sequences gave 1.07x), the true pair 12x."""
    from pipeline.numerics.emulate import decoder_layers

    model = ref.in_precision(dtype)
    moe = any(hasattr(m, "experts") for m in model.modules())
    return numerics_search.search(
        lambda numerics: _residual(ref, model, numerics, rows, observed),
        declared, len(decoder_layers(model)), moe, onset, CLOSER,
    )  # fmt: skip


def _pooled_onset(ref, rows, observed) -> int | None:
    """The judged sequences' pooled drift rise, at absolute query positions."""
    rollout, replay, positions = observed
    starts = [len(ref.fixture.prompt_of(r)) - 1 for r in rows]
    where = np.concatenate([p + s for p, s in zip(positions, starts, strict=True)])
    return numerics_search.pooled_onset(
        where, np.abs(np.concatenate(rollout) - np.concatenate(replay))
    )


def _onset(finding: Finding) -> dict:
    onset = (finding.details or {}).get("position_onset")
    return {"onset": int(onset)} if onset is not None else {}


def _residual(ref, model, numerics: Numerics, rows, observed) -> float:
    from pipeline.faults import rescore
    from pipeline.numerics.emulate import apply_numerics, remove_numerics

    apply_numerics(model, numerics)
    try:
        values = rescore(model, ref.pairs(rows), "clean", ref.base)
    finally:
        remove_numerics(model)
    return _mean_abs(observed, ref.compared(values, rows))


def _parsed(text: str) -> Numerics:
    from pipeline.contracts.numerics import parse_numerics

    return parse_numerics(text)


def _label(text: str) -> str:
    return _parsed(text).label if text and text != "none" else "none"


def _mean_abs(a, b) -> float:
    left, right = np.concatenate(a), np.concatenate(b)
    keep = np.isfinite(left) & np.isfinite(right)
    return float(np.mean(np.abs(left[keep] - right[keep]))) if keep.any() else 0.0
