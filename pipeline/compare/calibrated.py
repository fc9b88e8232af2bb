"""Judging drift against the model's measured noise floor (`lpx calibrate`), not constants.

A calibration holds, for each pair of precisions, how far two correct scorings of the same
tokens differ (`floor.py`). For a comparison whose two sides' precisions it covers, this
module gives each token its own mismatch threshold (tau, from its bucket's q999), the
expected |d| under noise alone, and the limits the profile's metrics would reach under
noise alone, times a margin. Without a usable calibration the report says why, and the
profile's constants judge.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeline.compare.floor import expect, mixture_quantile
from pipeline.errors import BadInput

CALIBRATION_FORMAT = 1
CALIBRATION_FILE = "calibration.json"  # beside the replay or fixture: compare finds it
TF32 = "float32+tf32"
# A token drifts beyond precision when |d| exceeds its bucket's q999 by this factor.
TAU_MARGIN = 3.0
# Batch statistics under noise alone stay within these factors of what the floor predicts
# for the compared tokens: means vary less than tails between engines and batches.
MEAN_MARGIN = 2.0
TAIL_MARGIN = 3.0
# The metrics a floor predicts, and from what (see calibrated_limits).
CALIBRATED_METRICS = (
    "max_abs_diff",
    "mean_abs_diff",
    "rms_diff",
    "p50_abs_diff",
    "p99_abs_diff",
    "p999_abs_diff",
    "k2",
    "k3",
    "token_mult_prob_error",
    "max_seq_mean_abs_diff",
)


@dataclass
class Calibrated:
    """A comparison's floor: per-token tau and expected |d|, and the calibrated limits."""

    pair: str
    tau: np.ndarray
    expected_mean: np.ndarray
    expected: dict
    limits: dict
    note: dict


def read_calibration(path: Path) -> dict:
    """A calibration.json, checked enough that a broken one is refused by name."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as error:
        raise BadInput(f"{path}: cannot read the calibration ({error.strerror}).") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise BadInput(
            f"{path}: not a readable calibration ({error}); rerun `lpx calibrate`."
        ) from None
    if not isinstance(data, dict) or data.get("lpx_calibration") != CALIBRATION_FORMAT:
        raise BadInput(
            f"{path}: not an lpx calibration (`lpx_calibration: 1`); rerun lpx calibrate."
        )
    pairs = data.get("pairs")
    if not isinstance(pairs, dict) or not pairs or not all(_valid_floor(f) for f in pairs.values()):
        raise BadInput(f"{path}: its `pairs` are missing or malformed; rerun `lpx calibrate`.")
    return data


def side_precision(meta: dict) -> str:
    """float32, float16, bfloat16, or float32+tf32 when that side's fp32 used TF32."""
    dtype = str(meta.get("dtype") or "float32")
    tf32 = bool((meta.get("hardware") or {}).get("allow_tf32")) or bool(
        (meta.get("knobs") or {}).get("allow_tf32") is True
    )
    return TF32 if tf32 and dtype == "float32" else dtype


def pair_key(a: str, b: str) -> str:
    return "|".join(sorted((a, b)))


def usable(calibration: dict | None, fixture_meta: dict, replay_meta: dict) -> tuple[str, str]:
    """(pair key, "") when the calibration covers this comparison, else ("", why not)."""
    if calibration is None:
        return "", "no calibration given or found beside the replay (lpx calibrate)"
    weights = (fixture_meta.get("model") or {}).get("weights_fingerprint")
    calibrated = (calibration.get("key") or {}).get("model_fingerprint")
    if weights and calibrated and weights != calibrated:
        return "", (
            f"the calibration is for weights {calibrated[:19]}..., the fixture's are "
            f"{weights[:19]}...; calibrate this model"
        )
    pair = pair_key(side_precision(fixture_meta), side_precision(replay_meta))
    if pair not in calibration["pairs"]:
        return "", (
            f"the calibration measured {', '.join(sorted(calibration['pairs']))}, not {pair}; "
            "calibrate with both sides' dtypes (lpx calibrate --dtype)"
        )
    return pair, ""


