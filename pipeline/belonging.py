"""Whether two things a command combines belong together: a fixture and the model that
re-scores it, a fixture and its calibration, a fixture and the report that picks its sequences.

Each check compares what both sides recorded and raises BadInput (exit 2) in one line naming
both and what to pass, unless the caller's explicit option allows the mismatch (re-scoring a
stale checkpoint on purpose). An allowed mismatch comes back as a small record for the output
to keep; a match, or nothing recorded to compare, comes back as None.

A fixture that records no weights fingerprint (a dump ingested without --model, a rollout
from a server lpx could not read weights from) cannot be checked: its model is taken as
given, since refusing it would make every such fixture need the mismatch option, which would
then be passed by habit and mean nothing. Pure, except that a model's fingerprint reads its
weight files (once per process and file state: ``model_weights``).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from pipeline.errors import BadInput
from pipeline.fingerprint import WEIGHT_PATTERNS, prompt_set_fingerprint, weights_fingerprint

if TYPE_CHECKING:
    from pipeline.contracts.calibration import Calibration
    from pipeline.contracts.report import Report

ALLOW_MODEL = "--allow-model-mismatch"
ALLOW_CALIBRATION = "--allow-calibration-mismatch"
ALLOW_REPORT = "--allow-report-mismatch"
# What weights_fingerprint returns for a directory without weight files: nothing to compare.
NO_FINGERPRINT = "none"

_fingerprints: dict[tuple, str] = {}


def check_model(
    fixture_meta: dict, fixture_path, model_dir: Path, allow: bool, option: str = "--model"
) -> dict | None:
    """Refuse ``model_dir`` (given as ``option``) when its weights are not the ones the
    fixture was rolled out with; with ``allow``, return {"fixture_weights", "model_weights",
    "model", "allowed": True} instead."""
    model = _mapping(_mapping(fixture_meta).get("model"))
    want = _fingerprint(model.get("weights_fingerprint"))
    if want is None:
        return None
    have = model_weights(Path(model_dir))
    if have == want:
        return None
    if allow:
        return {
            "fixture_weights": want,
            "model_weights": have,
            "model": str(model_dir),
            "allowed": True,
        }
    recorded = model.get("path")
    if isinstance(recorded, str) and recorded and _same_place(recorded, model_dir):
        raise BadInput(
            f"{fixture_path} records model {model_dir}, which now holds weights {short(have)}, "
            f"not the {short(want)} it was rolled out with; pass --model DIR with those weights, "
            f"or {ALLOW_MODEL} to re-score with these on purpose (a stale checkpoint)."
        )
    fixtures_model = f" ({recorded})" if isinstance(recorded, str) and recorded else ""
    raise BadInput(
        f"{option} {model_dir}: its weights ({short(have)}) are not the weights {fixture_path} "
        f"was rolled out with ({short(want)}); pass the fixture's model{fixtures_model}, or "
        f"{ALLOW_MODEL} to re-score with other weights on purpose (a stale checkpoint)."
    )


def check_calibration(
    fixture_meta: dict, fixture_path, calibration: Calibration, calibration_path, allow: bool
) -> dict | None:
    """Refuse a calibration measured on other weights than the fixture's (its
    ``key.model_fingerprint``); with ``allow``, return {"fixture_weights",
    "calibration_weights", "calibration", "allowed": True} instead."""
    want = _fingerprint(_mapping(_mapping(fixture_meta).get("model")).get("weights_fingerprint"))
    have = _fingerprint(calibration.key.model_fingerprint)
    if want is None or have is None or have == want:
        return None
    if allow:
        return {
            "fixture_weights": want,
            "calibration_weights": have,
            "calibration": str(calibration_path),
            "allowed": True,
        }
    raise BadInput(
        f"{calibration_path}: a calibration of weights {short(have)}, but {fixture_path} was "
        f"rolled out with {short(want)}; calibrate this model (lpx calibrate {fixture_path}), "
        f"or pass {ALLOW_CALIBRATION} to judge with it on purpose."
    )


def check_report(fixture, fixture_path, report: Report, report_path, allow: bool) -> dict | None:
    """Refuse a report.json that compared another fixture: other rollout weights, another
    prompt set, sequence ids this fixture lacks, or other tokens where it names its worst.
    ``fixture`` is a TokenTable. With ``allow``, return {"fixture", "report", "reason",
    "allowed": True} instead."""
    reason = report_mismatch(fixture, report)
    if reason is None:
        return None
    if allow:
        return {
            "fixture": str(fixture_path),
            "report": str(report_path),
            "reason": reason,
            "allowed": True,
        }
    compared = _mapping(report.metadata.get("fixture")).get("path")
    of = f" of {compared}" if isinstance(compared, str) and compared else ""
    raise BadInput(
        f"--report {report_path}: a comparison{of}, not of {fixture_path} ({reason}); pass "
        f"this fixture's report.json, or {ALLOW_REPORT} to pick sequences by it on purpose."
    )


def report_mismatch(fixture, report: Report) -> str | None:
    """Why ``report`` is not a comparison of ``fixture``, or None when nothing says so.
    Each field is compared only where the report has it: an older report lacks some."""
    compared = _mapping(report.metadata.get("fixture"))
    ours = _mapping(_mapping(fixture.metadata).get("model")).get("weights_fingerprint")
    theirs = _mapping(compared.get("model")).get("weights_fingerprint")
    if _fingerprint(ours) and _fingerprint(theirs) and ours != theirs:
        return f"its rollout weights are {short(theirs)}, the fixture's {short(ours)}"
    recorded, prompts = compared.get("prompt_set_fingerprint"), prompt_set_fingerprint(fixture)
    if isinstance(recorded, str) and recorded != prompts:
        return f"its prompt set is {short(recorded)}, the fixture's {short(prompts)}"
    index = fixture.index_of()
    rows = [*(report.sequences or []), *(report.worst or [])]
    named = [r["sequence_id"] for r in rows if "sequence_id" in r]
    missing = [str(s) for s in dict.fromkeys(named) if not isinstance(s, str) or s not in index]
    if missing:
        return f"its sequences {', '.join(repr(s) for s in missing[:3])} are not in the fixture"
    for row in report.worst or []:
        other = _other_token(fixture, index, row)
        if other is not None:
            return other
    return None


def model_weights(model_dir: Path) -> str:
    """weights_fingerprint(model_dir), read once per process while the weight files keep
    their names, sizes and modification times: hashing a large model takes minutes, and one
    command may check the same directory several times."""
    model_dir = Path(model_dir)
    files = sorted({p for pattern in WEIGHT_PATTERNS for p in model_dir.glob(pattern)})
    try:
        state = tuple((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files)
    except OSError:  # a file vanished between listing and stat: hash what is there now
        return weights_fingerprint(model_dir)
    key = (str(model_dir.resolve()), state)
    if key not in _fingerprints:
        _fingerprints[key] = weights_fingerprint(model_dir)
    return _fingerprints[key]


def short(fingerprint) -> str:
    """A fingerprint as people compare them by eye: its kind and 12 hex digits."""
    text = str(fingerprint)
    return text[:19] + "..." if len(text) > 19 else text


def _other_token(fixture, index: dict, row) -> str | None:
    """Why a worst-token row names another token than the fixture has there, or None."""
    if not isinstance(row, dict) or row.get("sequence_id") not in index:
        return None
    position, token = row.get("position"), row.get("token_id")
    if not _whole(position) or not _whole(token) or position < 0:
        return None
    region = row.get("region", "completion")
    ids, offsets = (
        (fixture.prompt_ids, fixture.prompt_offsets)
        if region == "prompt"
        else (fixture.completion_ids, fixture.completion_offsets)
    )
    at = index[row["sequence_id"]]
    start, end = int(offsets[at]), int(offsets[at + 1])
    if start + position >= end:
        return (
            f"its worst token of sequence {row['sequence_id']!r} is at {region} position "
            f"{position}, past the fixture's {end - start} {region} tokens"
        )
    held = int(ids[start + position])
    if held != token:
        return (
            f"its worst token of sequence {row['sequence_id']!r} at {region} position "
            f"{position} is token {token}, the fixture's is {held}"
        )
    return None


def _same_place(recorded: str, model_dir) -> bool:
    try:
        return Path(recorded).resolve() == Path(model_dir).resolve()
    except (OSError, RuntimeError, ValueError):  # a loop of links, a NUL in the path
        return False


def _fingerprint(value) -> str | None:
    return value if isinstance(value, str) and value and value != NO_FINGERPRINT else None


def _mapping(value) -> dict:
    return value if isinstance(value, dict) else {}


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
