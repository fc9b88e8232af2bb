"""Explain drift: test the semantic causes before calling anything numeric noise.

Each detector looks at one drifting sequence (its active completion tokens) and either
explains it, with evidence a person can check, or passes. Detectors run in order of how
specific their evidence is; the first that explains a sequence claims it. Batch-level
checks (weight fingerprints, dtype noise floor, uniform drift) then cover what is left.
Causes follow shared/notes/metrics.md.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field

import numpy as np

FAULT_CAUSES = ("token_shift", "mask_padding", "position_ids", "temperature", "stale_weights")
KNOWN_CAUSES = (*FAULT_CAUSES, "dtype", "unexplained")  # what a policy's fail_on_findings may name
# Fraction of a sequence's drifting tokens a signature must explain.
EXPLAINS = 0.75
MIN_TOKENS = 2
LIKELY_LOGPROB = float(np.log(0.3))
# Typical drift RMS when one side runs in a lower precision (shared/notes/metrics.md).
DTYPE_NOISE_CEILING = {"bfloat16": 0.1, "float16": 0.02, "float32": 1e-4}


@dataclass
class Finding:
    cause: str
    sequences: list[str]
    first_position: dict
    evidence: str
    severity: str = "fault"
    details: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class SequenceView:
    """One sequence's active completion tokens as the detectors see them."""

    sequence_id: str
    positions: np.ndarray
    rollout: np.ndarray
    train: np.ndarray
    weight_versions: np.ndarray | None
    tau: float

    def __post_init__(self):
        self.diff = self.train.astype(np.float64) - self.rollout.astype(np.float64)
        self.bad = np.abs(self.diff) > self.tau
        self.first_bad = int(np.argmax(self.bad)) if self.bad.any() else -1

    @property
    def first_bad_position(self) -> int:
        return int(self.positions[self.first_bad])

    def where(self) -> str:
        return f"seq {self.sequence_id} from position {self.first_bad_position}"


def diagnose(views: list[SequenceView], context: dict) -> list[Finding]:
    """Findings for all drifting sequences; ``context`` holds both sides' metadata and
    the batch reference weight version."""
    claimed: dict[str, list[tuple[SequenceView, str, dict]]] = {}
    unexplained = []
    for view in views:
        if view.first_bad < 0:
            continue
        for detector in SEQUENCE_DETECTORS:
            result = detector(view, context)
            if result:
                cause, evidence, details = result
                claimed.setdefault(cause, []).append((view, evidence, details))
                break
        else:
            unexplained.append(view)
    findings = [_merge(cause, hits) for cause, hits in claimed.items()]
    findings += _batch_findings(unexplained, views, context)
    return findings


# --- per-sequence detectors: return (cause, evidence, details) or None -----------------


def detect_token_shift(view: SequenceView, context: dict):
    bad = np.flatnonzero(view.bad)
    for shift in (1, -1):
        candidates = bad[(bad + shift >= 0) & (bad + shift < len(view.rollout))]
        if len(candidates) < MIN_TOKENS:
            continue
        fits = np.abs(view.train[candidates] - view.rollout[candidates + shift]) <= view.tau
        if fits.mean() >= EXPLAINS and fits.sum() >= MIN_TOKENS:
            return (
                "token_shift",
                f"shifted by {shift:+d} fits {fits.mean():.0%} of {view.where()}: the replay "
                f"logprob at position t equals the rollout logprob at t{shift:+d} "
                f"({int(fits.sum())}/{len(candidates)} drifting tokens); logprobs and tokens "
                "are off by one",
                {"shift": shift, "fit_fraction": float(fits.mean())},
            )
    return None


def detect_mask_padding(view: SequenceView, context: dict):
    bad = view.bad
    if bad.sum() < MIN_TOKENS:
        return None
    for side, values, other in (
        ("rollout", view.rollout, view.train),
        ("replay", view.train, view.rollout),
    ):
        constant, count = Counter(values[bad].tolist()).most_common(1)[0]
        distinct_other = len(np.unique(other[bad]))
        if count / bad.sum() >= EXPLAINS and count >= MIN_TOKENS and distinct_other > 1:
            return (
                "mask_padding",
                f"the {side} side holds the constant {constant:g} at {count}/{int(bad.sum())} "
                f"drifting tokens of {view.where()} while the other side varies: padding or "
                "masked tokens were treated as active; check the completion mask and pad handling",
                {"side": side, "fill_value": float(constant)},
            )
    return None