def calibrated_judging(
    calibration: dict, pair: str, reference_logprob, positions, offsets, source: str
) -> Calibrated:
    """Per-token thresholds and the limits this batch's metrics meet under noise alone.

    ``reference_logprob`` buckets each token by surprisal (the replay's logprob), as the
    calibration bucketed its samples by the fp32 reference."""
    floor = calibration["pairs"][pair]
    surprisal = -np.asarray(reference_logprob, dtype=np.float64)
    expected = expect(floor, surprisal, positions)
    n = max(len(surprisal), 1)
    mean = float(expected["mean"].mean()) if len(surprisal) else 0.0
    mean_sq = float(expected["mean_sq"].mean()) if len(surprisal) else 0.0
    mean_expm1 = float(expected["mean_expm1"].mean()) if len(surprisal) else 0.0
    worst_cell = max((cell["max"] for cell in expected["cells"]), default=0.0)
    lengths = np.diff(offsets)
    # A short sequence's mean is noisier: its mean may reach the longest sampled run's max.
    seq_max = float(floor.get("sequence_mean_abs_max", mean))
    under_noise = {
        "mean_abs_diff": mean,
        "rms_diff": float(np.sqrt(mean_sq)),
        "p50_abs_diff": mixture_quantile(expected, 0.5),
        "p99_abs_diff": mixture_quantile(expected, 0.99),
        "p999_abs_diff": mixture_quantile(expected, 0.999),
        "max_abs_diff": worst_cell,
        "k2": 0.5 * mean_sq,
        "k3": max(mean_expm1 - mean, 0.0),
        "token_mult_prob_error": 1.0 + mean_expm1,
        "max_seq_mean_abs_diff": max(seq_max, mean * _short_sequence_factor(lengths)),
    }
    margins = {name: TAIL_MARGIN for name in ("p99_abs_diff", "p999_abs_diff", "max_abs_diff")}
    margins["max_seq_mean_abs_diff"] = TAIL_MARGIN
    limits = {}
    for name, value in under_noise.items():
        margin = margins.get(name, MEAN_MARGIN)
        if name == "token_mult_prob_error":
            limits[name] = 1.0 + margin * (value - 1.0)
        else:
            limits[name] = margin * value
    return Calibrated(
        pair=pair,
        tau=TAU_MARGIN * np.maximum(expected["q999"], 1e-12),
        expected_mean=expected["mean"],
        expected=under_noise,
        limits=limits,
        note={
            "used": True,
            "source": source,
            "pair": pair,
            "created_at": calibration.get("created_at"),
            "key": calibration.get("key"),
            "calibration_tokens": floor.get("tokens"),
            "compared_tokens": int(n),
            "expected_under_noise": under_noise,
            "margins": {"tau": TAU_MARGIN, "mean": MEAN_MARGIN, "tail": TAIL_MARGIN},
        },
    )


def effective_limits(profile_limits: dict, calibrated: dict, user_policy: bool) -> dict:
    """The limits a calibrated comparison is judged by. The bundled profiles' constants were
    set from small models: where the measured floor says this model's noise reaches further,
    the floor's limit replaces the constant. A limit the user set in a policy stands."""
    if user_policy:
        return dict(profile_limits)
    limits = dict(profile_limits)
    for name, value in calibrated.items():
        if name in limits:
            limits[name] = max(limits[name], value)
    return limits


def _short_sequence_factor(lengths: np.ndarray) -> float:
    """How far the shortest compared sequence's mean |d| can stray from the floor's mean
    (a mean over n tokens of a heavy-tailed |d|): 1 + 3 / sqrt(n)."""
    shortest = int(lengths[lengths > 0].min()) if (lengths > 0).any() else 1
    return 1.0 + 3.0 / np.sqrt(shortest)


def _valid_floor(floor) -> bool:
    return (
        isinstance(floor, dict)
        and isinstance(floor.get("all"), dict)
        and isinstance(floor.get("cells"), dict)
        and isinstance(floor.get("surprisal_edges"), list)
        and isinstance(floor.get("position_edges"), list)
    )
