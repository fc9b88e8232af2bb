"""Local stages forked from an interpreter that has imported torch and transformers already.

Each stage of `lpx run` is its own `python -m pipeline ...` process, and on a CPU most of a
small stage is its imports: torch, transformers and pyarrow take ~4.4 of the 6.2 s an HF
replay of the tiny model takes on this project's 2-core machine (`python -X importtime`).
A run of a plan starts 5-10 such processes, and a bisect dozens. A warm interpreter imports
them once; each stage is then a fork of it that runs the stage's command line as a fresh
`python -m pipeline` would: in its own session (so the runner can kill its process group,
torchrun's ranks included), in the run directory, its output into the stage's log, its exit
code reported as `subprocess` reports one (negative: killed by that signal).

A fork is only as fresh as the interpreter it came from, so the warm one only imports (no
library has done any work when it forks, and no thread has started since its imports: it
checks, and declines otherwise); it serves the environment it was started in and no other
(the stage gets the caller's variables as they are now), and the stage reseeds what a fresh
process seeds from entropy. Whatever declines falls back to a plain process, so a warm start
changes when a stage starts, never what it does. LPX_WARM_START=0 turns it off.

Protocol, one JSON object per line: the runner writes {"argv", "cwd", "log", "env"} on the
warm interpreter's stdin; it answers {"pid"} when the stage has started (or {"declined":
why}), then {"code"} when the stage has exited. It exits when its stdin closes.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from pipeline.errors import Interrupted

# What a stage's process spends its start on (imports of ~0.2 s and up, measured above).
PRELOAD = (
    "numpy",
    "pyarrow.parquet",
    "torch",
    "transformers",
    "transformers.modeling_utils",
    "transformers.models.auto.modeling_auto",
)
# Variables a warm interpreter's imports do not read: a change to one needs no new warm
# interpreter (the stage itself still sees the caller's value). pytest changes its own for
# every test.
CHANGES_WITHOUT_EFFECT = ("PYTEST_CURRENT_TEST",)
READY_WAIT_S = 120.0
# Warm interpreters kept per lpx process, one per (interpreter, environment) in use: a
# bisect alternates between its builds' interpreters and lpx's own, a launch's ranks need
# their engine's imports (~0.5 GB each).
KEEP_AT_MOST = 4


def enabled() -> bool:
    return os.environ.get("LPX_WARM_START", "1").strip().lower() not in ("0", "false", "off")


@dataclass
class Forked:
    """One process to fork: what `python -m MODULE ARGV...` in ``cwd`` with ``env`` would be,
    its output into ``log``; ``name`` is what ps, top and pgrep show for it (15 bytes)."""

    module: str
    argv: list[str]
    cwd: Path
    log: Path
    env: dict[str, str]
    name: str = ""

    def request(self) -> dict:
        return {
            "module": self.module,
            "argv": [str(a) for a in self.argv],
            "cwd": str(self.cwd),
            "log": str(self.log),
            "env": self.env,
            "name": self.name,
        }


class WarmInterpreter:
    """One warm interpreter (a process), running one group of forks at a time: a stage, or
    the ranks of a launch."""

    def __init__(self, python: str, env: dict[str, str], preload: tuple[str, ...] = ()):
        self.python, self.env, self.preload = python, dict(env), preload
        self.lock = threading.Lock()
        self.process = subprocess.Popen(
            [python, "-m", "pipeline.warm_start", *preload],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=self.env,
            start_new_session=True,  # a Ctrl-C at the terminal reaches lpx, not this
        )
        self._buffer = b""
        self.ready = False

    def _reply(self, timeout_s: float | None) -> dict | None:
        """The next line it wrote, or None once ``timeout_s`` has passed; EOFError when it
        exited."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        out = self.process.stdout.fileno()
        while b"\n" not in self._buffer:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            readable, _, _ = select.select([out], [], [], left)
            if not readable:
                return None
            chunk = os.read(out, 65536)
            if not chunk:
                raise EOFError("the warm interpreter exited")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    def is_ready(self, timeout_s: float = 0.0) -> bool:
        """Whether it has finished its imports (waiting up to ``timeout_s`` for that)."""
        if not self.ready and self.process.poll() is None:
            try:
                self.ready = bool((self._reply(timeout_s) or {}).get("ready"))
            except (EOFError, ValueError):
                self.process.kill()
        return self.ready and self.process.poll() is None

    def start(self, processes: list[Forked]) -> list[int] | None:
        """Fork each; their pids, or None where the warm interpreter declined or is gone."""
        for process in processes:  # a full volume fails here, as a plain start does
            with open(process.log, "w", encoding="utf-8"):
                pass
        request = {"processes": [p.request() for p in processes]}
        try:
            self.process.stdin.write(json.dumps(request).encode() + b"\n")
            self.process.stdin.flush()
            answer = self._reply(None)
        except (OSError, EOFError, ValueError):
            return None
        return answer.get("pids") if answer else None

    def next_exit(self, timeout_s: float | None) -> tuple[int, int] | None:
        """(pid, exit code) of the next of the started processes to exit, the code as
        `subprocess` gives it (negative: killed by that signal); None once ``timeout_s``
        has passed; EOFError when the warm interpreter is gone."""
        answer = self._reply(timeout_s)
        return None if answer is None else (int(answer["pid"]), int(answer["code"]))

    def close(self) -> None:
        try:
            self.process.stdin.close()
        except OSError:
            pass
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


_warm: dict[tuple, WarmInterpreter] = {}
_registry_lock = threading.Lock()


