"""Judging drift against the model's measured noise floor (`lpx calibrate`), not constants.

A calibration holds, for each pair of precisions, how far correct scorings of the same tokens
differ (`floor.py`). For a comparison whose two sides' precisions it covers, this module gives
each token its own mismatch threshold (tau, from its bucket's q999) and expected |d|, runs the
precision gate (`precision_gate.py`: the batch's mean |d| and tail counts against their
distribution under noise alone, at this token count), and gives the value each limited
metric reaches under noise alone at the gate's false-alarm rate: a bundled limit that noise
reaches further than is replaced by it. Without a usable calibration the report says why,
and the profile's constants judge.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# a calibration is read and checked by its model (contracts/calibration.py); compare reads it here
from pipeline.compare.calibration_file import (
    CALIBRATION_FORMAT,
    Calibration,
    as_calibration,
    load_calibration,
    read_calibration,
)
from pipeline.compare.floor import expect
from pipeline.compare.precision_gate import ALPHA, noise_limits, precision_gate
from pipeline.compare.signed import (
    MIN_CLUSTERS,
    sampled_as_reported,
    signed_null_for,
    signed_statistics,
)
from pipeline.contracts.files import CALIBRATION as CALIBRATION_FILE
from pipeline.contracts.numerics import numerics_of, precision_text

__all__ = [
    "CALIBRATION_FILE",
    "CALIBRATION_FORMAT",
    "TAU_MARGIN",
    "TF32",
    "Calibrated",
    "SignedSides",
    "as_calibration",
    "calibrated_judging",
    "effective_limits",
    "expected_mean_abs",
    "floor_table",
    "load_calibration",
    "pair_key",
    "read_calibration",
    "side_precision",
    "surprisal_side",
    "token_tau",
    "usable",
]

TF32 = "float32+tf32"
# A token drifts beyond precision when |d| exceeds its bucket's q999 by this factor.
TAU_MARGIN = 3.0


@dataclass
class Calibrated:
    """A comparison's floor: per-token tau and expected |d|, the precision gate's verdict,
    and what each limited metric reaches under noise alone."""

    pair: str
    tau: np.ndarray
    expected_mean: np.ndarray
    expected: dict
    limits: dict
    gate: dict
    note: dict


def side_precision(meta: dict) -> str:
    """float32, float16, bfloat16, or float32+tf32 when that side's fp32 used TF32; then the
    reduced-precision numerics it declares (``bfloat16+fp8_e4m3:w=tensor,a=tensor``)."""
    dtype = str(meta.get("dtype") or "float32")
    tf32 = bool((meta.get("hardware") or {}).get("allow_tf32")) or bool(
        (meta.get("knobs") or {}).get("allow_tf32") is True
    )
    return precision_text(dtype, numerics_of(meta), tf32 and dtype == "float32")


# How close a side's precision comes to the calibration's fp32 reference (bf16, fp16: 0).
REFERENCE_NEARNESS = {"float64": 3, "float32": 2, TF32: 1}


def surprisal_side(rollout_precision: str, replay_precision: str) -> str:
    """Whose logprob buckets a token's surprisal in the precision gate: the side nearer the
    fp32 reference that the calibration bucketed its samples by, the replay where both are as
    near. A bf16 side's logprob of a token whose MoE routing flipped in bf16 is tenths of a
    nat from fp32's, in another bucket with another tau: against an fp32 rollout, a clean
    bf16 replay of a Qwen3-MoE put 7 of 1,536 tokens over tau (0 by the rollout's), and failed
    the gate on a Sapphire Rapids CPU. The per-token tau the diagnosis reads stays the
    replay's: by the rollout's, an unrecorded update on an fp32 rollout (its logprobs the
    faulted ones) was named other weights in the tiny zoo."""
    rollout, replay = (REFERENCE_NEARNESS.get(p, 0) for p in (rollout_precision, replay_precision))
    return "rollout" if rollout > replay else "replay"


def pair_key(a: str, b: str) -> str:
    return "|".join(sorted((a, b)))


def usable(
    calibration: Calibration | dict | None, fixture_meta: dict, replay_meta: dict
) -> tuple[str, str]:
    """(pair key, "") when the calibration covers this comparison, else ("", why not)."""
    calibration = as_calibration(calibration)
    if calibration is None:
        return "", "no calibration given or found beside the replay (lpx calibrate)"
    # whether its weights are the fixture's is checked where it is read (pipeline.belonging):
    # a mismatch is refused, or allowed on purpose and recorded
    pair = pair_key(side_precision(fixture_meta), side_precision(replay_meta))
    if pair not in calibration.pairs:
        return "", (
            f"the calibration measured {', '.join(sorted(calibration.pairs))}, not {pair}; "
            "calibrate with both sides' dtypes (lpx calibrate --dtype)"
        )
    return pair, ""


def calibrated_judging(
    calibration: Calibration | dict,
    pair: str,
    reference_logprob,
    positions,
    offsets,
    source: str,
    abs_diff,
    alpha: float = ALPHA,
    gate_logprob=None,
    sides: SignedSides | None = None,
) -> Calibrated:
    """Per-token thresholds, the precision gate on ``abs_diff``, and the values this batch's
    metrics reach under noise alone (at the gate's false-alarm rate).

    ``reference_logprob`` (the replay's) buckets each token by surprisal for its tau, as the
    calibration bucketed its samples by the fp32 reference; the precision gate buckets by
    ``gate_logprob`` where given (the side `surprisal_side` names)."""
    calibration = as_calibration(calibration)
    floor = calibration.pairs[pair]
    table = floor_table(calibration, pair)
    surprisal = -np.asarray(reference_logprob, dtype=np.float64)
    expected = expect(table, surprisal, positions)
    tau = TAU_MARGIN * np.maximum(expected["q999"], 1e-12)
    gated = surprisal if gate_logprob is None else -np.asarray(gate_logprob, dtype=np.float64)
    gate_tau = (
        tau if gate_logprob is None else token_tau(calibration, pair, gate_logprob, positions)
    )
    signed, signed_note = sign_inputs(table, sides, positions, offsets)
    gate = precision_gate(table, abs_diff, gated, positions, offsets, gate_tau, alpha, signed)
    under_noise, limits = noise_limits(table, expected, offsets, alpha)
    return Calibrated(
        pair=pair,
        tau=tau,
        expected_mean=expected["mean"],
        expected=under_noise,
        limits=limits,
        gate=gate,
        note={
            "used": True,
            "source": source,
            "pair": pair,
            "created_at": calibration.created_at,
            "key": calibration.key.model_dump(exclude_unset=True),
            "calibration_tokens": floor.tokens,
            "compared_tokens": int(len(surprisal)),
            "spread": floor.spread,
            "design": floor.design.model_dump(exclude_unset=True),
            "expected_under_noise": under_noise,
            "false_alarm_rate": alpha,
            "tau_margin": TAU_MARGIN,
            "sign_tests": signed_note,
        },
    )


@dataclass
class SignedSides:
    """What the sign tests read of a comparison besides |d| (compare/signed.py): both sides'
    logprobs, the precision that rolled out, and how the rollout sampled."""

    rollout: np.ndarray
    train: np.ndarray
    rollout_precision: str
    sampling: dict | None
    clusters: np.ndarray  # per token, its prompt's label (signed.prompt_clusters)
    seen: np.ndarray | None = None  # per token, whether it occurred earlier in its context


def sign_inputs(table: dict, sides: SignedSides | None, positions, offsets):
    """(null, the batch's statistics, whether the ratio's mean applies) for the precision
    gate, or None; and a note of what was used or why not."""
    if sides is None:
        return None, {"used": False, "reason": "not given"}
    null, why_not = signed_null_for(table, sides.rollout_precision, sides.sampling)
    if null is None:
        return None, {"used": False, "reason": why_not}
    rollout = np.asarray(sides.rollout, dtype=np.float64)
    train = np.asarray(sides.train, dtype=np.float64)
    observed = signed_statistics(
        train - rollout, rollout, train, positions, sides.clusters, seen=sides.seen
    )
    if observed["sequences"] < MIN_CLUSTERS:
        return None, {
            "used": False,
            "reason": f"{observed['sequences']} distinct prompts, fewer than {MIN_CLUSTERS}",
        }
    applies = sampled_as_reported(sides.sampling)
    return (null, observed, applies), {"used": True, "ratio_mean": applies}


def token_tau(
    calibration: Calibration | dict, pair: str, reference_logprob, positions
) -> np.ndarray:
    """Per token: the |d| beyond which it drifts past precision (TAU_MARGIN x its q999)."""
    surprisal = -np.asarray(reference_logprob, dtype=np.float64)
    q999 = expect(floor_table(calibration, pair), surprisal, positions)["q999"]
    return TAU_MARGIN * np.maximum(q999, 1e-12)


def expected_mean_abs(
    calibration: Calibration | dict, pair: str, reference_logprob, positions
) -> np.ndarray:
    """Per token: the mean |d| precision alone gives it under this pair's floor."""
    surprisal = -np.asarray(reference_logprob, dtype=np.float64)
    return expect(floor_table(calibration, pair), surprisal, positions)["mean"]


def floor_table(calibration: Calibration | dict, pair: str) -> dict:
    """One pair's floor as floor.py and precision_gate.py take it: a dict, as the file wrote it
    (unknown fields kept, no default added)."""
    return as_calibration(calibration).pairs[pair].model_dump(exclude_unset=True)


def effective_limits(profile_limits: dict, calibrated: dict, user_policy: bool) -> dict:
    """The limits a calibrated comparison is judged by, besides the precision gate. The
    bundled profiles' constants were set from small models: where noise alone reaches
    further on this model (at the gate's false-alarm rate), that value replaces the
    constant. A limit the user set in a policy stands."""
    if user_policy:
        return dict(profile_limits)
    limits = dict(profile_limits)
    for name, value in calibrated.items():
        if name in limits:
            limits[name] = max(limits[name], value)
    return limits
