"""One rank of a capture worker group (started by torchrun from `_workers.WorkerGroup`).

Every rank runs every forward (sharded engines gather weights collectively, TP ranks each
hold a slice of every layer); rank 0 alone talks to the parent and sends the rows.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
from datetime import timedelta
from pathlib import Path

from pipeline.localize.adapters._workers import AUTHKEY_VARIABLE, PARENT_VARIABLE, SOCKET

ENGINES = {
    "fsdp": "pipeline.localize.adapters.fsdp",
    "deepspeed": "pipeline.localize.adapters.deepspeed",
    "megatron": "pipeline.localize.adapters.megatron",
}
# The parent times out a group that stops answering and kills it; the ranks themselves wait
# for their peers as long as the parent waits between two requests (the other side's
# captures can take hours on a large model).
COLLECTIVE_TIMEOUT = timedelta(days=7)
STOP = {"op": "stop"}
WATCH_SECONDS = 1.0


def serve(engine: str, model_dir: Path, knobs: dict, device_kind: str, folder: Path) -> None:
    import torch.distributed as dist

    from pipeline import devices

    device = devices.rank_device(device_kind)
    dist.init_process_group(devices.collective_backend(device), timeout=COLLECTIVE_TIMEOUT)
    rank = dist.get_rank()
    try:
        ranks = importlib.import_module(ENGINES[engine]).open_rank(
            model_dir, knobs, device, dist.get_world_size()
        )
        connection = _accept(folder) if rank == 0 else None
        while True:
            shared = [_next_request(connection) if rank == 0 else None]
            dist.broadcast_object_list(shared, src=0)
            request = shared[0]
            if request["op"] == "stop":
                break
            sink = _sender(connection, request["id"]) if rank == 0 else _ignore
            # only ranks that can report a replaced op's own output are asked to
            own = {"own_first": True} if request.get("own_first") else {}
            ranks.capture(request["tokens"], request["precision"], sink, request["replace"], **own)
            if rank == 0:
                connection.send(("done", request["id"]))
    finally:
        dist.destroy_process_group()


def watch_parents() -> None:
    """Exit when lpx or torchrun is gone: a rank waiting for a request or for its peers would
    otherwise wait out COLLECTIVE_TIMEOUT."""
    import threading
    import time

    lpx, torchrun = int(os.environ.get(PARENT_VARIABLE, "0")), os.getppid()

    def watch() -> None:
        while True:
            time.sleep(WATCH_SECONDS)
            try:
                if lpx:
                    os.kill(lpx, 0)
            except ProcessLookupError:
                os._exit(3)
            if os.getppid() != torchrun:
                os._exit(3)

    threading.Thread(target=watch, name="lpx-parent-watch", daemon=True).start()


def _accept(folder: Path):
    from multiprocessing.connection import Listener

    key = bytes.fromhex(os.environ[AUTHKEY_VARIABLE])
    listener = Listener(str(folder / SOCKET), family="AF_UNIX", authkey=key)
    try:
        return listener.accept()
    finally:
        listener.close()


def _next_request(connection) -> dict:
    """The parent's next request; a stop when the parent has gone (its end of the socket
    closed), so a killed `lpx` never leaves ranks behind."""
    try:
        return connection.recv()
    except (EOFError, OSError):
        return STOP


def _sender(connection, request_id: int):
    def send(name: str, rows) -> None:
        connection.send(("rows", request_id, name, rows))

    return send


def _ignore(name: str, rows) -> None:
    pass


def main(argv: list[str] | None = None) -> None:
    from pipeline.engines.distributed import exit_rank, log_rank_output

    parser = argparse.ArgumentParser(description="lpx capture worker (started by torchrun)")
    parser.add_argument("--engine", required=True, choices=sorted(ENGINES))
    parser.add_argument("--model", required=True, type=Path)
    parser.add_argument("--knobs", default="{}")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--folder", required=True, type=Path)
    args = parser.parse_args(argv)
    log_rank_output(args.folder)
    rank = os.environ.get("RANK", "0")
    (args.folder / f"rank{rank}.pid").write_text(str(os.getpid()))
    watch_parents()
    exit_rank(
        lambda: serve(args.engine, args.model, json.loads(args.knobs), args.device, args.folder),
        args.folder,
    )


if __name__ == "__main__":
    main()
