"""Distributed replay: launch a scoring engine on N ranks with torchrun, gather on rank 0.

`lpx replay --engine fsdp --nproc 2` starts `torch.distributed.run` itself, so users never
write a torchrun line; under an existing torchrun/deepspeed launch (RANK and WORLD_SIZE set)
the same code runs in the current process instead. Micro-batches are dealt round-robin over
the data-parallel ranks; every rank takes the same number of steps (a one-token dummy batch
where it has run out) because sharded engines all-gather weights collectively per forward.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pipeline.errors import BadInput
from pipeline.fixture.io import read_table, write_table
from pipeline.fixture.table import TokenTable


class DistributedScoringEngine:
    """Base for engines that score under torch.distributed; subclasses implement `open`."""

    name = "distributed"

    def open(self, model_dir: Path, knobs: dict, rank: int, world_size: int):
        """Build the sharded model; return a session with dp_rank, dp_size, score(pairs),
        micro_batch_size and metadata() (called on every rank: it may gather)."""
        raise NotImplementedError

    def score(self, fixture: TokenTable, model_dir: Path, knobs: dict) -> TokenTable:
        knobs = dict(knobs)
        nproc = int(knobs.pop("nproc", 1))
        with tempfile.TemporaryDirectory(prefix="lpx-replay-") as tmp:
            fixture_path = write_table(fixture, Path(tmp) / "fixture.parquet")
            out_path = Path(tmp) / "replay.parquet"
            launch(self.name, fixture_path, Path(model_dir), out_path, knobs, nproc)
            return read_table(out_path, expect_kind="replay")


def under_launcher() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def launch(
    engine: str, fixture_path: Path, model_dir: Path, out_path: Path, knobs: dict, nproc: int
) -> None:
    """Run the engine on `nproc` ranks and write the replay to `out_path`."""
    if under_launcher():
        run_worker(engine, fixture_path, model_dir, out_path, knobs)
        return
    if nproc < 1:
        raise BadInput("--nproc must be at least 1.")
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        "pipeline.engines.distributed",
        "--engine",
        engine,
        "--fixture",
        str(fixture_path),
        "--model",
        str(model_dir),
        "--out",
        str(out_path),
        "--knobs",
        json.dumps(knobs),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    result = subprocess.run(command, capture_output=True, text=True, env=env)
    if result.returncode != 0 or not Path(out_path).is_file():
        message = _worker_error(result.stderr + result.stdout)
        raise BadInput(f"{engine} replay on {nproc} rank(s) failed: {message}")


def run_worker(
    engine_name: str, fixture_path: Path, model_dir: Path, out_path: Path, knobs: dict
) -> None:
    import torch
    import torch.distributed as dist

    from pipeline.engines import scoring_engine
    from pipeline.engines.hf_replay import replay_table

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    try:
        fixture = read_table(fixture_path, expect_kind="fixture")
        started = time.perf_counter()
        session = scoring_engine(engine_name).open(Path(model_dir), knobs, rank, world_size)
        loaded = time.perf_counter()
        indices = list(range(fixture.num_sequences))
        size = session.micro_batch_size
        batches = [indices[i : i + size] for i in range(0, len(indices), size)]
        mine = batches[session.dp_rank :: session.dp_size]
        steps = -(-len(batches) // session.dp_size)
        results = {}
        for step in range(steps):
            batch = mine[step] if step < len(mine) else []
            pairs = [(fixture.prompt_of(i), fixture.completion_of(i)) for i in batch]
            # Ranks out of work still join the collectives of this step.
            scored = session.score(
                pairs or [(fixture.prompt_of(0)[:1], fixture.completion_of(0)[:1])]
            )
            results.update(zip(batch, scored, strict=False) if batch else ())
        timing = {"load_s": loaded - started, "score_s": time.perf_counter() - loaded}
        metadata = {**session.metadata(), "timing": timing}
        gathered = [None] * world_size if rank == 0 else None
        dist.gather_object(results, gathered, dst=0)
        if rank == 0:
            merged = {i: s for part in gathered for i, s in part.items()}
            ordered = [merged[i] for i in range(fixture.num_sequences)]
            write_table(replay_table(fixture, ordered, metadata, session.prompt_logprobs), out_path)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _worker_error(output: str) -> str:
    """The most telling line of a failed worker's output."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    for marker in ("BadInput", "Error:", "Error", "error"):
        hits = [line for line in lines if marker in line and "Traceback" not in line]
        if hits:
            return hits[-1][-500:]
    return (lines[-1] if lines else "no output")[-500:]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description="lpx distributed replay worker (started by torchrun)"
    )
    parser.add_argument("--engine", required=True)
    parser.add_argument("--fixture", required=True, type=Path)
    parser.add_argument("--model", required=True, type=Path)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--knobs", default="{}")
    args = parser.parse_args(argv)
    try:
        run_worker(args.engine, args.fixture, args.model, args.out, json.loads(args.knobs))
    except BadInput as error:
        print(f"BadInput: {error.message}", file=sys.stderr)
        sys.exit(2)
    # The replay is written (temp + rename) and the process group destroyed. Skip the
    # interpreter's teardown: now and then a C++ destructor of torch's CPU collectives
    # aborts there ("terminate called without an active exception", SIGABRT), which failed
    # a finished replay in about one run of the distributed tests in three.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
