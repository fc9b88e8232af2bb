"""Precision: the drift of the declared precisions is a claim like any other, checked by
re-scoring the rows in both, four correct ways each; a side may also compute in a lower
precision than it declares (the whole forward in bf16 or fp16, or only its LM head), or round
its logprobs after the forward (a data bug: the other side's values, rounded, match it)."""

from __future__ import annotations

import time
from dataclasses import replace

import numpy as np

from pipeline.compare.calibrated import (
    TAU_MARGIN,
    SignedSides,
    pair_key,
    side_precision,
    sign_inputs,
    surprisal_side,
)
from pipeline.compare.floor import expect
from pipeline.compare.precision_gate import bucket_level_tests, precision_gate, rules_out_faults
from pipeline.compare.signed import prompt_clusters, seen_before
from pipeline.contracts.causes import Cause, Severity
from pipeline.contracts.numerics import without_tf32
from pipeline.contracts.report import Finding
from pipeline.verify.hypothesis import Candidate, Family, Outcome

ROUNDINGS = ("bfloat16", "float16")  # logprobs rounded to these after the forward
# faults.py kinds that compute in a lower precision than declared, and the floor they meet
UNDECLARED_PRECISIONS = {"bf16": "bfloat16", "fp16": "float16", "lm_head_bf16": "bfloat16"}


