"""Start `lpx serve` as its own process on a free loopback port and wait until it answers:
for the tests, the benchmark, and anyone scripting a replica."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


class ServerFailed(RuntimeError):
    """The server exited or never answered /health; the message ends with its log."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def serving(model_dir: Path, *options: str, log_path: Path, startup_s: float = 120.0):
    """Yield the base URL of a running `lpx serve --model model_dir *options`; stop it after."""
    with server_process(model_dir, *options, log_path=log_path, startup_s=startup_s) as (url, _):
        yield url


PORT_TRIES = 3  # the free port picked may be taken before the server binds it: try anew


@contextlib.contextmanager
def server_process(model_dir: Path, *options: str, log_path: Path, startup_s: float = 120.0):
    """Yield (base URL, Popen) of a running `lpx serve`: for tests that kill it themselves.

    Another process may take the free port picked here before the server binds it (a
    shared runner, the tests' other worker); the server then exits at once saying so, and
    it is started again on a fresh port."""
    for attempt in range(1, PORT_TRIES + 1):
        port = free_port()
        with open(log_path, "w") as log:
            process = subprocess.Popen(
                [sys.executable, "-m", "pipeline", "serve", "--model", str(model_dir),
                 "--port", str(port), *options],
                stdout=log,
                stderr=subprocess.STDOUT,
            )  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        try:
            _wait_healthy(url, process, log_path, startup_s)
            break
        except ServerFailed:
            _stop(process)
            port_taken = "already in use" in _tail(log_path)
            if not port_taken or attempt == PORT_TRIES:
                raise
        except BaseException:
            _stop(process)
            raise
    try:
        yield url, process
    finally:
        _stop(process)


def _wait_healthy(url: str, process: subprocess.Popen, log_path: Path, startup_s: float) -> None:
    deadline = time.monotonic() + startup_s
    while True:
        if process.poll() is not None:
            raise ServerFailed(f"lpx serve exited {process.returncode}: {_tail(log_path)}")
        try:
            urllib.request.urlopen(url + "/health", timeout=2).read()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise ServerFailed(f"no /health in {startup_s:g} s: {_tail(log_path)}") from None
            time.sleep(0.1)


def _stop(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(5)


def _tail(path: Path) -> str:
    return Path(path).read_text(errors="replace")[-2000:]
