"""Precision: the drift of the declared precisions is a claim like any other, checked by
re-scoring the rows in both, four correct ways each; a side may also compute in a lower
precision than it declares (the whole forward in bf16 or fp16, or only its LM head), or round
its logprobs after the forward (a data bug: the other side's values, rounded, match it)."""

from __future__ import annotations

import time
from dataclasses import replace

import numpy as np

from pipeline.compare.calibrated import TAU_MARGIN, pair_key, side_precision
from pipeline.compare.floor import expect
from pipeline.compare.noise_test import bucket_level_tests, precision_gate, rules_out_faults
from pipeline.contracts.causes import Cause
from pipeline.contracts.report import Finding
from pipeline.verify.hypothesis import Candidate, Family, Outcome

ROUNDINGS = ("bfloat16", "float16")  # logprobs rounded to these after the forward
# faults.py kinds that compute in a lower precision than declared, and the floor they meet
UNDECLARED_PRECISIONS = {"bf16": "bfloat16", "fp16": "float16", "lm_head_bf16": "bfloat16"}


class Precision(Family):
    name = "precision"
    causes = (Cause.DTYPE,)
    kinds = ("precision", "data_round", *UNDECLARED_PRECISIONS)

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

    def alternatives(self, ref, finding: Finding) -> list[Candidate]:
        """Beyond the declared precisions: one side computed in a lower one (tried on what
        the precision test failed)."""
        if finding.cause != Cause.DTYPE:
            return []
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
        declared = [p.removesuffix("+tf32") for p in candidate.params.values()]
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
        surprisal = -np.concatenate(replay)
        where = np.concatenate(positions)
        tau = TAU_MARGIN * np.maximum(expect(floor, surprisal, where)["q999"], 1e-12)
        gate = precision_gate(floor, drift, surprisal, where, offsets, tau)
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


def round_to(values: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values rounded to the nearest bfloat16 or float16 (ties to even), as float64."""
    single = np.asarray(values, dtype=np.float32)
    if dtype == "float16":
        return single.astype(np.float16).astype(np.float64)
    bits = single.view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16
    return rounded.astype(np.uint32).view(np.float32).astype(np.float64)