class Precision(Family):
    name = "precision"
    causes = (Cause.DTYPE,)
    kinds = ("precision", "data_round", *UNDECLARED_PRECISIONS)
    data_kinds = ("data_round",)
    own_judgement = ("precision",)

    def hypotheses(self, ref, finding: Finding) -> list[Candidate]:
        details = finding.details
        if "mean_abs_diff" not in details and details.get("dtype") in ROUNDINGS:
            # one side's logprobs are exact values of a low precision: rounded after the
            # forward, a data bug of its own that re-scoring cannot give
            params = {"side": details.get("side", "rollout"), "dtype": details["dtype"]}
            return [Candidate(Cause.DTYPE, "data_round", ref.base, params)]
        precisions = {
            "rollout": side_precision(ref.fixture.metadata),
            "replay": side_precision(ref.replay.metadata),
        }
        return [Candidate(Cause.DTYPE, "precision", ref.base, precisions)]

    def any_shape(self, ref, finding: Finding) -> list[Candidate]:
        """Beyond the declared precisions: one side computed in a lower one (a side that
        computed in bf16 while it declares fp32 drifts by a few times the floor, in any
        shape)."""
        return [
            Candidate(Cause.DTYPE, kind, ref.base, {"computed_in": computed})
            for kind, computed in UNDECLARED_PRECISIONS.items()
        ]

    def data(self, candidate, rollout, replay, drifting):
        # the other side's logprobs rounded as this side's were: equal but where noise
        # crossed a rounding boundary
        side = candidate.params.get("side", "rollout")
        rounded = np.concatenate(rollout if side == "rollout" else replay)
        other = np.concatenate(replay if side == "rollout" else rollout)
        return side, round_to(other, candidate.params["dtype"]), rounded, drifting, True

    def judge(self, ref, candidate, rows, observed) -> Outcome:
        """The rows re-scored in both sides' declared precisions, four correct ways each
        (`lpx calibrate` on exactly these rows), give the noise these very tokens meet; the
        observed drift must pass the precision gate against it, and in every surprisal
        bucket its level too. Otherwise the drift is beyond what precision gives, and a
        fault to explain."""
        from pipeline.calibrate.run import calibrate

        started = time.perf_counter()
        rollout, replay, positions = observed
        declared = [without_tf32(p) for p in candidate.params.values()]
        ref.say(
            f"verify: re-scoring {len(rows)} sequences in {' and '.join(sorted(set(declared)))}"
        )
        calibration = calibrate(
            ref.fixture, ref.model_dir, declared, device=ref.device, rows=rows, keyed=False
        )
        pair = pair_key(*candidate.params.values())
        if pair not in calibration["pairs"]:  # TF32 declared where none can be measured here
            pair = pair_key(*declared)
        floor = calibration["pairs"][pair]
        offsets = np.concatenate([[0], np.cumsum([len(r) for r in rollout])])
        drift = np.abs(np.concatenate(rollout) - np.concatenate(replay))
        nearer = surprisal_side(*(candidate.params[side] for side in ("rollout", "replay")))
        surprisal = -np.concatenate(rollout if nearer == "rollout" else replay)
        where = np.concatenate(positions)
        tau = TAU_MARGIN * np.maximum(expect(floor, surprisal, where)["q999"], 1e-12)
        # the sign tests too: a trainer temperature under an FP8 rollout stays inside every
        # magnitude band, and is not precision for that
        sides = SignedSides(
            np.concatenate(rollout),
            np.concatenate(replay),
            # as the calibration measured it (TF32 only where it can be measured here)
            candidate.params["rollout"]
            if pair == pair_key(*candidate.params.values())
            else declared[0],
            ref.fixture.metadata.get("sampling"),
            prompt_clusters([ref.fixture.prompt_of(r) for r in rows], np.diff(offsets)),
            np.concatenate(
                [
                    seen_before(ref.fixture.prompt_of(r), ref.fixture.completion_of(r))[
                        np.asarray(at, dtype=np.int64)
                    ]
                    for r, at in zip(rows, positions, strict=True)
                ]
            ),
        )
        signed, _ = sign_inputs(floor, sides, where, offsets)
        gate = precision_gate(floor, drift, surprisal, where, offsets, tau, signed=signed)
        buckets = bucket_level_tests(floor, drift, surprisal, where, offsets)
        level = next(t for t in gate["tests"] if t["name"] == "mean_abs_diff")
        failed = [t["name"] for t in [*gate["tests"], *buckets] if not t["passed"]]
        # consistent with precision, but too few tokens to rule out a fault of FAULT_SIZE
        inconclusive = not failed and not rules_out_faults(level)
        candidate = replace(
            candidate,
            params={
                **candidate.params,
                "reproduced_mean_abs": round(level["expected"], 6),
                "critical_mean_abs": round(level["critical"], 6),
                "tokens": int(len(drift)),
                **({"failed": failed} if failed else {}),
                **({"inconclusive": True} if inconclusive else {}),
            },
        )
        return Outcome(
            candidate,
            "both",
            float(drift.mean()) if len(drift) else 0.0,
            level["expected"],
            level["critical"],
            not failed and not inconclusive,
            time.perf_counter() - started,
        )

    def words(self, outcome: Outcome, how: str) -> tuple[str, str]:
        """Declared precision is information; a precision other than declared is a fault."""
        params = outcome.candidate.params
        if outcome.candidate.kind == "precision":
            return (
                f"re-scored in the declared precisions ({_text(_declared(params))}), four "
                f"correct ways each, these tokens drift by mean |d| {outcome.after:.3g}; the "
                f"observed {outcome.before:.3g} passes the precision gate against it "
                f"(critical {outcome.floor:.3g}) and in every surprisal bucket: the drift is "
                "precision",
                Severity.INFO,
            )
        if outcome.candidate.kind in UNDECLARED_PRECISIONS:
            head = " (its LM head)" if outcome.candidate.kind == "lm_head_bf16" else ""
            return (
                f"{how}: that side computed in {params['computed_in']}{head}, not the "
                "precision it declares",
                Severity.FAULT,
            )
        return how, Severity.INFO if outcome.candidate.cause == Cause.DTYPE else Severity.FAULT

    def tried_words(self, tried: dict) -> str | None:
        if tried["kind"] != "precision":
            return None
        params = tried["params"]
        return (
            f"precision: re-scored in the declared precisions "
            f"({_text(_declared(params))}) these tokens drift by mean |d| "
            f"{tried['residual_after']:.3g}, and the observed {tried['residual_before']:.3g} "
            f"fails the precision gate ({', '.join(params.get('failed', [])) or 'level'}; "
            f"critical mean {tried['floor']:.3g})"
        )


def _declared(params: dict) -> dict:
    return {side: params[side] for side in ("rollout", "replay") if side in params}


def _text(params: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in params.items())


def round_to(values: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values rounded to the nearest bfloat16 or float16 (ties to even), as float64."""
    single = np.asarray(values, dtype=np.float32)
    if dtype == "float16":
        return single.astype(np.float16).astype(np.float64)
    bits = single.view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16
    return rounded.astype(np.uint32).view(np.float32).astype(np.float64)
