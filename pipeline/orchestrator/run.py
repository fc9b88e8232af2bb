"""`lpx run`: a plan's stages in order, each as its own process, recorded in the run manifest.

A stage that errors or times out keeps what finished: the replays after it still run, the
compare covers the replays that finished, and the run is recorded as an error run that ends
with one `Error:` line naming the stage, its log and the --resume that finishes it. A fault
every later stage would meet too (a full volume, a Docker daemon that went away) stops the
run at that stage. With ``resume`` only the stages without their outputs (or not marked ok)
run again, under a new run id (the history keeps the error run it replaces and says which
run it resumed).
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import click

from pipeline.contracts.files import MANIFEST
from pipeline.errors import EXIT_PASS, EXIT_REGRESSION, BadInput, Interrupted
from pipeline.orchestrator.localize_stages import failing_pairs, localize_images, localize_stage
from pipeline.orchestrator.outside import check_outside_paths
from pipeline.orchestrator.plan import Plan
from pipeline.orchestrator.runners import DockerLost, StageFailed, make_runner
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


class RunStopped(Exception):
    """Something every later stage needs went away during ``stage`` (the run directory's
    volume filled, the Docker daemon stopped answering): the run stops there."""

    def __init__(self, stage: str, reason: str, advice: str):
        super().__init__(stage, reason, advice)
        self.stage, self.reason, self.advice = stage, reason, advice


def _volume_full(stage: str, run_dir: Path) -> RunStopped:
    return RunStopped(
        stage, f"the volume holding {run_dir} is full", "free space (or move the run)"
    )


def run_plan(
    plan: Plan, plan_path: Path, run_dir: Path, resume: bool = False, runner_name: str = "local"
) -> int:
    run_dir = Path(run_dir).resolve()
    if resume and not (run_dir / MANIFEST).is_file():
        raise BadInput(f"--resume {run_dir}: no lpx-run.json there; resume a run `lpx run` made.")
    if not resume and run_dir.exists() and any(run_dir.iterdir()):
        raise BadInput(
            f"--out {run_dir}: exists and is not empty; choose a new run directory, or pass "
            "--resume to finish the run in it."
        )
    check_outside_paths(plan, plan_path)  # a missing checkpoint: exit 2 before any work
    runner = make_runner(runner_name, gpus=plan.gpus)  # Docker unreachable: exit 2 before any work
    # every image present (and its digest known) before any work
    for stage in expand(plan) + localize_images(plan):
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
        stopped = None
        try:
            failed = run_stages(plan, run_dir, manifest, done, runner)
        except RunStopped as error:
            stopped, failed = error, False
            reserve.release()
            _mark_not_run(plan, manifest, f"not run: {error.reason}")
        finally:
            reserve.release()
            write_manifest(run_dir, finish(manifest))
    not_recorded = _record_and_report(plan, run_dir)
    resume = f"`lpx run {plan_path} --out {run_dir} --resume`"
    if stopped:
        log = run_dir / LOGS / f"{stopped.stage}.log"
        raise BadInput(
            f"stage {stopped.stage}: {stopped.reason} (log: {log}); {stopped.advice}, then "
            f"{resume}; outputs kept in {run_dir}{_also(not_recorded)}."
        )
    broken = [s for s in manifest["stages"] if s["status"] == "error" and not s.get("optional")]
    if broken:
        raise BadInput(_stage_error(broken, run_dir, resume) + _also(not_recorded) + ".")
    if not_recorded:
        raise BadInput(
            f"the run finished ({'FAIL' if failed else 'PASS'}, outputs in {run_dir}) but "
            f"{not_recorded}."
        )
    click.echo(
        f"run: {'FAIL' if failed else 'PASS'}; outputs in {run_dir}{_optional_errors(manifest)}"
    )
    return EXIT_REGRESSION if failed else EXIT_PASS


def _stage_error(broken: list[dict], run_dir: Path, resume: str) -> str:
    """The first failed stage (the others mostly follow from it), its message and log."""
    first = broken[0]
    message = first["message"].replace(": Error: ", ": ").rstrip(".")
    others = [s["name"] for s in broken[1:] if not s["message"].startswith("not run")]
    also = f" ({', '.join(others)} failed too)" if others else ""
    skipped = sum(s["message"].startswith("not run") for s in broken)
    later = f"; {skipped} later stage(s) did not run" if skipped else ""
    log = f"; log: {run_dir / first['log']}" if first.get("log") else ""
    return (
        f"stage {first['name']} failed{also}: {message}{log}{later}; fix it, then {resume} "
        "(finished stages are kept)"
    )


def _optional_errors(manifest: dict) -> str:
    names = [s["name"] for s in manifest["stages"] if s.get("optional") and s["status"] == "error"]
    if not names:
        return ""
    return f" ({', '.join(names)} failed, the comparison's results are kept; see logs/)"


def _also(not_recorded: str | None) -> str:
    return f"; and {not_recorded}" if not_recorded else ""


def run_stages(plan: Plan, run_dir: Path, manifest: dict, done: set[str], runner) -> bool:
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
        if execute_stage(stage, run_dir, plan.stage_timeout_s, manifest, runner) != "ok":
            errored.add(stage.name)
    finished = [r for r in plan.replays if f"replay-{r.name}" not in errored]
    if not finished:
        return False
    compare = compare_stage(plan, [r.name for r in finished])
    if "compare" in done and _has_outputs(run_dir, compare) and not errored:
        _note(manifest, run_dir, compare, "ok", "kept from the resumed run")
        return False
    status = execute_stage(compare, run_dir, plan.stage_timeout_s, manifest, runner)
    if status == "fail" and plan.localize is not None:
        _localize(plan, run_dir, manifest, done, runner, finished)
    return status == "fail"


def _localize(plan: Plan, run_dir: Path, manifest: dict, done: set[str], runner, finished):
    """`lpx localize` for each pair the comparison failed; an error or a skip is noted on
    the stage and the next pair still runs."""
    for replay, pair_dir in failing_pairs(run_dir, finished):
        stage = localize_stage(plan, replay, pair_dir)
        if isinstance(stage, str):
            skipped = Stage(f"localize-{replay.name}", [], [], optional=True, pair=pair_dir)
            _note(manifest, run_dir, skipped, "ok", stage, skipped=True)
        elif stage.name in done and _has_outputs(run_dir, stage):
            _note(manifest, run_dir, stage, "ok", "kept from the resumed run")
        else:
            execute_stage(stage, run_dir, plan.stage_timeout_s, manifest, runner)


def execute_stage(stage: Stage, run_dir: Path, timeout_s: float, manifest: dict, runner) -> str:
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
    except DockerLost as error:
        _note(manifest, run_dir, stage, "error", str(error), time.monotonic() - start, image)
        raise RunStopped(
            stage.name,
            f"the Docker daemon stopped answering during {stage.name}",
            "start dockerd (or check DOCKER_HOST)",
        ) from None
    except OSError as error:  # the stage's log could not be written
        if not is_disk_full(error):
            raise
        _note(manifest, run_dir, stage, "error", f"{error.strerror}: {log}", None, image)
        raise _volume_full(stage.name, run_dir) from None
    except StageFailed as error:  # a server that failed, a container killed for memory
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
    full = code != 0 and _is_volume_full(run_dir, message)
    if full:
        status, message = "error", f"{message}; the volume holding {run_dir} is full"
    _note(manifest, run_dir, stage, status, message, time.monotonic() - start, image)
    if full:
        raise _volume_full(stage.name, run_dir)
    return status


def _note(
    manifest, run_dir, stage: Stage, status, message="", seconds=None, image=None, **flags
) -> None:
    extra = {"outputs": stage.outputs, "log": f"{LOGS}/{stage.name}.log", "image": image}
    if stage.optional:
        extra |= {"optional": True, "pair": stage.pair, **flags}
    if seconds is not None:
        extra["seconds"] = round(seconds, 2)
    add_stage(manifest, stage.name, status, message, **extra)
    try:
        write_manifest(run_dir, manifest)
    except OSError as error:
        if not is_disk_full(error):
            raise
        raise _volume_full(stage.name, run_dir) from None
    took = f" in {seconds:.1f} s" if seconds is not None else ""
    click.echo(f"[{stage.name}] {status}{took}{': ' + message if message else ''}", err=True)


def _is_volume_full(run_dir: Path, message: str) -> bool:
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
    """The stage's own one-line error (lpx prints `Error: ...` last), else its exit code and
    last line; a stage killed by a signal says so."""
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("Error:")]
    text = errors[-1] if errors else (lines[-1] if lines else "")
    killed = _signal_of(code)
    if killed and not errors:
        last = f"; its last output: {text}" if text else ""
        text = f"killed by {killed} from outside (an OOM killer, a stop, a restart){last}"
    return f"exit {code}: {text[:300]}" if text else f"exit {code}"


def _signal_of(code: int) -> str | None:
    """The signal that ended a stage: a process's -N, or a container's 128 + N."""
    number = -code if code < 0 else code - 128 if code in (128 + 9, 128 + 15) else None
    return signal.Signals(number).name if number else None


def _model_of(stage: Stage, run_dir: Path) -> Path:
    model = Path(stage.argv[stage.argv.index("--model") + 1])
    return model if model.is_absolute() else run_dir / model


def _finished_stages(run_dir: Path) -> set[str]:
    manifest = read_manifest(run_dir) or {}
    return {s["name"] for s in manifest.get("stages", []) if s.get("status") in ("ok", "fail")}


def _has_outputs(run_dir: Path, stage: Stage) -> bool:
    return all((run_dir / output).exists() for output in stage.outputs)


def _record_and_report(plan: Plan, run_dir: Path) -> str | None:
    """Record the run (error runs included) and render the report, as their own processes;
    None when both went well, else what failed and how to redo it."""
    db = ["--db", plan.history.db] if plan.history.db else []
    steps = [["record", str(run_dir), "--kind", plan.history.kind, *db]]
    if plan.history.report:
        steps.append(["report", *db, "--out", plan.history.report])
    for argv in steps:
        result = subprocess.run(
            [sys.executable, "-m", "pipeline", *argv], capture_output=True, text=True
        )
        if result.stdout.strip():
            click.echo(result.stdout.strip())
        if result.returncode != 0:
            # its own Error: line becomes part of ours: the run ends with one
            lines = [line for line in result.stderr.splitlines() if line.strip()]
            said = [line.removeprefix("Error: ") for line in lines if line.startswith("Error:")]
            why = said[-1] if said else (lines[-1] if lines else f"exit {result.returncode}")
            return f"`lpx {' '.join(argv)}` failed ({why.rstrip('.')}); run it again once fixed"
    return None