def detect_dtype_rounding(view: SequenceView, context: dict):
    bad = view.bad
    if bad.sum() < MIN_TOKENS:
        return None
    for side, values, other in (
        ("rollout", view.rollout, view.train),
        ("replay", view.train, view.rollout),
    ):
        for dtype, representable in (
            ("bfloat16", _bf16_representable),
            ("float16", _fp16_representable),
        ):
            if representable(values[bad]).all() and representable(other[bad]).mean() < 0.5:
                rms = float(np.sqrt(np.mean(view.diff[bad] ** 2)))
                return (
                    "dtype",
                    f"the {side} logprobs of {view.where()} are exactly representable in {dtype} "
                    f"at all {int(bad.sum())} drifting tokens and the other side's are not: "
                    f"they were rounded to {dtype} (drift RMS {rms:.3g})",
                    {"side": side, "dtype": dtype},
                )
    return None


def detect_weight_version(view: SequenceView, context: dict):
    reference = context.get("reference_weight_version")
    if view.weight_versions is None or reference is None:
        return None
    stale = view.weight_versions != reference
    if not stale.any():
        return None
    explained = (stale & view.bad).sum() / max(view.bad.sum(), 1)
    if explained < EXPLAINS:
        return None
    versions = sorted({str(v) for v in view.weight_versions[stale]})
    drift_stale = float(np.abs(view.diff[stale]).mean())
    drift_fresh = float(np.abs(view.diff[~stale]).mean()) if (~stale).any() else 0.0
    return (
        "stale_weights",
        f"{int(stale.sum())} tokens of {view.where()} were sampled under weight_version "
        f"{', '.join(versions)} while the batch is at {reference}; mean |d| on them "
        f"{drift_stale:.3g} vs {drift_fresh:.3g} on the others",
        {"stale_versions": versions, "reference": str(reference)},
    )


def detect_temperature(view: SequenceView, context: dict):
    """Raw vs processed logprobs, from the numbers alone.

    Processed logprobs are log p^(1/T) - log sum_j p_j^(1/T) (plus a log 1/S renormaliser
    under top-k/top-p). Two signatures, either suffices: the gap is linear in the logprob
    (peaked distributions, where the normaliser barely moves), or the likely tokens all
    move the same way (T < 1 and top-k/top-p raise them, T > 1 lowers them), where noise,
    other weights or position bugs move them both ways.
    """
    bad = view.bad
    if bad.sum() < 3 or context.get("weights_differ"):
        return None  # different weights can rescale logits too: the fingerprint says more
    rollout, train = view.rollout[bad].astype(np.float64), view.train[bad].astype(np.float64)
    found = _temperature_fit(rollout, train) or _sharpening(rollout, train)
    if found is None:
        return None
    summary, details = found
    return (
        "temperature",
        f"{summary} over the {int(bad.sum())} drifting tokens of {view.where()}: one side's "
        f"logprobs are processed (temperature/top-k/top-p) and the other's are raw"
        f"{_sampling_hint(context)}",
        details,
    )


def _temperature_fit(rollout: np.ndarray, train: np.ndarray):
    gap = rollout - train
    gap_slope, intercept = np.polyfit(train, gap, 1)
    residual = gap - (gap_slope * train + intercept)
    total = np.sum((gap - gap.mean()) ** 2)
    r2 = 1.0 - np.sum(residual**2) / total if total > 0 else 0.0
    slope = 1.0 + gap_slope
    # Sampling temperatures in use lie within [0.2, 5]; a slope outside means one side is
    # near-constant, which is not a temperature.
    if r2 < 0.8 or abs(gap_slope) < 0.05 or not 0.2 <= slope <= 5.0:
        return None
    summary = (
        f"rollout = {slope:.3f} x replay {intercept:+.3f} (R^2 of the gap {r2:.3f}, "
        f"temperature ~{1 / slope:.2f})"
    )
    return summary, {
        "slope": float(slope),
        "estimated_temperature": float(1 / slope),
        "r2": float(r2),
    }


