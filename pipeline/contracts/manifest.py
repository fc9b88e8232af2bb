"""lpx-run.json as `lpx record` reads it: a run's identity, times, testbed and how each stage
ended (written by pipeline/run_manifest.py; its version, kind and stage statuses are checked
there, with messages of their own). Fields lpx does not know are kept."""

from __future__ import annotations

from typing import Literal, Required

from pydantic import with_config
from typing_extensions import TypedDict

from pipeline.contracts.base import OPEN, Open
from pipeline.contracts.report import Testbed

RUN_STATUSES = ("running", "pass", "fail", "error")
STAGE_STATUSES = ("ok", "fail", "error")  # how a stage ended (pipeline/run_manifest.py)


@with_config(OPEN)
class StageImage(TypedDict, total=False):
    ref: str | None
    digest: str | None


@with_config(OPEN)
class Stage(TypedDict, total=False):
    name: Required[str]
    status: Required[Literal[STAGE_STATUSES]]
    message: str | None
    outputs: list | None
    image: StageImage | None
    # a stage whose failure leaves the run's verdict standing (localize), and its pair
    optional: bool | None
    skipped: bool | None
    pair: str | None


class RunManifest(Open):
    run_id: str
    kind: str | None = None
    trigger: str | None = None
    started_at: str | None = None
    ended_at: str | None = None
    command_line: str | None = None
    lpx_version: str | None = None
    lpx_revision: str | None = None
    status: Literal[RUN_STATUSES] | None = None
    testbed: Testbed | None = None
    stages: list[Stage] | None = None
    # a plan's names for its comparisons, by compare directory (docs/history.md): a named
    # comparison keeps its series when an upgrade reads a knob back differently
    cases: dict[str, str] | None = None
