"""The ranks of a CPU launch forked from a warm interpreter, as `torchrun --standalone` starts
them.

A rank of lpx's distributed replay imports torch.distributed, transformers and its engine
(Megatron-core alone ~5 s) before its first collective; on a CPU that is most of a small
replay, twice over for two ranks, plus torchrun's own start (~1.5 s). Forked from a warm
interpreter (pipeline/warm_start.py) that has imported them once, the ranks
start at once. Each rank gets the variables torchrun gives it (RANK, LOCAL_RANK,
WORLD_SIZE, MASTER_ADDR/PORT: rank 0 hosts the store, as under `TORCHELASTIC_USE_AGENT_STORE
=False`), runs `python -m MODULE ARGV...` in its own session, and shows as `lpx-rankN` in ps
and pgrep (its command line is the warm interpreter's). As torchrun does, the first rank to
fail has the others stopped (SIGTERM, then SIGKILL after STOP_GRACE_S).

Only on the CPU: a warm interpreter imports nothing that touches a GPU, but a fork of a
process that ever initialised CUDA cannot use it, and on a GPU the imports are a small part of
a launch. There, and with LPX_WARM_START=0, torchrun starts the ranks.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

from pipeline.errors import Interrupted
from pipeline.warm_start import Forked, kill_group, warm_interpreter

STOP_GRACE_S = 10.0
# What each engine's ranks import beyond torch and transformers (the warm interpreter's own).
ENGINE_IMPORTS = {
    "fsdp": ("torch.distributed", "torch.distributed.fsdp"),
    "deepspeed": ("torch.distributed", "deepspeed"),
    "megatron": ("torch.distributed", "megatron.core", "megatron.core.models.gpt"),
}


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def rank_variables(rank: int, nproc: int, port: int, run_id: str) -> dict[str, str]:
    """What torchrun --standalone sets for a rank on one node."""
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(nproc),
        "LOCAL_WORLD_SIZE": str(nproc),
        "GROUP_RANK": "0",
        "GROUP_WORLD_SIZE": "1",
        "ROLE_RANK": str(rank),
        "ROLE_WORLD_SIZE": str(nproc),
        "ROLE_NAME": "default",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "TORCHELASTIC_RUN_ID": run_id,
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
        "TORCHELASTIC_USE_AGENT_STORE": "False",
    }


class RankGroup:
    """Ranks forked warm: how each ended, and what a caller needs of torchrun's process
    (`poll`, `wait`, `kill`, `returncode`). As torchrun does, the first rank that fails has
    the others stopped: SIGTERM, and SIGKILL STOP_GRACE_S later."""

    def __init__(self, warm, pids: list[int], port: int):
        self.warm, self.pids = warm, pids
        self.rank_of = {pid: rank for rank, pid in enumerate(pids)}
        # rank -> exit code, negative: killed by that signal; in the order the ranks exited
        self.codes: dict[int, int] = {}
        self.lines = [f"{len(pids)} rank(s) forked warm, store on 127.0.0.1:{port}"]
        self.lines += [f"rank {rank}: pid {pid}" for rank, pid in enumerate(pids)]
        self.returncode: int | None = None
        self._stop_by: float | None = None

    @property
    def running(self) -> list[int]:
        return [pid for pid in self.pids if self.rank_of[pid] not in self.codes]

    def send_signal(self, sig) -> None:
        for pid in self.running:
            kill_group(pid, sig)

    def _collect(self, timeout_s: float | None) -> None:
        """Read the ranks' exits for up to ``timeout_s`` (None: until every rank exited)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while self.running:
            now = time.monotonic()
            if self._stop_by is not None and now >= self._stop_by:
                self.lines.append(f"ranks still running {STOP_GRACE_S:g} s later: SIGKILL")
                self.send_signal(signal.SIGKILL)
                self._stop_by = float("inf")
            waits = [t for t in (deadline, self._stop_by) if t is not None and t != float("inf")]
            left = None if not waits else max(0.0, min(waits) - now)
            try:
                ended = self.warm.next_exit(left)
            except EOFError:  # the warm interpreter is gone: its ranks go with it
                self.send_signal(signal.SIGKILL)
                self.lines.append("the warm interpreter exited under its ranks")
                for pid in self.running:
                    self.codes[self.rank_of[pid]] = -int(signal.SIGKILL)
                break
            if ended is None:
                if deadline is not None and time.monotonic() >= deadline:
                    return
                continue
            pid, code = ended
            self.codes[self.rank_of[pid]] = code
            self.lines.append(f"rank {self.rank_of[pid]} (pid {pid}) exited {code}")
            if code != 0 and self._stop_by is None and self.running:
                self.lines.append("a rank failed: the others are sent SIGTERM")
                self.send_signal(signal.SIGTERM)
                self._stop_by = time.monotonic() + STOP_GRACE_S
        failed = [self.codes[rank] for rank in sorted(self.codes) if self.codes[rank] != 0]
        self.returncode = failed[0] if failed else 0
        self.warm.lock.release()

    def poll(self) -> int | None:
        if self.returncode is None:
            self._collect(0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self._collect(timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired("warm ranks", timeout)
        return self.returncode

    def kill(self) -> None:
        """SIGKILL every rank still running, and wait for them."""
        if self.returncode is None:
            self.send_signal(signal.SIGKILL)
            self._collect(None)

    def stop(self) -> None:
        """What an interrupt of lpx does: SIGTERM, SIGKILL after the grace, wait."""
        if self.returncode is None:
            self.send_signal(signal.SIGTERM)
            self._stop_by = time.monotonic() + STOP_GRACE_S
            self._collect(None)


def start_ranks(
    module: str,
    argv: list[str],
    nproc: int,
    env: dict[str, str],
    logs: Path,
    engine: str,
    per_launch: tuple[str, ...] = (),
) -> RankGroup | None:
    """Fork ``nproc`` ranks of `python -m MODULE ARGV...` from a warm interpreter, each
    writing logs/rankN.log; None where none can fork them (then the caller starts torchrun).
    ``per_launch``: variables of ``env`` that change with every launch (a session key)."""
    warm = warm_interpreter(
        sys.executable, env, ENGINE_IMPORTS.get(engine, ()), per_fork=per_launch
    )
    if warm is None:
        return None
    try:
        port, run_id = _free_port(), uuid.uuid4().hex[:12]
        processes = [
            Forked(
                module,
                argv,
                Path.cwd(),
                logs / f"rank{rank}.log",
                {**env, **rank_variables(rank, nproc, port, run_id)},
                name=f"lpx-rank{rank}",
            )
            for rank in range(nproc)
        ]
        pids = warm.start(processes)
    except BaseException:
        warm.lock.release()
        raise
    if not pids:
        warm.lock.release()
        return None
    return RankGroup(warm, pids, port)  # it releases the warm interpreter when all exited


def run_ranks(
    module: str, argv: list[str], nproc: int, env: dict[str, str], logs: Path, engine: str
) -> RankGroup | None:
    """The ranks forked warm, run to their end (an interrupt of lpx stops them and is
    raised again); None where none can be forked."""
    group = start_ranks(module, argv, nproc, env, logs, engine)
    if group is None:
        return None
    try:
        group.wait()
    except Interrupted:
        group.stop()
        raise
    return group


def address_taken(logs: Path) -> bool:
    """Whether rank 0 could not host the store: another process took the port between
    choosing it and binding it (then the launch is tried once more)."""
    try:
        text = (logs / "rank0.log").read_text(errors="replace")
    except OSError:
        return False
    return "EADDRINUSE" in text or "address already in use" in text.lower()
