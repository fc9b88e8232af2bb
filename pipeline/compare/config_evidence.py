"""The model configs the two sides recorded, as evidence: where they read a logprob-relevant
key differently (RoPE and its scaling, the window and which layers have it, eps, soft-caps,
a tied head, quantization_config), the comparison says so before anything is re-scored, as
a `model_config` finding naming the keys and both values.

Where the sides drift beyond precision, that finding takes the drifting sequences, and the
claims the weights fingerprints on file leave no room for (other weights, a weight version
change, "unexplained") fold into it: equal weights read under two configs is what the
evidence shows. Where they do not drift, the difference is said and never judged (a window
longer than every sequence changes nothing). Verification then re-scores the recorded
difference (pipeline/verify/families/model_config.py). Pure."""

from __future__ import annotations

from pipeline.contracts.causes import Cause, Severity, Status
from pipeline.contracts.report import Finding
from pipeline.model_config import config_differences, described

# claims that equal weight fingerprints and a recorded config difference explain better
FOLDED = (Cause.STALE_WEIGHTS, Cause.WEIGHTS_DIFFER, Cause.VERSION_CHANGE, Cause.UNEXPLAINED)


def recorded_differences(fixture_meta: dict, replay_meta: dict) -> list[dict]:
    """The keys the two sides' recorded configs read differently ([] where either recorded
    none: a dump, a report from before lpx recorded configs)."""
    return config_differences(_config(fixture_meta), _config(replay_meta))


def with_config_evidence(
    findings: list[Finding], fixture_meta: dict, replay_meta: dict
) -> list[Finding]:
    """The findings with a `model_config` finding where the recorded configs differ."""
    differences = recorded_differences(fixture_meta, replay_meta)
    if not differences:
        return findings
    sources = {
        "rollout": _model(fixture_meta).get("config_read_from", "file"),
        "replay": _model(replay_meta).get("config_read_from", "file"),
    }
    files = {
        "rollout": _model(fixture_meta).get("config_files") or {},
        "replay": _model(replay_meta).get("config_files") or {},
    }
    same_weights = _same_weights(fixture_meta, replay_meta)
    drifting = [f for f in findings if f.is_fault and f.sequences]
    folded = [f for f in drifting if same_weights and f.cause in FOLDED]
    kept = [f for f in findings if not any(f is g for g in folded)]
    sequences = sorted({s for f in drifting for s in f.sequences})
    details = {
        "differences": differences,
        "read_from": sources,
        "config_files": files,
        "folded": [str(f.cause) for f in folded],
    }
    said = described(differences)
    read = ", ".join(f"{side} from its {where}" for side, where in sources.items())
    if not sequences:
        return [
            *kept,
            Finding(
                cause=Cause.MODEL_CONFIG,
                severity=Severity.INFO,
                status=Status.PLAUSIBLE,
                evidence=(
                    f"the two sides recorded different model configs ({said}; {read}), yet "
                    "their logprobs agree within precision on these tokens: the keys may not "
                    "matter at these lengths"
                ),
                details=details,
            ),
        ]
    first = min(
        (f.first_position for f in drifting if f.first_position),
        key=lambda p: p.get("position", 0),
        default={},
    )
    finding = Finding(
        cause=Cause.MODEL_CONFIG,
        sequences=sequences,
        first_position=first,
        evidence=(
            f"the two sides computed with different model configs: {said} ({read}); "
            + (
                "both loaded the same weights (fingerprints equal), so "
                + ", ".join(sorted({str(c) for c in details["folded"]}))
                + " is what the configs explain"
                if folded
                else "the weights fingerprints do not say both sides held the same weights"
                if not same_weights
                else "re-scoring the reference under the recorded difference tells whether it "
                "is the whole drift"
            )
        ),
        details=details,
    )
    return [finding, *kept]


def _same_weights(fixture_meta: dict, replay_meta: dict) -> bool:
    a = _model(fixture_meta).get("weights_fingerprint")
    b = _model(replay_meta).get("weights_fingerprint")
    return bool(a) and a == b and a != "none"


def _model(meta: dict) -> dict:
    model = (meta or {}).get("model")
    return model if isinstance(model, dict) else {}


def _config(meta: dict) -> dict | None:
    config = _model(meta).get("config")
    return config if isinstance(config, dict) else None
