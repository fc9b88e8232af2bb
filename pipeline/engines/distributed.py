"""Distributed replay: launch a scoring engine on N ranks with torchrun, gather on rank 0.

`lpx replay --engine fsdp --nproc 2` starts the ranks itself, so users never write a torchrun
line: on a GPU with `torch.distributed.run`, on the CPU forked from a warm interpreter with
torchrun's variables (warm_ranks.py; torchrun there too with LPX_WARM_START=0); under an existing torchrun/deepspeed launch (RANK and WORLD_SIZE set)
the same code runs in the current process instead. Micro-batches are dealt round-robin over
the data-parallel ranks; every rank takes the same number of steps (a one-token dummy batch
where it has run out) because sharded engines all-gather weights collectively per forward.

On CUDA each rank owns one GPU (LOCAL_RANK) and the ranks talk over NCCL; on the CPU over
gloo. Every rank writes its own log (``rank<R>.log``) and, when it fails, a one-line error
file (``rank<R>.error.json``), so the launcher can quote the failing rank's own exception
instead of torchrun's ChildFailedError.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

from pipeline import devices
from pipeline.engines import warm_ranks
from pipeline.errors import BadInput
from pipeline.fixture.io import read_table, write_table
from pipeline.fixture.table import TokenTable


class DistributedScoringEngine:
    """Base for engines that score under torch.distributed; subclasses implement `open`."""

    name = "distributed"
    takes_device = True  # --device: one rank per GPU on CUDA, gloo ranks on the CPU
    log_dir: Path | None = None  # where each rank's log goes (None: a temporary directory)

    def open(self, model_dir: Path, knobs: dict, rank: int, world_size: int):
        """Build the sharded model; return a session with dp_rank, dp_size, score(pairs),
        micro_batch_size and metadata() (called on every rank: it may gather)."""
        raise NotImplementedError

    def score(self, fixture: TokenTable, model_dir: Path, knobs: dict) -> TokenTable:
        knobs = dict(knobs)
        nproc = knobs.pop("nproc", 1)
        with tempfile.TemporaryDirectory(prefix="lpx-replay-") as tmp:
            fixture_path = write_table(fixture, Path(tmp) / "fixture.parquet")
            out_path = Path(tmp) / "replay.parquet"
            launch(self.name, fixture_path, Path(model_dir), out_path, knobs, nproc, self.log_dir)
            return read_table(out_path, expect_kind="replay")


def under_launcher() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def plan_ranks(knobs: dict, nproc) -> tuple[int, str, dict]:
    """(ranks, device kind, extra environment) for a launch, checked before any rank starts:
    ``auto`` ranks = every visible GPU (1 on the CPU), at most one rank per GPU, and
    ``cuda:N`` pins that GPU through CUDA_VISIBLE_DEVICES."""
    spec = devices.parse_device(str(knobs.get("device", "auto")), "--device")
    device = devices.resolve_device(spec)
    if nproc == "auto":
        nproc = devices.visible_gpus() if devices.is_cuda(device) else 1
    nproc = int(nproc)
    if nproc < 1:
        raise BadInput("--nproc must be at least 1.")
    env = {}
    if ":" in spec:  # one named GPU: that GPU alone is visible to the ranks
        if nproc > 1:
            raise BadInput(
                f"--device {spec} names one GPU, and --nproc {nproc} needs one per rank; pass "
                "--device cuda and choose the GPUs with CUDA_VISIBLE_DEVICES."
            )
        env["CUDA_VISIBLE_DEVICES"] = devices.physical_gpu(int(spec.split(":")[1]))
    devices.check_ranks(nproc, device)
    return nproc, devices.device_kind(device), env


def launch(
    engine: str,
    fixture_path: Path,
    model_dir: Path,
    out_path: Path,
    knobs: dict,
    nproc=1,
    log_dir: Path | None = None,
) -> None:
    """Run the engine on `nproc` ranks and write the replay to `out_path`."""
    if under_launcher():
        run_worker(engine, fixture_path, model_dir, out_path, knobs)
        return
    nproc, kind, env = plan_ranks(knobs, nproc)
    knobs = {**knobs, "device": kind}
    logs = prepare_log_dir(log_dir, engine)
    worker = ["--engine", engine, "--fixture", str(fixture_path), "--model", str(model_dir),
              "--out", str(out_path), "--knobs", json.dumps(knobs), "--log-dir", str(logs)]  # fmt: skip
    if kind == "cpu":  # the ranks forked from a warm interpreter (warm_ranks.py says why)
        for _ in range(2):  # once more if another process took the store's port meanwhile
            launch = warm_ranks.run_ranks(
                "pipeline.engines.distributed", worker, nproc, rank_environment(env), logs, engine
            )
            if launch is None or not (launch.returncode and warm_ranks.address_taken(logs)):
                break
        if launch is not None:
            (logs / "launch.log").write_text("\n".join(launch.lines) + "\n")
            if launch.returncode != 0 or not Path(out_path).is_file():
                # in the order the ranks exited: a rank the launcher killed after the grace
                # (SIGKILL too) exits after the one that failed first
                why = failure(logs, list(launch.codes.items()), "")
                raise BadInput(f"{engine} replay on {nproc} rank(s) failed: {why}")
            return
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={nproc}", "-m", "pipeline.engines.distributed", *worker]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, env=rank_environment(env))
    (logs / "torchrun.log").write_text(result.stdout + result.stderr, errors="replace")
    if result.returncode != 0 or not Path(out_path).is_file():
        output = result.stderr + result.stdout
        why = failure(logs, torchrun_reported(output), output)
        raise BadInput(f"{engine} replay on {nproc} rank(s) failed: {why}")


def rank_environment(extra: dict | None = None) -> dict:
    """The ranks' environment: one thread per CPU rank unless set, and lpx's own NCCL
    settings on top of the user's."""
    return {
        **os.environ,
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        **(extra or {}),
    }


