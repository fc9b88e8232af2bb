"""Read a run directory for the history: its manifest and its compare outputs (single pairs
and matrices) as their contracts' models, and the stages that did not finish.

Nothing here touches the database, so a broken directory is refused (BadInput, exit 2)
before any transaction starts.

Each file is validated once and kept as its model with the values the file wrote
(``held_as_written``, pipeline.contracts.base): validation hands back every TypedDict part in its declared key order
and fills in a finding's defaults, while the history stores those parts verbatim and run
pages show them as written (a side's sampling and layout, the findings).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import orjson
from pydantic import ValidationError

from pipeline.contracts.base import held_as_written
from pipeline.contracts.files import LOCALIZE as LOCALIZE_FILE
from pipeline.contracts.files import LOCALIZE_DIR, REPORT, SEQUENCES, SUMMARY, TOKENS
from pipeline.contracts.manifest import RunManifest, Stage
from pipeline.contracts.problems import INT64_MAX, describe
from pipeline.contracts.report import Report, contradictions
from pipeline.errors import BadInput
from pipeline.history.localized import localize_contradictions, read_localize
from pipeline.run_manifest import MANIFEST, RUN_KINDS, read_manifest
from pipeline.testbed import describe_testbed

COMPARE_PARTS = (TOKENS, SEQUENCES, SUMMARY)  # written before report.json
MAX_DEPTH = 4
# What a run directory without lpx-run.json says of itself: nothing (every field unset).
NO_MANIFEST = RunManifest.model_construct(run_id="")


@dataclass
class PairInput:
    """One finished comparison: a single-pair report.json and the files beside it."""

    pair: str  # its directory relative to the run directory
    # validated (pipeline/contracts/report.py), its values as written: `diagnosis` holds the
    # findings as the file's dicts, unknown fields included
    report: Report
    report_path: Path
    tokens_path: Path | None
    # localize/localize.json beside the report, checked (contracts/localize.py)
    localize: dict | None = None
    localize_path: Path | None = None
    # {verdict: error|skipped, message}: lpx run's localize stage for this pair left no file
    localize_stage: dict | None = None


@dataclass
class RunInput:
    run_dir: Path
    key: str
    kind: str
    status: str  # pass | fail | error
    trigger: str
    started_at: datetime
    ended_at: datetime | None
    command_line: str
    lpx_version: str
    lpx_revision: str
    testbed: dict
    pairs: list[PairInput]
    manifest: RunManifest  # lpx-run.json, validated (NO_MANIFEST without one)
    errors: list[dict] = field(default_factory=list)
    # what runs.manifest stores: lpx-run.json as written ({} without one), with ``testbed``
    stored_manifest: dict = field(default_factory=dict)
    calibration: dict | None = None  # the run's calibration.json, kept for later nights


def collect_run(
    run_dir: Path,
    kind: str | None = None,
    trigger: str | None = None,
    error: str | None = None,
    testbed_name: str | None = None,
) -> RunInput:
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise BadInput(f"{run_dir}: no such run directory; pass the --out of lpx smoke/compare.")
    written = read_manifest(run_dir)
    manifest = NO_MANIFEST if written is None else _checked_manifest(written, run_dir / MANIFEST)
    pairs, unfinished = _find_reports(run_dir)
    stages = manifest.stages or []
    errors = [
        {"stage": stage.get("name", "?"), "message": stage.get("message", "")}
        for stage in stages
        if stage["status"] == "error" and not stage.get("optional")
    ]
    optional = {s["pair"]: s for s in stages if s.get("optional") and s.get("pair")}
    for pair in pairs:
        errors += _attach_localize(run_dir, pair, optional.get(pair.pair))
    errors += [
        {"stage": "compare", "message": f"{path}: compare did not finish (no report.json)"}
        for path in unfinished
    ]
    errors += [
        {
            "stage": "compare",
            "message": f"{p.report_path}: says pass, but {'; '.join(found)}; a report that "
            "contradicts itself is an error run, never a pass (rerun `lpx compare`)",
        }
        for p in pairs
        if (found := contradictions(p.report))
    ]
    if manifest.status == "running":
        errors.append({"stage": "run", "message": "the run never finished (manifest says running)"})
    if error:
        errors.append({"stage": "run", "message": error})
    if not pairs and not errors:
        raise BadInput(
            f"{run_dir}: no compare outputs (no {REPORT} in it or its subdirectories, no "
            f"{MANIFEST}); run `lpx compare ... --out {run_dir}/compare` first, or record a "
            "failed run with --error MESSAGE."
        )
    kind = kind or manifest.kind or "manual"
    if kind not in RUN_KINDS:
        raise BadInput(f"--kind {kind!r}: use one of {', '.join(RUN_KINDS)}.")
    testbed = dict(
        manifest.testbed
        or (pairs[0].report.metadata.get("testbed") if pairs else None)
        or describe_testbed()
    )
    if testbed_name:
        testbed["name"] = testbed_name
    reports = [p.report_path for p in pairs]
    started, ended = _times(manifest, run_dir, reports)
    first = pairs[0].report.metadata if pairs else {}
    versions = ((first.get("replay") or {}).get("engine") or {}).get("versions") or {}
    status = (
        "error" if errors else "fail" if any(p.report.verdict != "pass" for p in pairs) else "pass"
    )
    return RunInput(
        run_dir=run_dir,
        key=_run_key(manifest, pairs, errors, run_dir),
        kind=kind,
        status=status,
        trigger=trigger or manifest.trigger or "manual",
        started_at=started,
        ended_at=ended,
        command_line=str(manifest.command_line or first.get("command_line") or ""),
        lpx_version=str(manifest.lpx_version or versions.get("lpx") or "unknown"),
        lpx_revision=str(manifest.lpx_revision or "unknown"),
        testbed=testbed,
        pairs=pairs,
        errors=errors,
        manifest=manifest,
        stored_manifest={**(written or {}), "testbed": testbed},
        calibration=_calibration(run_dir),
    )


def _checked_manifest(written: dict, path: Path) -> RunManifest:
    try:
        RunManifest.model_validate(written)
    except ValidationError as error:
        raise BadInput(
            f"{path}: {describe(error, count=3)}; fix or delete it to record the run from its "
            "reports alone. Nothing was recorded."
        ) from None
    return held_as_written(RunManifest, written)


def _attach_localize(run_dir: Path, pair: PairInput, stage: Stage | None) -> list[dict]:
    """Give ``pair`` its localize.json (refused when malformed); a self-contradicting one is
    left out and returned as an error, so the run is an error run. Without a file, the
    pair's lpx run stage says whether it errored or was skipped."""
    path = run_dir / pair.pair / LOCALIZE_DIR / LOCALIZE_FILE
    if path.is_file():
        result = read_localize(path)
        found = localize_contradictions(result)
        if found:
            return [
                {
                    "stage": "localize",
                    "message": f"{path}: {'; '.join(found)}; a localize result that "
                    "contradicts itself is not stored (rerun `lpx localize` for this pair)",
                }
            ]
        pair.localize, pair.localize_path = result, path
    elif stage is not None and (stage["status"] == "error" or stage.get("skipped")):
        verdict = "error" if stage["status"] == "error" else "skipped"
        pair.localize_stage = {"verdict": verdict, "message": str(stage.get("message") or "")}
    return []


