"""`lpx run`: a plan's stages in order, each as its own process, recorded in the run manifest.

A stage that errors or times out keeps what finished: the replays after it still run, the
compare covers the replays that finished, and the run is recorded as an error run. With
``resume`` only the stages without their outputs (or not marked ok) run again, under a new
run id (the history keeps the error run it replaces and says which run it resumed).
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import click

from pipeline.errors import EXIT_BAD_INPUT, EXIT_PASS, EXIT_REGRESSION, BadInput, Interrupted
from pipeline.orchestrator.plan import Plan
from pipeline.orchestrator.runners import ServerFailed, make_runner
from pipeline.orchestrator.stages import LOGS, PROMPTS, URL, Stage, compare_stage, expand
from pipeline.paths import SpaceReserve, is_disk_full, output_lock, write_text_atomic
from pipeline.run_manifest import (
    add_stage,
    finish,
    new_manifest,
    read_manifest,
    write_manifest,
)

DISK_FULL = (os.strerror(errno.ENOSPC), os.strerror(errno.EDQUOT))
NEARLY_FULL_BYTES = 64 << 10


class VolumeFull(Exception):
    """The run directory's volume filled during ``stage``: every later stage would fail too."""

    def __init__(self, stage: str):
        super().__init__(stage)
        self.stage = stage


def run_plan(
    plan: Plan, plan_path: Path, run_dir: Path, resume: bool = False, runner_name: str = "local"
) -> int:
    run_dir = Path(run_dir).resolve()
    if resume and not (run_dir / "lpx-run.json").is_file():
        raise BadInput(f"--resume {run_dir}: no lpx-run.json there; resume a run `lpx run` made.")
    if not resume and run_dir.exists() and any(run_dir.iterdir()):
        raise BadInput(
            f"--out {run_dir}: exists and is not empty; choose a new run directory, or pass "
            "--resume to finish the run in it."
        )
    runner = make_runner(runner_name, gpus=plan.gpus)  # Docker unreachable: exit 2 before any work
    for stage in expand(plan):  # every image present (and its digest known) before any work
        runner.image(stage)
        if stage.server and stage.server.image:
            runner.image(replace(stage, image=stage.server.image))
    (run_dir / LOGS).mkdir(parents=True, exist_ok=True)
    with output_lock(run_dir):
        done = _finished_stages(run_dir) if resume else set()
        previous = read_manifest(run_dir) if resume else None
        manifest = new_manifest(plan.history.kind, f"lpx run {plan_path} --out {run_dir}")
        manifest["plan"] = {"name": plan.name, "path": str(plan_path), "runner": runner.name}
        if previous:
            manifest["resumed_from"] = previous["run_id"]
        write_manifest(run_dir, manifest)
        if plan.prompts == "bundled" and not (run_dir / PROMPTS).is_file():
            from pipeline.prompts import smoke_prompt_texts

            write_text_atomic(run_dir / PROMPTS, "\n".join(smoke_prompt_texts()) + "\n")
        reserve = SpaceReserve(run_dir)  # room to write the manifest if the volume fills
        full = None
        try:
            failed = _run_stages(plan, run_dir, manifest, done, runner)
        except VolumeFull as error:
            full, failed = error.stage, False
            reserve.release()
            _mark_not_run(plan, manifest, f"not run: the volume holding {run_dir} is full")
        finally:
            reserve.release()
            write_manifest(run_dir, finish(manifest))
    recorded = _record_and_report(plan, run_dir)
    if full:
        click.echo(
            f"run: ERROR in {full}: the volume holding {run_dir} is full; free space (or move "
            f"the run), then `lpx run {plan_path} --out {run_dir} --resume`; outputs kept there"
        )
        return EXIT_BAD_INPUT
    statuses = {stage["status"] for stage in manifest["stages"]}
    if "error" in statuses or not recorded:
        broken = [s["name"] for s in manifest["stages"] if s["status"] == "error"]
        click.echo(f"run: ERROR in {', '.join(broken) or 'record'}; outputs kept in {run_dir}")
        return EXIT_BAD_INPUT
    click.echo(f"run: {'FAIL' if failed else 'PASS'}; outputs in {run_dir}")
    return EXIT_REGRESSION if failed else EXIT_PASS


def _run_stages(plan: Plan, run_dir: Path, manifest: dict, done: set[str], runner) -> bool:
    """Run every stage; return whether the comparison failed its policy."""
    errored: set[str] = set()
    for stage in expand(plan):
        if stage.name in done and _has_outputs(run_dir, stage):
            _note(manifest, run_dir, stage, "ok", "kept from the resumed run")
            continue
        blocked = [n for n in stage.needs if n in errored]
        if blocked:
            errored.add(stage.name)
            _note(manifest, run_dir, stage, "error", f"not run: {', '.join(blocked)} failed")
            continue
        if _execute(stage, run_dir, plan.stage_timeout_s, manifest, runner) != "ok":
            errored.add(stage.name)
    finished = [r.name for r in plan.replays if f"replay-{r.name}" not in errored]
    if not finished:
        return False
    compare = compare_stage(plan, finished)
    if "compare" in done and _has_outputs(run_dir, compare) and not errored:
        _note(manifest, run_dir, compare, "ok", "kept from the resumed run")
        return False
    return _execute(compare, run_dir, plan.stage_timeout_s, manifest, runner) == "fail"


