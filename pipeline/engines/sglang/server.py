"""An SGLang server lpx starts itself: which interpreter runs it, its command line, the wait
for its health, its log, and its end.

The server runs in the interpreter that has SGLang: the one named by the ``python`` knob or
``LPX_SGLANG_PYTHON``, this one where SGLang is importable here (an image with SGLang in
it, a bisect's environment), else the environment setup made (environments.STACKS: the
pinned release over lpx's own venv, torch shared). It starts through
engines/sglang/launch.py in a process group of its own; the group is stopped when the work
ends, fails or is interrupted (SIGINT/SIGTERM reach lpx as `Interrupted`, and the
``finally`` here runs), and a server whose parent dies is stopped by the kernel
(PR_SET_PDEATHSIG). Its log is kept where the caller says.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from pipeline import environments
from pipeline.engines.launch_failure import launch_failure_reason
from pipeline.errors import BadInput, EngineNotInstalled

SGLANG_RELEASE = "0.5.23"  # what setup installs and the tests check; docs/engines.md
HEALTH_PATH = "/health"  # 200 once the scheduler answers (503 while it warms up)


@dataclass(frozen=True)
class Server:
    url: str
    log: Path
    pid: int
    started_s: float  # from launch to the first healthy answer


def default_environment() -> environments.Environment:
    """The SGLang environment setup makes: the release over lpx's venv, offline from the
    wheels setup fetched (LPX_WHEELHOUSE, else the venv's engine-wheels/)."""
    return environments.for_requirement(
        f"sglang=={SGLANG_RELEASE}", wheelhouse=default_wheelhouse()
    )


def default_wheelhouse() -> Path:
    return Path(os.environ.get("LPX_WHEELHOUSE") or Path(sys.prefix) / "engine-wheels")


def sglang_python(python: str = "") -> Path:
    """The interpreter to run SGLang with (see the module's docstring for the order)."""
    chosen = python or os.environ.get("LPX_SGLANG_PYTHON", "")
    if chosen:
        if not Path(chosen).is_file():
            raise BadInput(
                f"sglang python {chosen}: no such interpreter; give the python of an "
                "environment that has SGLang (--set python=... or LPX_SGLANG_PYTHON)."
            )
        return Path(chosen)
    if importlib.util.find_spec("sglang") is not None:
        return Path(sys.executable)
    environment = default_environment()
    directory = environments.made(environment)
    if directory is None:
        if not _has_release_wheel(environment.wheelhouse):
            raise EngineNotInstalled(
                f"engine 'sglang' is not installed: no SGLang {SGLANG_RELEASE} environment and "
                f"no wheel of it in {environment.wheelhouse}; run ./scripts/setup (it fetches "
                "SGLang once), or pass --set python=PATH of an interpreter that has SGLang."
            )
        try:
            directory = environments.ensure(environment)
        except environments.EnvironmentFailed as error:
            raise EngineNotInstalled(f"engine 'sglang': its environment failed: {error}") from None
    return environments.python_of(directory)


def _has_release_wheel(wheelhouse: Path | None) -> bool:
    return wheelhouse is not None and any(Path(wheelhouse).glob(f"sglang-{SGLANG_RELEASE}-*.whl"))


PORT_TRIES = 3  # fresh loopback ports tried when the one picked was taken before SGLang bound it
PORT_TAKEN = "address already in use"  # uvicorn's words when its bind fails (errno 98)


class PortTaken(Exception):
    """The port picked for the server was taken by the time SGLang bound it."""


@contextlib.contextmanager
def running_server(
    python: Path,
    server_args: list[str],
    log: Path,
    env: dict[str, str] | None = None,
    startup_s: float = 600.0,
    say=None,
):
    """Yield a `Server` started with ``python -m pipeline.engines.sglang.launch
    --host 127.0.0.1 --port P *server_args``; stop it (its whole process group) after.

    P is a port the kernel called free, but SGLang binds it only once the model is loaded,
    tens of seconds later, and any process may take it meanwhile (another SGLang's own
    distributed-init port, on a shared runner). A bind that fails is seen in the log at
    once and retried on a fresh port, up to PORT_TRIES times, instead of waiting out
    ``startup_s`` for a server that will never answer."""
    for attempt in range(1, PORT_TRIES + 1):
        process, url, started = _launch(python, server_args, Path(log), env)
        try:
            _wait_healthy(url, process, Path(log), startup_s, say)
            break
        except PortTaken:
            stop(process)
            if attempt == PORT_TRIES:
                raise BadInput(
                    f"SGLang's server could not bind a loopback port in {PORT_TRIES} tries "
                    f"(each was taken before it bound); its log {log} ends: {log_tail(log)}"
                ) from None
            if say is not None:
                say(f"SGLang's port was taken before it bound; starting it again ({attempt + 1})")
        except BaseException:
            stop(process)
            raise
    try:
        yield Server(url, Path(log), process.pid, time.monotonic() - started)
    finally:
        stop(process)


def _launch(python: Path, server_args: list[str], log: Path, env: dict[str, str] | None):
    """Start the server on a free port, its output to ``log``: (Popen, base URL, start time)."""
    port = _free_port()
    argv = [str(python), "-m", "pipeline.engines.sglang.launch", "--host", "127.0.0.1",
            "--port", str(port), *server_args]  # fmt: skip
    log.parent.mkdir(parents=True, exist_ok=True)
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", "SGLANG_DISABLE_REQUEST_LOGGING": "1"}
    environment.update(env or {})
    environment.pop("SGLANG_USE_CPU_ENGINE", None)
    started = time.monotonic()
    with open(log, "w", encoding="utf-8") as out:
        out.write("$ " + " ".join(argv) + "\n")
        out.flush()
        process = subprocess.Popen(
            argv,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=environment,
            start_new_session=True,
            preexec_fn=_stop_with_parent,
        )
        out.write(f"# lpx: server pid {process.pid}, its own process group\n")
        out.flush()
    return process, f"http://127.0.0.1:{port}", started


def stop(process: subprocess.Popen, grace_s: float = 2.0) -> None:
    """SIGTERM to the server's process group, SIGKILL what is left after ``grace_s``.

    The grace is short on purpose: when lpx stops a server it has every answer it asked
    for, and SGLang 0.5.23's launcher, seeing its scheduler end on the same SIGTERM, sleeps
    5 s "to let GPU activity settle" before it exits, which every stop would otherwise pay."""
    if process.poll() is None:
        _signal_group(process, signal.SIGTERM)
        try:
            process.wait(grace_s)
        except subprocess.TimeoutExpired:
            pass
    _signal_group(process, signal.SIGKILL)  # the scheduler and detokenizer children too
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(5)


def _signal_group(process: subprocess.Popen, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signum)


def _wait_healthy(url: str, process, log: Path, startup_s: float, say) -> None:
    deadline = time.monotonic() + startup_s
    next_word = time.monotonic() + 15
    while True:
        if process.poll() is not None:
            raise BadInput(
                f"SGLang's server exited ({process.returncode}) before it was ready: "
                f"{_why_it_exited(log)} (its log: {log})"
            )
        try:
            with urllib.request.urlopen(url + HEALTH_PATH, timeout=5) as answer:
                if answer.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        if _bind_failed(log):
            raise PortTaken(url)
        now = time.monotonic()
        if now > deadline:
            raise BadInput(
                f"SGLang's server did not answer {HEALTH_PATH} within {startup_s:g} s (raise "
                f"--set startup_timeout_s); its log {log} ends: {log_tail(log)}"
            )
        if say is not None and now > next_word:
            say(f"waiting for SGLang's server ({now - deadline + startup_s:.0f} s; log {log})")
            next_word = now + 30
        time.sleep(0.5)


def _bind_failed(log: Path) -> bool:
    try:
        return PORT_TAKEN in Path(log).read_text(encoding="utf-8", errors="replace").lower()
    except OSError:
        return False


def _why_it_exited(log: Path) -> str:
    """The sentence of the log that says why, not the usage text SGLang prints before it."""
    try:
        text = Path(log).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return "(no log)"
    return launch_failure_reason(text) or "it printed nothing"


def log_tail(log: Path, lines: int = 6) -> str:
    """The last lines of a server log that say something (tracebacks' last lines first)."""
    try:
        text = Path(log).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return "(no log)"
    kept = [line.strip() for line in text.splitlines() if line.strip()]
    return " | ".join(kept[-lines:])[-1200:]


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _stop_with_parent() -> None:
    """In the child before exec: SIGTERM when lpx dies (Linux), so no server is orphaned."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
