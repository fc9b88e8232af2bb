"""`lpx serve --engine fsdp|megatron --nproc N`: a distributed scoring engine as torchrun
ranks behind one endpoint.

Rank 0 runs the HTTP server. For each batch it broadcasts the work to every rank; each rank
scores its share (a sharded forward needs every rank, so a rank with no share scores a
one-token dummy), and rank 0 gathers the results in order. A weight update is broadcast the
same way: every rank builds the new sharded model, then all swap together. The fingerprint
each answer carries is that of the full weights gathered from the shards.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from pipeline import devices
from pipeline.serve.bind import url_host
from pipeline.serve.model_slot import Version, as_result, max_positions, version_name


def launch(engine: str, nproc, serve_args: dict) -> int:
    """Run the ranks under torchrun in the foreground (one per GPU on CUDA, checked before
    any starts); SIGTERM/SIGINT stop them."""
    from pipeline.engines.distributed import plan_ranks, rank_environment

    nproc, kind, env = plan_ranks(serve_args["knobs"], nproc)
    serve_args = {**serve_args, "knobs": {**serve_args["knobs"], "device": kind}}
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
        "-m", "pipeline.serve.distributed", "--engine", engine, "--args", json.dumps(serve_args),
    ]  # fmt: skip
    process = subprocess.Popen(command, env=rank_environment(env))
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: process.terminate())
    return process.wait()


class RankZeroSlot:
    """What the app scores with on rank 0: every call is mirrored on the other ranks."""

    def __init__(self, engine: str, model_dir: Path, knobs: dict, version: str | None):
        import torch.distributed as dist

        self.engine, self.knobs = engine, knobs
        self.world_size = dist.get_world_size()
        self.session, self.version = _open(engine, Path(model_dir), knobs, version)
        self.settings = self.session.settings

    @property
    def vocab_size(self) -> int:
        return int(self._config()["vocab_size"])

    @property
    def max_positions(self) -> int | None:
        return max_positions(self._config())

    def _config(self) -> dict:
        return json.loads((Path(self.version.model_dir) / "config.json").read_text())

    def score(self, pairs, want_prompt: bool):
        _broadcast(("score", pairs))
        scored = _score_share(self.session, pairs)
        return [as_result(s) for s in scored], self.version

    def load(self, model_dir: Path, version: str | None = None) -> Version:
        _broadcast(("load", str(model_dir), version))
        self.session, self.version = _open(self.engine, Path(model_dir), self.knobs, version)
        return self.version

    def stop(self) -> None:
        _broadcast(("stop",))


def follow(engine: str, model_dir: Path, knobs: dict, version: str | None) -> None:
    """Ranks > 0: do what rank 0 broadcasts until it says stop."""
    import torch.distributed as dist

    session, _ = _open(engine, model_dir, knobs, version)
    while True:
        message = [None]
        dist.broadcast_object_list(message, src=0)
        op = message[0]
        if op[0] == "score":
            _score_share(session, op[1])
        elif op[0] == "load":
            session, _ = _open(engine, Path(op[1]), knobs, op[2])
        else:
            return


def _broadcast(op) -> None:
    import torch.distributed as dist

    dist.broadcast_object_list([op], src=0)


def _open(engine: str, model_dir: Path, knobs: dict, version: str | None):
    """A sharded session on every rank (collective), and the version of what it holds."""
    import torch.distributed as dist

    from pipeline.engines import scoring_engine

    session = scoring_engine(engine).open(
        model_dir, dict(knobs), dist.get_rank(), dist.get_world_size()
    )
    held = session.metadata()["weights"]["held_tensor_fingerprint"]  # gathers: every rank
    if dist.get_rank() != 0:
        return session, None  # the full weights are gathered to rank 0 only
    return session, Version(version_name(model_dir, version, held), held, str(model_dir))


def _score_share(session, pairs):
    """This data-parallel rank's share of the batch (tensor-parallel peers score the same
    share) in forwards of the session's micro-batch size, gathered to rank 0 in the batch's
    order there. Every rank runs as many forwards as the largest share needs, since each
    sharded forward is collective: a rank out of work scores a one-token dummy."""
    import torch.distributed as dist

    share, shares = session.dp_rank, session.dp_size
    mine = pairs[share::shares]
    size = session.micro_batch_size
    largest = -(-len(pairs) // shares)  # rank 0's share
    steps = -(-largest // size)
    dummy = [(pairs[0][0][:1], pairs[0][1][:1])]
    scored = []
    for step in range(steps):
        chunk = mine[step * size : (step + 1) * size]
        done = session.score(chunk or dummy)
        scored.extend(done if chunk else [])
    gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object((share, scored), gathered, dst=0)
    if dist.get_rank() != 0:
        return None
    ordered = [None] * len(pairs)
    for part_share, part in gathered:
        for j, result in enumerate(part):
            ordered[part_share + j * shares] = result
    return ordered


def main(argv: list[str] | None = None) -> None:
    import torch.distributed as dist

    parser = argparse.ArgumentParser(description="lpx serve rank (started by torchrun)")
    parser.add_argument("--engine", required=True)
    parser.add_argument("--args", required=True)
    args = parser.parse_args(argv)
    options = json.loads(args.args)
    knobs = options["knobs"]
    device = devices.rank_device(knobs.get("device", "cpu"))
    dist.init_process_group(devices.collective_backend(device))
    model_dir, knobs, version = (
        Path(options["model"]),
        {**knobs, "device": device},
        options["version"],
    )
    if dist.get_rank() != 0:
        follow(args.engine, model_dir, knobs, version)
        os._exit(0)  # see pipeline/engines/distributed.py: torch's CPU collectives' teardown
    import uvicorn

    from pipeline.serve.app import ServeSettings, create_app

    slot = RankZeroSlot(args.engine, model_dir, knobs, version)
    print(
        f"lpx serve: {args.engine} on {slot.world_size} ranks, {model_dir} (version "
        f"{slot.version.weight_version}) on http://{url_host(options['host'])}:{options['port']}",
        file=sys.stderr,
    )
    try:
        uvicorn.run(
            create_app(slot, ServeSettings(**options["settings"])),
            host=options["host"],
            port=options["port"],
            log_level="warning",
        )
    finally:
        slot.stop()
    os._exit(0)


if __name__ == "__main__":
    main()
