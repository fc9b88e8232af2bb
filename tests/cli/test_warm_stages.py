"""Local stages forked from a warm interpreter (pipeline/warm_start.py): the same
outputs and exit codes as a plain `python -m pipeline` process, killed the same way."""

from __future__ import annotations

import signal
import socket
import sys
import time

import pyarrow.parquet as pq
import pytest

from pipeline import warm_start
from pipeline.errors import Interrupted
from pipeline.orchestrator.runners import LocalRunner
from pipeline.orchestrator.stages import Stage


@pytest.fixture(scope="module")
def warm():
    """The worker's warm interpreter of this environment, its lock released between uses."""
    found = warm_start.warm_interpreter(sys.executable)
    assert found is not None
    found.lock.release()
    return found


def _run(warm, argv, cwd, log, timeout_s=120.0):
    assert warm.lock.acquire(blocking=False)
    try:
        return warm_start.run_stage(warm, argv, cwd, log, timeout_s)
    finally:
        warm.lock.release()


def test_a_warm_replay_writes_what_a_plain_process_writes(warm, run_dir, tiny_model, tmp_path):
    argv = ["replay", run_dir / "fixture.parquet", "--engine", "hf", "--dtype", "float32",
            "--model", tiny_model]  # fmt: skip
    ran, code = _run(warm, [*argv, "--out", "warm.parquet"], tmp_path, tmp_path / "warm.log")
    assert (ran, code) == (True, 0), (tmp_path / "warm.log").read_text()
    assert "hf replay (float32): 16 sequences" in (tmp_path / "warm.log").read_text()
    cold = tmp_path / "cold"
    cold.mkdir()
    stage = Stage("replay", [*map(str, argv), "--out", "cold.parquet"], [])
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LPX_WARM_START", "0")
        assert LocalRunner().run(stage, cold, cold / "cold.log", 300) == 0
    warm_table, cold_table = (
        pq.read_table(tmp_path / "warm.parquet"),
        pq.read_table(cold / "cold.parquet"),
    )
    assert warm_table.num_rows == 16
    # every column equal, the scores to the bit (the engine versions and knobs included)
    assert [c for c in cold_table.column_names if cold_table[c] != warm_table[c]] == []


def test_a_warm_stage_exits_with_its_own_code_and_error_line(warm, tmp_path):
    ran, code = _run(
        warm, ["replay", "missing.parquet", "--engine", "hf", "--out", "r.parquet"], tmp_path,
        tmp_path / "bad.log",
    )  # fmt: skip
    assert (ran, code) == (True, 2)
    log = (tmp_path / "bad.log").read_text()
    assert "missing.parquet" in log and "Traceback" not in log
    # the stage ran in the directory it was given, and the next one runs too
    assert _run(warm, ["--version"], tmp_path, tmp_path / "v.log") == (True, 0)
    assert (tmp_path / "v.log").read_text().startswith("lpx, version ")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_warm_stage_past_its_timeout_is_killed_with_its_group(warm, tiny_model, tmp_path):
    """`lpx serve` never ends on its own: past the timeout the stage's whole session is
    killed (None, as a plain process's timeout), and the warm interpreter serves on."""
    port = _free_port()
    argv = ["serve", "--model", tiny_model, "--port", str(port)]
    started = time.monotonic()
    assert _run(warm, argv, tmp_path, tmp_path / "serve.log", timeout_s=3.0) == (True, None)
    assert time.monotonic() - started < 30
    with socket.socket() as s:  # nothing is left listening
        assert s.connect_ex(("127.0.0.1", port)) != 0
    assert _run(warm, ["--version"], tmp_path, tmp_path / "v.log") == (True, 0)


def test_an_interrupted_lpx_stops_its_warm_stage_and_raises(warm, tiny_model, tmp_path):
    def interrupt(signum, frame):
        raise Interrupted(signum)

    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, 2.0)
    argv = ["serve", "--model", tiny_model, "--port", str(_free_port())]
    try:
        with pytest.raises(Interrupted):
            _run(warm, argv, tmp_path, tmp_path / "serve.log", timeout_s=60.0)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    # the stage was stopped by SIGTERM and its exit read: the next stage runs at once
    assert _run(warm, ["--version"], tmp_path, tmp_path / "v.log") == (True, 0)


def test_no_warm_interpreter_when_turned_off(monkeypatch):
    monkeypatch.setenv("LPX_WARM_START", "0")
    assert warm_start.warm_interpreter(sys.executable) is None