def _calibration(run_dir: Path) -> dict | None:
    """The run directory's calibration.json (lpx calibrate), validated like compare does. A
    run recorded before the precision gate holds one of format 1: the run is still recorded,
    without it (no later night could reuse it)."""
    import json

    from pipeline.compare.calibrated import CALIBRATION_FILE, read_calibration

    path = run_dir / CALIBRATION_FILE
    if not path.is_file():
        return None
    try:
        if json.loads(path.read_text(encoding="utf-8")).get("lpx_calibration") == 1:
            return None
    except (OSError, ValueError, AttributeError):
        pass  # read_calibration names what is wrong with it
    return read_calibration(path)


def _find_reports(run_dir: Path) -> tuple[list[PairInput], list[Path]]:
    """Every single-pair report under ``run_dir`` (a matrix report's rows live in their own
    subdirectories and are found there), plus compare directories that never finished."""
    pairs, unfinished = [], []
    for directory, files in sorted(_walk(run_dir), key=lambda found: found[0]):
        if REPORT in files:
            report_path = directory / REPORT
            report = _load_report(report_path)
            if report is None:
                continue  # a matrix: its pairs are single reports in subdirectories
            if report.sequence_table is not None and SEQUENCES not in files:
                raise BadInput(
                    f"{directory / SEQUENCES}: missing; {REPORT} beside it keeps its "
                    "per-sequence rows there. Copy it with the report, or rerun `lpx compare` "
                    "for this directory; nothing was recorded."
                )
            pairs.append(
                PairInput(
                    pair=str(directory.relative_to(run_dir)) if directory != run_dir else ".",
                    report=report,
                    report_path=report_path,
                    tokens_path=directory / TOKENS if TOKENS in files else None,
                )
            )
        elif any(part in files for part in COMPARE_PARTS):
            unfinished.append(directory)
    return pairs, unfinished


