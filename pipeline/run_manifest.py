"""The run manifest, `lpx-run.json`: what a run directory holds and how its stages ended.

Written by `lpx smoke` (and any orchestrator) as stages finish, read by `lpx record`. It
gives the run its identity (``run_id``, the history's idempotency key), kind, trigger, times,
testbed and stage statuses, so a run whose stages failed is recorded as an error run rather
than lost. Format: docs/history.md.
"""

from __future__ import annotations

import json
import os
import subprocess
import uuid
from datetime import UTC, datetime
from pathlib import Path

from pipeline import __version__
from pipeline.contracts.files import MANIFEST
from pipeline.contracts.manifest import STAGE_STATUSES
from pipeline.errors import BadInput
from pipeline.paths import write_text_atomic
from pipeline.testbed import describe_testbed

MANIFEST_VERSION = 1
RUN_KINDS = ("nightly", "smoke", "manual")


def utc_now() -> str:
    return datetime.now(UTC).replace(tzinfo=None).isoformat(timespec="seconds")


def lpx_revision() -> str:
    """The git revision lpx runs from: LPX_REVISION (set in images), else git, else unknown."""
    if os.environ.get("LPX_REVISION"):
        return os.environ["LPX_REVISION"]
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"],
            cwd=Path(__file__).parent,
            capture_output=True,
            text=True,
            timeout=5,
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else "unknown"


def detect_trigger() -> str:
    """schedule/push/... on GitHub Actions, 'ci' on another CI, else 'manual'."""
    if os.environ.get("LPX_TRIGGER"):
        return os.environ["LPX_TRIGGER"]
    if os.environ.get("GITHUB_EVENT_NAME"):
        return os.environ["GITHUB_EVENT_NAME"]
    return "ci" if os.environ.get("CI", "").lower() in ("1", "true", "yes") else "manual"


def new_manifest(kind: str, command_line: str) -> dict:
    return {
        "lpx_run": MANIFEST_VERSION,
        "run_id": uuid.uuid4().hex,
        "kind": kind,
        "trigger": detect_trigger(),
        "started_at": utc_now(),
        "ended_at": None,
        "command_line": command_line,
        "lpx_version": __version__,
        "lpx_revision": lpx_revision(),
        "testbed": describe_testbed(),
        "stages": [],
        "status": "running",
    }


def add_stage(manifest: dict, name: str, status: str, message: str = "", **extra) -> None:
    manifest["stages"].append(
        {"name": name, "status": status, "message": message, "ended_at": utc_now(), **extra}
    )


def finish(manifest: dict) -> dict:
    # An optional stage (a plan's localize on a failing pair) that errs keeps its message in
    # its entry but never turns the run into an error run: the comparisons' verdicts stand.
    statuses = {stage["status"] for stage in manifest["stages"] if not stage.get("optional")}
    manifest["status"] = (
        "error" if "error" in statuses else "fail" if "fail" in statuses else "pass"
    )
    manifest["ended_at"] = utc_now()
    return manifest


def write_manifest(run_dir: Path, manifest: dict) -> Path:
    """Atomically (re)write the manifest: a reader never sees half of it."""
    path = Path(run_dir) / MANIFEST
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps(manifest, indent=1, default=str) + "\n")
    return path


def read_manifest(run_dir: Path) -> dict | None:
    """The manifest of a run directory, None when there is none; a broken one is refused."""
    path = Path(run_dir) / MANIFEST
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise BadInput(
            f"{path}: not a readable run manifest ({error}); fix or delete it to record the "
            "run from its reports alone."
        ) from None
    if not isinstance(manifest, dict) or manifest.get("lpx_run") != MANIFEST_VERSION:
        raise BadInput(f"{path}: expected an lpx run manifest with `lpx_run: 1` (docs/history.md).")
    if not isinstance(manifest.get("run_id"), str) or not manifest["run_id"].strip():
        raise BadInput(f"{path}: `run_id` must be a non-empty string.")
    stages = manifest.get("stages", [])
    if not isinstance(stages, list) or not all(
        isinstance(s, dict) and s.get("status") in STAGE_STATUSES for s in stages
    ):
        raise BadInput(
            f"{path}: `stages` must be a list of {{name, status: ok|fail|error, message}}."
        )
    if manifest.get("kind") is not None and manifest["kind"] not in RUN_KINDS:
        raise BadInput(f"{path}: `kind` must be one of {', '.join(RUN_KINDS)}.")
    return manifest