def warm_interpreter(
    python: str,
    env: dict[str, str] | None = None,
    preload: tuple[str, ...] = (),
    wait_s: float = READY_WAIT_S,
    per_fork: tuple[str, ...] = (),
) -> WarmInterpreter | None:
    """A warm interpreter of ``python`` started in ``env`` (this process's environment by
    default) that has also imported ``preload``, ready and free to fork (its lock held:
    release it when its forks have exited); None where there is none. The first call starts
    one and waits up to ``wait_s`` for its imports: a process started beside them would
    import the same libraries at the same time, on the same cores. Variables in ``per_fork``
    differ from one group of forks to the next and no import reads them (a session's key):
    they do not call for a warm interpreter of their own."""
    if not enabled():
        return None
    env = dict(os.environ if env is None else env)
    key = (
        python,
        tuple(
            sorted(
                (k, v)
                for k, v in env.items()
                if k not in CHANGES_WITHOUT_EFFECT and k not in per_fork
            )
        ),
        preload,
    )
    with _registry_lock:
        warm = _warm.get(key)
        if warm is None or warm.process.poll() is not None:
            if warm is None and len(_warm) >= KEEP_AT_MOST:
                _evict_one_idle()
            warm = _warm[key] = WarmInterpreter(python, env, preload)
    if not warm.lock.acquire(blocking=False):  # another thread's forks are running in it
        return None
    try:
        ready = warm.is_ready(wait_s)
    except BaseException:  # an interrupt while it imports: it stays for the next caller
        warm.lock.release()
        raise
    if not ready:
        warm.lock.release()
        return None
    return warm


def _evict_one_idle() -> None:
    for key, warm in list(_warm.items()):
        if warm.lock.acquire(blocking=False):  # no fork of another thread running in it
            del _warm[key]
            warm.close()
            return


@atexit.register
def close_all() -> None:
    with _registry_lock:
        for warm in _warm.values():
            warm.close()
        _warm.clear()


def kill_group(pid: int, sig) -> None:
    """Signal a fork and everything it started (each fork leads its own session)."""
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass


def run_stage(
    warm: WarmInterpreter, argv: list[str], cwd: Path, log: Path, timeout_s: float
) -> tuple[bool, int | None]:
    """A stage's `python -m pipeline ARGV` forked: (whether it ran warm, its exit code, or
    None past ``timeout_s``, when its session is killed). An interrupt of lpx stops it with
    SIGTERM and is raised again."""
    import signal

    pids = warm.start([Forked("pipeline", argv, cwd, log, dict(os.environ))])
    if not pids:
        return False, None
    (pid,) = pids
    try:
        ended = warm.next_exit(timeout_s)
    except Interrupted:
        kill_group(pid, signal.SIGTERM)
        warm.next_exit(None)
        raise
    except EOFError:  # the warm interpreter died under its stage: the stage is lost with it
        kill_group(pid, signal.SIGKILL)
        return True, -int(signal.SIGKILL)
    if ended is None:
        kill_group(pid, signal.SIGKILL)
        warm.next_exit(None)
        return True, None
    return True, ended[1]


# --- the warm interpreter's side --------------------------------------------------------


def _threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


def _send(fd: int, message: dict) -> None:
    os.write(fd, json.dumps(message).encode() + b"\n")


def _exit_code(code) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    sys.stderr.write(f"{code}\n")
    return 1


def _set_name(name: str) -> None:
    """What ps, top and pgrep show for this process (its comm), where Linux lets us."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


def _become(request: dict) -> None:
    """In the fork: become `python -m MODULE ARGV...` as the request says; never returns."""
    code = 1
    try:
        os.setsid()
        if request.get("name"):
            _set_name(request["name"])
        os.chdir(request["cwd"])
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        os.environ.clear()
        os.environ.update(request["env"])
        sys.argv = ["-m", *request["argv"]]  # runpy puts the module's path first, as -m does
        sys.path[0] = os.getcwd()  # as `python -m` sets it
        if "numpy" in sys.modules:  # a fresh process seeds numpy's global generator anew
            sys.modules["numpy"].random.seed()
        import runpy

        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exit_:
        code = _exit_code(exit_.code)
    except BaseException:  # what a fresh interpreter would print before exiting 1
        import traceback

        traceback.print_exc()
    finally:
        try:
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def serve(preload: list[str]) -> None:
    requests, replies = os.dup(0), os.dup(1)
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1):  # a fork must not read the requests or write into the replies
        os.dup2(null, fd)
    os.close(null)
    os.set_inheritable(requests, False)
    os.set_inheritable(replies, False)
    atexit.unregister(close_all)  # a fork's exit must not close anything of the caller's
    for name in (*PRELOAD, *preload):
        try:
            __import__(name)
        except Exception:  # an environment without it: its forks import what they need
            pass
    # Importing numpy starts OpenBLAS's server thread and pyarrow jemalloc's background
    # thread; both are idle here and made anew in a fork (their pthread_atfork handlers; the
    # first fork stops OpenBLAS's for good here), as under every fork-based multiprocessing
    # pool. A thread beyond those would mean some library started working: then no fork.
    idle_threads = _threads()
    _send(replies, {"ready": True, "threads": idle_threads})
    with os.fdopen(requests, "rb") as lines:
        for line in lines:
            group = json.loads(line)["processes"]
            if _threads() > idle_threads:
                _send(replies, {"declined": f"{_threads()} threads, {idle_threads} at start"})
                continue
            pids = []
            for request in group:
                pid = os.fork()
                if pid == 0:
                    os.close(replies)
                    _become(request)
                pids.append(pid)
            _send(replies, {"pids": pids})
            for _ in pids:
                pid, status = os.wait()
                _send(replies, {"pid": pid, "code": os.waitstatus_to_exitcode(status)})


if __name__ == "__main__":
    serve(sys.argv[1:])