def prepare_log_dir(log_dir: Path | None, engine: str) -> Path:
    """The directory the ranks log into, emptied of an earlier launch's rank files."""
    if log_dir is None:
        return Path(tempfile.mkdtemp(prefix=f"lpx-{engine}-ranks-"))
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    for old in log_dir.glob("rank*"):
        old.unlink()
    return log_dir


def torchrun_reported(output: str) -> list[tuple[int, int]]:
    """(rank, exit code) of each rank torchrun reported failed (its ChildFailedError)."""
    found = re.findall(r"rank\s*:\s*(\d+)[^\n]*\n\s*exitcode\s*:\s*(-?\d+)", output)
    return [(int(rank), int(code)) for rank, code in found]


def failure(logs: Path, reported: list[tuple[int, int]], output: str) -> str:
    """The failing rank's own error and where its log is, from each rank's exit code as the
    launcher reported it (``reported``: in the order the ranks exited, where the launcher
    knows it) and the launcher's ``output``.

    A rank killed by a signal it did not get from the launcher (SIGKILL from the kernel's
    OOM killer, SIGSEGV) is the cause: the others only fail after it. Otherwise the rank
    whose error came first is: the others fail after it, in a collective that lost its peer,
    or are stopped by the launcher.
    """
    errors = {}
    for path in logs.glob("rank*.error.json"):
        try:
            record = json.loads(path.read_text())
            errors[int(record["rank"])] = record
        except (OSError, ValueError, KeyError, TypeError):
            continue
    reported = [(rank, code) for rank, code in reported if code != 0]
    stopped_by_torchrun = (signal.SIGTERM, signal.SIGINT)
    crashed = [
        (rank, code)
        for rank, code in reported
        if code < 0 and -code not in stopped_by_torchrun and rank not in errors
    ]
    if crashed or (reported and not errors):
        rank, code = (crashed or reported)[0]
        how = f"was killed by {_signal_name(-code)}" if code < 0 else f"exited {code}"
        tail = _last_line(logs / f"rank{rank}.log")
        said = f"; its last line: {tail}" if tail else ""
        return f"rank {rank} {how}{said} (log: {logs / f'rank{rank}.log'})"
    if errors:
        first = min(errors.values(), key=lambda e: e.get("time", 0))
        rank = first["rank"]
        return f"rank {rank}: {first.get('message')} (log: {logs / f'rank{rank}.log'})"
    return f"{_worker_error(output)} (logs: {logs})"


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _last_line(path: Path) -> str:
    try:
        lines = [line.strip() for line in path.read_text(errors="replace").splitlines()]
    except OSError:
        return ""
    lines = [line for line in lines if line]
    return lines[-1][-300:] if lines else ""


