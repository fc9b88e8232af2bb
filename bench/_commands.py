"""The one way bench/ runs an `lpx` command: whole, in a process of its own, as a user runs
it (Python start, imports and exit included), and timed."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from _bootstrap import ROOT


def run_lpx(
    *args,
    timed: bool = True,
    python: Path | str | None = None,
    checkout: Path | None = None,
    cwd: Path | None = None,
    env: dict | None = None,
    log: Path | None = None,
):
    """`python -m pipeline ARGS`: this environment's Python unless ``python`` names another,
    this checkout's `pipeline/` unless ``checkout`` names another, ``env`` over the current
    environment. Output is captured as text, or written to ``log`` (stdout and stderr
    together). Returns ``(seconds, CompletedProcess)``, or the CompletedProcess alone when
    ``timed`` is false; the caller decides which exit codes it accepts."""
    command = [str(python or sys.executable), "-m", "pipeline", *map(str, args)]
    environment = lpx_environment(checkout, env)
    began = time.perf_counter()
    if log is None:
        done = subprocess.run(command, cwd=cwd, env=environment, capture_output=True, text=True)
    else:
        with open(log, "w", encoding="utf-8") as output:
            done = subprocess.run(
                command, cwd=cwd, env=environment, stdout=output, stderr=subprocess.STDOUT
            )
    seconds = time.perf_counter() - began
    return (seconds, done) if timed else done


def lpx_environment(checkout: Path | None = None, env: dict | None = None) -> dict:
    """The environment `run_lpx` gives its process: ``env`` over the current one, with
    ``checkout`` (this one by default) first on PYTHONPATH, so its `pipeline/` is imported."""
    environment = {**os.environ, **(env or {})}
    paths = [str(checkout or ROOT), environment.get("PYTHONPATH", "")]
    environment["PYTHONPATH"] = os.pathsep.join(path for path in paths if path)
    return environment
