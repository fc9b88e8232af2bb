"""The ranks of a CPU launch forked from a warm interpreter, as `torchrun --standalone` starts
them.

A rank of lpx's distributed replay imports torch.distributed, transformers and its engine
(Megatron-core alone ~5 s) before its first collective; on a CPU that is most of a small
replay, twice over for two ranks, plus torchrun's own start (~1.5 s). Forked from a warm
interpreter (pipeline/orchestrator/warm_start.py) that has imported them once, the ranks
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
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.errors import Interrupted
from pipeline.orchestrator.warm_start import Forked, kill_group, warm_interpreter

STOP_GRACE_S = 10.0
# What each engine's ranks import beyond torch and transformers (the warm interpreter's own).
ENGINE_IMPORTS = {
    "fsdp": ("torch.distributed", "torch.distributed.fsdp"),
    "deepspeed": ("torch.distributed", "deepspeed"),
    "megatron": ("torch.distributed", "megatron.core", "megatron.core.models.gpt"),
}


@dataclass
class Launch:
    """How the ranks ended: each rank's exit code (negative: killed by that signal)."""

    codes: dict[int, int]
    lines: list[str] = field(default_factory=list)  # launch.log: what happened, in order

    @property
    def returncode(self) -> int:
        failed = [code for code in self.codes.values() if code != 0]
        return failed[0] if failed else 0


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


def run_ranks(
    module: str, argv: list[str], nproc: int, env: dict[str, str], logs: Path, engine: str
) -> Launch | None:
    """Run ``nproc`` ranks of `python -m MODULE ARGV...` forked warm, each writing
    logs/rankN.log; how they ended, or None where no warm interpreter can fork them (then
    the caller starts torchrun)."""
    warm = warm_interpreter(sys.executable, env, ENGINE_IMPORTS.get(engine, ()))
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
        if not pids:
            return None
        return _watch(warm, pids, port)
    finally:
        warm.lock.release()


def _watch(warm, pids: list[int], port: int) -> Launch:
    rank_of = {pid: rank for rank, pid in enumerate(pids)}
    launch = Launch({}, [f"{len(pids)} rank(s) forked warm, store on 127.0.0.1:{port}"])
    launch.lines += [f"rank {rank}: pid {pid}" for pid, rank in rank_of.items()]
    running = set(pids)
    stop_by = None  # once a rank failed: when the others are killed if still running

    def stop(sig) -> None:
        for pid in running:
            kill_group(pid, sig)

    try:
        while running:
            left = None if stop_by is None else max(0.0, stop_by - time.monotonic())
            try:
                ended = warm.next_exit(left)
            except EOFError:  # the warm interpreter is gone: its ranks go with it
                stop(signal.SIGKILL)
                for pid in running:
                    launch.codes[rank_of[pid]] = -int(signal.SIGKILL)
                launch.lines.append("the warm interpreter exited under its ranks")
                return launch
            if ended is None:
                launch.lines.append(f"ranks still running {STOP_GRACE_S:g} s later: SIGKILL")
                stop(signal.SIGKILL)
                stop_by = float("inf")
                continue
            pid, code = ended
            running.discard(pid)
            launch.codes[rank_of[pid]] = code
            launch.lines.append(f"rank {rank_of[pid]} (pid {pid}) exited {code}")
            if code != 0 and stop_by is None and running:
                launch.lines.append("a rank failed: the others are sent SIGTERM")
                stop(signal.SIGTERM)
                stop_by = time.monotonic() + STOP_GRACE_S
    except Interrupted:
        stop(signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        while running:
            ended = warm.next_exit(max(0.0, deadline - time.monotonic()))
            if ended is None:
                stop(signal.SIGKILL)
                deadline = float("inf")
                continue
            running.discard(ended[0])
        raise
    return launch


def address_taken(logs: Path) -> bool:
    """Whether rank 0 could not host the store: another process took the port between
    choosing it and binding it (then the launch is tried once more)."""
    try:
        text = (logs / "rank0.log").read_text(errors="replace")
    except OSError:
        return False
    return "EADDRINUSE" in text or "address already in use" in text.lower()