def run_worker(
    engine_name: str, fixture_path: Path, model_dir: Path, out_path: Path, knobs: dict
) -> None:
    import torch.distributed as dist

    from pipeline.engines import scoring_engine
    from pipeline.engines.scoring import micro_batch_where, replay_table

    # The launcher passes the device kind; under the user's own torchrun it may be any spec.
    spec = devices.resolve_device(str(knobs.get("device", "auto")), "--device")
    device = devices.rank_device(devices.device_kind(spec))
    knobs = {**knobs, "device": device}
    if not dist.is_initialized():
        dist.init_process_group(devices.collective_backend(device))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    try:
        fixture = read_table(fixture_path, expect_kind="fixture")
        started = time.perf_counter()
        session = scoring_engine(engine_name).open(Path(model_dir), knobs, rank, world_size)
        tf32 = devices.set_tf32(device, session.settings.allow_tf32)
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
            # Router replay (R3): each pair's rollout routing, [positions, MoE layers, k]
            forced = forced_routing(fixture, batch or [0], session.settings)
            # Ranks out of work still join the collectives of this step.
            try:
                scored = session.score(
                    pairs or [(fixture.prompt_of(0)[:1], fixture.completion_of(0)[:1])],
                    **({"routing": forced if batch else [forced[0][:1]]} if forced else {}),
                )
            except Exception as error:
                if not devices.is_out_of_memory(error):
                    raise
                where = micro_batch_where(fixture, batch or [0], size)
                raise devices.out_of_memory(
                    device,
                    f"{where} on rank {rank}",
                    f"--micro-batch-size (now {size}), or add ranks (--nproc)",
                ) from None
            results.update(zip(batch, scored, strict=False) if batch else ())
        timing = {"load_s": loaded - started, "score_s": time.perf_counter() - loaded}
        metadata = session.metadata()
        metadata = {
            **metadata,
            "hardware": {**devices.hardware(device), **tf32},
            "layout": {**metadata.get("layout", {}), "device": devices.device_kind(device)},
            "timing": timing,
        }
        metadata["engine"]["versions"].update(
            {k: v for k, v in devices.stack_versions(device).items() if v}
        )
        gathered = [None] * world_size if rank == 0 else None
        dist.gather_object(results, gathered, dst=0)
        if rank == 0:
            merged = {i: s for part in gathered for i, s in part.items()}
            ordered = [merged[i] for i in range(fixture.num_sequences)]
            write_table(replay_table(fixture, ordered, metadata, session.prompt_logprobs), out_path)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def forced_routing(fixture, indices, settings) -> list | None:
    """The fixture's routed experts per sequence when the replay forces them (router_replay),
    else None; a fixture without routing is refused, naming what records it."""
    if not getattr(settings, "router_replay", False):
        return None
    from pipeline.routing import sequence_routing

    return [sequence_routing(fixture, i) for i in indices]


def _worker_error(output: str) -> str:
    """The most telling line of a failed worker's output."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    for marker in ("BadInput", "Error:", "Error", "error"):
        hits = [line for line in lines if marker in line and "Traceback" not in line]
        if hits:
            return hits[-1][-500:]
    return (lines[-1] if lines else "no output")[-500:]


def log_rank_output(log_dir: Path | None) -> None:
    """Send this rank's stdout and stderr (C++ and NCCL included) to its own log file."""
    if log_dir is None:
        return
    rank = os.environ.get("RANK", "0")
    log = os.open(Path(log_dir) / f"rank{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)


def report_rank_error(log_dir: Path | None, error: BaseException) -> None:
    """Write this rank's failure where the launcher looks: one line, and its traceback in
    the rank's log."""
    from pipeline.errors import BadInput

    if isinstance(error, BadInput):
        message = error.message
    else:
        first = (str(error).strip().splitlines() or [""])[0][:500]
        message = f"{type(error).__name__}: {first}"
        traceback.print_exception(error, file=sys.stderr)
    print(f"Error: rank {os.environ.get('RANK', '0')}: {message}", file=sys.stderr, flush=True)
    if log_dir is None:
        return
    record = {"rank": int(os.environ.get("RANK", "0")), "time": time.time(), "message": message}
    path = Path(log_dir) / f"rank{record['rank']}.error.json"
    path.write_text(json.dumps(record))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description="lpx distributed replay worker (started by torchrun)"
    )
    parser.add_argument("--engine", required=True)
    parser.add_argument("--fixture", required=True, type=Path)
    parser.add_argument("--model", required=True, type=Path)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--knobs", default="{}")
    parser.add_argument("--log-dir", type=Path)
    args = parser.parse_args(argv)
    log_rank_output(args.log_dir)
    exit_rank(
        lambda: run_worker(args.engine, args.fixture, args.model, args.out, json.loads(args.knobs)),
        args.log_dir,
    )


def exit_rank(work, log_dir) -> None:
    """Run a rank's work, report any failure to its log, and leave without the interpreter's
    teardown: now and then a C++ destructor of torch's CPU collectives aborts there
    ("terminate called without an active exception", SIGABRT), which failed a finished
    replay in about one run of the distributed tests in three. Exit 2 on bad input, 1 on
    any other failure, 0 when the work finished (its output already written)."""
    code = 0
    try:
        work()
    except BaseException as error:  # noqa: BLE001 - every failure is reported, then exits
        report_rank_error(log_dir, error)
        code = 2 if isinstance(error, BadInput) else 1
    leave_rank(code)


def leave_rank(code: int) -> None:
    """End a rank whose work is done (its output written) without the interpreter's
    teardown, where torch's CPU collectives now and then abort (exit_rank says how)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