def _walk(root: Path, depth: int = 0):
    """(directory, the names of its regular files) for ``root`` and the directories under
    it, hidden ones left out. One scandir a directory tells both apart without a stat an
    entry (a year's import looks at 18,000 directories)."""
    try:
        with os.scandir(root) as entries:
            children, files = [], set()
            for entry in entries:
                if entry.is_file():
                    files.add(entry.name)
                elif (
                    depth < MAX_DEPTH
                    and entry.is_dir(follow_symlinks=False)
                    and not entry.name.startswith(".")
                ):
                    children.append(Path(entry.path))
    except OSError as error:
        raise BadInput(f"{root}: cannot list the directory ({error.strerror}).") from None
    yield root, files
    for child in children:
        yield from _walk(child, depth + 1)


def _load_report(path: Path) -> Report | None:
    """The report, validated and held as written (None for a matrix)."""
    try:
        report = _parse_json(path.read_bytes())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise BadInput(
            f"{path}: corrupt report ({error}); rerun `lpx compare` for this directory or remove "
            "it. Nothing was recorded."
        ) from None
    if not isinstance(report, dict):
        raise BadInput(f"{path}: a report must be a JSON object; nothing was recorded.")
    if "pairs" in report:
        return None
    try:
        Report.model_validate(report)
    except ValidationError as error:
        raise BadInput(
            f"{path}: not an lpx compare report as `lpx record` reads it: "
            f"{describe(error, count=3)}. Rerun `lpx compare` for this directory (or fix the "
            "file); nothing was recorded."
        ) from None
    return held_as_written(Report, report)


def _parse_json(data: bytes):
    """orjson (several times faster over a year of reports); the standard parser for JSON
    that writes NaN/Infinity literals, which orjson refuses. Integers past 64 bits become
    floats either way, so an id or count that large fails its integer check instead of
    overflowing the database."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return json.loads(data.decode(), parse_constant=_constant, parse_int=_integer)


def _integer(digits: str) -> int | float:
    value = int(digits)
    return value if -INT64_MAX - 1 <= value <= INT64_MAX else float(value)


def _constant(name: str) -> float:
    return {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}[name]


def _run_key(
    manifest: RunManifest, pairs: list[PairInput], errors: list[dict], run_dir: Path
) -> str:
    """The manifest's run id, else a digest of the reports: recording the same outputs twice
    is one run."""
    if manifest.run_id:
        return hashlib.sha256(f"run:{manifest.run_id}".encode()).hexdigest()
    digest = hashlib.sha256(b"reports:")
    for pair in pairs:
        digest.update(pair.pair.encode() + b"\0" + pair.report_path.read_bytes() + b"\0")
    if not pairs:  # an error run with nothing to hash: its directory and its errors
        digest.update(str(run_dir.resolve()).encode())
        digest.update(json.dumps(errors, sort_keys=True).encode())
    return digest.hexdigest()


def _times(
    manifest: RunManifest, run_dir: Path, reports: list[Path]
) -> tuple[datetime, datetime | None]:
    started = _parse_time(manifest.started_at, run_dir / MANIFEST)
    ended = _parse_time(manifest.ended_at, run_dir / MANIFEST)
    if started is None:
        # No manifest: the run started with its oldest file and ended with its last report.
        files = [p for p in run_dir.rglob("*") if p.is_file()] or [run_dir]
        started = _utc_from_timestamp(min(p.stat().st_mtime for p in files))
        if reports:
            ended = _utc_from_timestamp(max(p.stat().st_mtime for p in reports))
    return started, ended


def _parse_time(value, where: Path) -> datetime | None:
    if value in (None, ""):
        return None
    try:
        parsed = datetime.fromisoformat(str(value))
    except ValueError:
        raise BadInput(
            f"{where}: time {value!r} is not ISO 8601 (e.g. 2026-11-22T03:00:00)."
        ) from None
    if parsed.tzinfo is not None:
        parsed = parsed.astimezone(UTC).replace(tzinfo=None)
    return parsed


def _utc_from_timestamp(seconds: float) -> datetime:
    return datetime.fromtimestamp(seconds, UTC).replace(tzinfo=None)