def _execute(stage: Stage, run_dir: Path, timeout_s: float, manifest: dict, runner) -> str:
    """Run one stage with ``runner`` (a process or a container); note how it ended."""
    log = run_dir / LOGS / f"{stage.name}.log"
    click.echo(f"[{stage.name}] lpx {' '.join(stage.argv)}", err=True)
    image = runner.image(stage)
    start = time.monotonic()
    server = None
    try:
        if stage.server:
            server_log = run_dir / LOGS / f"{stage.name}-server.log"
            url, server = runner.start_server(stage, run_dir, _model_of(stage, run_dir), server_log)
            click.echo(f"[{stage.name}] server up at {url}", err=True)
            stage = replace(stage, argv=[a.replace(URL, url) for a in stage.argv])
        code = runner.run(stage, run_dir, log, timeout_s)
    except OSError as error:  # the stage's log could not be written
        if not is_disk_full(error):
            raise
        _note(manifest, run_dir, stage, "error", f"{error.strerror}: {log}", None, image)
        raise VolumeFull(stage.name) from None
    except ServerFailed as error:
        _note(manifest, run_dir, stage, "error", str(error), time.monotonic() - start, image)
        return "error"
    except Interrupted:
        _note(manifest, run_dir, stage, "error", "interrupted", time.monotonic() - start, image)
        raise
    finally:
        if server is not None:
            runner.stop_server(server)
    if code is None:
        message = f"timed out after {timeout_s:g} s; raise stage_timeout_s in the plan"
        _note(manifest, run_dir, stage, "error", message, time.monotonic() - start, image)
        return "error"
    status = "ok" if code == 0 else stage.exit_1 if code == 1 else "error"
    message = "" if status == "ok" else _last_error(log, code)
    # A full volume also fails a stage that cannot say so (its log is full too): its exit
    # code then means nothing, so it is an error whatever the code.
    full = code != 0 and _volume_full(run_dir, message)
    if full:
        status, message = "error", f"{message}; the volume holding {run_dir} is full"
    _note(manifest, run_dir, stage, status, message, time.monotonic() - start, image)
    if full:
        raise VolumeFull(stage.name)
    return status


def _note(manifest, run_dir, stage: Stage, status, message="", seconds=None, image=None) -> None:
    extra = {"outputs": stage.outputs, "log": f"{LOGS}/{stage.name}.log", "image": image}
    if seconds is not None:
        extra["seconds"] = round(seconds, 2)
    add_stage(manifest, stage.name, status, message, **extra)
    try:
        write_manifest(run_dir, manifest)
    except OSError as error:
        if not is_disk_full(error):
            raise
        raise VolumeFull(stage.name) from None
    took = f" in {seconds:.1f} s" if seconds is not None else ""
    click.echo(f"[{stage.name}] {status}{took}{': ' + message if message else ''}", err=True)


def _volume_full(run_dir: Path, message: str) -> bool:
    """Whether a stage failed for want of space: its error says so, or, when it could not
    even write its log, the volume has next to nothing left."""
    said = any(text in message for text in DISK_FULL)
    return said or shutil.disk_usage(run_dir).free < NEARLY_FULL_BYTES


def _mark_not_run(plan: Plan, manifest: dict, message: str) -> None:
    noted = {stage["name"] for stage in manifest["stages"]}
    for name in [stage.name for stage in expand(plan)] + ["compare"]:
        if name not in noted:
            add_stage(manifest, name, "error", message)


def _last_error(log: Path, code: int) -> str:
    """The stage's own one-line error (lpx prints `Error: ...` last), else its exit code."""
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("Error:")]
    text = errors[-1] if errors else (lines[-1] if lines else "")
    return f"exit {code}: {text[:300]}" if text else f"exit {code}"


def _model_of(stage: Stage, run_dir: Path) -> Path:
    model = Path(stage.argv[stage.argv.index("--model") + 1])
    return model if model.is_absolute() else run_dir / model


def _finished_stages(run_dir: Path) -> set[str]:
    manifest = read_manifest(run_dir) or {}
    return {s["name"] for s in manifest.get("stages", []) if s.get("status") in ("ok", "fail")}


def _has_outputs(run_dir: Path, stage: Stage) -> bool:
    return all((run_dir / output).exists() for output in stage.outputs)


def _record_and_report(plan: Plan, run_dir: Path) -> bool:
    """Record the run (error runs included) and render the report, as their own processes."""
    db = ["--db", plan.history.db] if plan.history.db else []
    steps = [["record", str(run_dir), "--kind", plan.history.kind, *db]]
    if plan.history.report:
        steps.append(["report", *db, "--out", plan.history.report])
    for argv in steps:
        result = subprocess.run(
            [sys.executable, "-m", "pipeline", *argv], capture_output=True, text=True
        )
        output = (result.stdout + result.stderr).strip()
        if output:
            click.echo(output)
        if result.returncode != 0:
            click.echo(f"run: `lpx {' '.join(argv)}` failed (exit {result.returncode})", err=True)
            return False
    return True