def _sharpening(rollout: np.ndarray, train: np.ndarray):
    likely = (rollout + train) / 2 > LIKELY_LOGPROB
    if likely.sum() < 6:
        return None
    up = float(np.mean(rollout[likely] > train[likely]))
    if max(up, 1 - up) < 0.9:
        return None
    side = "rollout" if up >= 0.9 else "replay"
    summary = (
        f"on the {int(likely.sum())} likely tokens (p > {np.exp(LIKELY_LOGPROB):.2f}) the {side} "
        f"logprob is higher in {max(up, 1 - up):.0%} (the {side} distribution is sharpened: "
        "temperature < 1 or top-k/top-p renormalisation applied on that side only)"
    )
    return summary, {"sharpened_side": side, "agreement": max(up, 1 - up)}


def detect_temperature_metadata(view: SequenceView, context: dict):
    """The fit above needs spread in the logprobs; the run's own records can say it too."""
    hint = context.get("temperature_hint")
    if not hint:
        return None
    return (
        "temperature",
        f"{int(view.bad.sum())} drifting tokens in {view.where()}, and {hint}: raw vs processed "
        "logprobs (apply the same temperature/top-k/top-p on both sides)",
        {"from_metadata": True},
    )


def detect_position_onset(view: SequenceView, context: dict):
    before, after = view.bad[: view.first_bad], view.bad[view.first_bad :]
    if (
        context.get("weights_differ")
        or view.first_bad < MIN_TOKENS
        or after.mean() < 0.5
        or after.sum() < MIN_TOKENS
    ):
        return None
    # Low-precision noise also leaves a few confident tokens clean at the start; an onset
    # only counts when the drift after it stands above that dtype's noise.
    low_dtype = context.get("low_precision_dtype", "float32")
    rms_after = float(np.sqrt(np.mean(view.diff[view.first_bad :] ** 2)))
    if low_dtype != "float32" and rms_after <= DTYPE_NOISE_CEILING.get(low_dtype, 0.0):
        return None
    clean_max = float(np.abs(view.diff[: view.first_bad]).max())
    growth = _rank_correlation(np.arange(len(after)), np.abs(view.diff[view.first_bad :]))
    return (
        "position_ids",
        f"drift starts at position {view.first_bad_position} of seq {view.sequence_id} "
        f"(the {len(before)} tokens before are clean, max |d| {clean_max:.2g}) and stays on "
        f"({after.mean():.0%} of the {len(after)} later tokens over tau, rank correlation with "
        f"position {growth:+.2f}) with no weight-version change: position ids are offset from "
        "there (KV-cache, padding or packing position bug)",
        {"onset": view.first_bad_position, "growth_correlation": growth},
    )


SEQUENCE_DETECTORS = (
    detect_token_shift,
    detect_mask_padding,
    detect_dtype_rounding,
    detect_weight_version,
    detect_temperature,
    detect_temperature_metadata,
    detect_position_onset,
)


# --- batch-level findings ---------------------------------------------------------------


