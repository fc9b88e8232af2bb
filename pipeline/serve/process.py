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


@contextlib.contextmanager
def server_process(model_dir: Path, *options: str, log_path: Path, startup_s: float = 120.0):
    """Yield (base URL, Popen) of a running `lpx serve`: for tests that kill it themselves."""
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
            deadline = time.monotonic() + startup_s
            while True:
                if process.poll() is not None:
                    raise ServerFailed(f"lpx serve exited {process.returncode}: {_tail(log_path)}")
                try:
                    urllib.request.urlopen(url + "/health", timeout=2).read()
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise ServerFailed(
                            f"no /health in {startup_s:g} s: {_tail(log_path)}"
                        ) from None
                    time.sleep(0.1)
            yield url, process
        finally:
            process.terminate()
            process.wait(30)


def _tail(path: Path) -> str:
    return Path(path).read_text(errors="replace")[-2000:]