def _batch_findings(unexplained: list[SequenceView], views: list[SequenceView], context: dict):
    findings = []
    evidence = weights_evidence(context)
    if evidence:
        drift = (
            f"drift above tau in {len(unexplained)} sequences" if unexplained else "yet no drift"
        )
        findings.append(
            Finding(
                "stale_weights",
                [v.sequence_id for v in unexplained],
                _first(unexplained),
                f"{evidence} ({drift})",
                severity="fault" if unexplained else "info",
            )
        )
        return findings
    if not unexplained:
        return findings
    diff = np.concatenate([v.diff for v in unexplained])
    bad_fraction = float(np.mean(np.concatenate([v.bad for v in unexplained])))
    rms = float(np.sqrt(np.mean(diff**2)))
    low_dtype = context.get("low_precision_dtype", "float32")
    ceiling = DTYPE_NOISE_CEILING.get(low_dtype, 1e-4)
    ids = [v.sequence_id for v in unexplained]
    if low_dtype != "float32" and rms <= ceiling:
        findings.append(
            Finding(
                "dtype",
                ids,
                _first(unexplained),
                f"noise-like drift at the {low_dtype} floor in {len(ids)} sequences: RMS {rms:.3g} "
                f"(typical {low_dtype} ceiling {ceiling:g}), mean d {float(diff.mean()):+.2g}; "
                "no semantic cause fits (shift, mask, temperature, weights, positions tested)",
                severity="info",
                details={"dtype": low_dtype, "rms_diff": rms},
            )
        )
    elif len(unexplained) >= max(1, len(views) // 2) and bad_fraction >= 0.5:
        findings.append(
            Finding(
                "stale_weights",
                ids,
                _first(unexplained),
                f"large, uniform drift in {len(ids)}/{len(views)} sequences ({bad_fraction:.0%} of "
                f"their tokens over tau, RMS {rms:.3g}) from the first token on, with equal weight "
                "fingerprints on file: the engines likely hold different weights (stale policy "
                "version, wrong weight conversion or sharding)",
                details={"rms_diff": rms, "bad_fraction": bad_fraction},
            )
        )
    else:
        findings.append(
            Finding(
                "unexplained",
                ids,
                _first(unexplained),
                f"drift above tau in {len(ids)} sequences (RMS {rms:.3g}, {bad_fraction:.0%} of their "
                "tokens) that no known cause explains; inspect the worst tokens",
            )
        )
    return findings


def weights_evidence(context: dict) -> str | None:
    """Why the two sides' weights differ, from fingerprints, or None when nothing says so."""
    fixture_fp, replay_fp = context.get("fixture_weights"), context.get("replay_weights")
    if fixture_fp and replay_fp and fixture_fp != replay_fp:
        return (
            f"weights fingerprint differs: fixture {fixture_fp[:19]}... vs replay {replay_fp[:19]}...; "
            "the two sides hold different weights"
        )
    checkpoint, held = context.get("checkpoint_tensors"), context.get("held_tensors")
    if checkpoint and held and checkpoint != held:
        return (
            f"the replay engine holds weights ({held[:19]}...) that differ from the checkpoint it "
            f"loaded ({checkpoint[:19]}...), gathered from all its shards: the weight conversion, "
            "sharding or loading changed them"
        )
    return None


def _merge(cause: str, hits: list[tuple[SequenceView, str, dict]]) -> Finding:
    view, evidence, details = hits[0]
    more = f" (and {len(hits) - 1} more sequences)" if len(hits) > 1 else ""
    severity = "fault" if cause in FAULT_CAUSES else "info"
    return Finding(
        cause,
        [v.sequence_id for v, _, _ in hits],
        {"sequence_id": view.sequence_id, "position": view.first_bad_position},
        evidence + more,
        severity,
        details,
    )


def _first(views: list[SequenceView]) -> dict:
    if not views:
        return {}
    return {"sequence_id": views[0].sequence_id, "position": views[0].first_bad_position}


def _sampling_hint(context: dict) -> str:
    hint = context.get("temperature_hint")
    return f"; {hint}" if hint else ""


def _bf16_representable(values: np.ndarray) -> np.ndarray:
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    return (bits & 0xFFFF) == 0


def _fp16_representable(values: np.ndarray) -> np.ndarray:
    values = values.astype(np.float32)
    with np.errstate(over="ignore"):
        return values.astype(np.float16).astype(np.float32) == values


def _rank_correlation(x: np.ndarray, y: np.ndarray) -> float:
    if len(x) < 3 or np.all(y == y[0]):
        return 0.0
    rx, ry = np.argsort(np.argsort(x)), np.argsort(np.argsort(y))
    return float(np.corrcoef(rx, ry)[0, 1])
