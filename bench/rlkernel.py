"""Speed of RL-Kernel's compare_logprobs against `lpx compare` on the same 1M tokens (issue 21).

    .venv/bin/python bench/rlkernel.py --rlk-src PATH/TO/RL-Kernel [--repeats 3] [--seed 0]

PATH/TO/RL-Kernel is a checkout of RL-Kernel at commit 71f0e7c2 (PR #107,
rl_engine/benchmarks/logprob_cross_engine.py); nothing of it is part of lpx. RL-Kernel runs in
its own process with the same Python (it needs torch and numpy only).

Workload: 20,000 sequences x 50 completion tokens (1,000,000 tokens), prompts of 4 token ids,
all drifting: rollout = -|N(0, 2)|, train = min(rollout + N(0, 0.05), 0) (clipped at 0:
lpx rejects logprobs > 1e-4 as bad input), the same float32 numbers for both tools.

Measures (median of --repeats runs each):
  rlk        RL-Kernel compare_logprobs: numpy -> its API objects + the call (also apart)
  lpx_cli    `lpx compare FIXTURE REPLAY --out DIR --quiet`, wall clock of the whole command
  lpx_core   pipeline.compare.run.compare_tables on the two tables already in memory
and prints the ratios RL-Kernel time / lpx time (issue 21's target: >= 20x for the command).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _bootstrap
import numpy as np
from _commands import run_lpx

HERE = _bootstrap.BENCH
N_SEQ, PROMPT_LEN, COMPLETION_LEN = 20_000, 4, 50


def make_data(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    shape = (N_SEQ, COMPLETION_LEN)
    rollout = -np.abs(rng.normal(0.0, 2.0, shape))
    train = np.minimum(rollout + rng.normal(0.0, 0.05, shape), 0.0)
    return {
        "ids": np.array([f"seq-{i:05d}" for i in range(N_SEQ)]),
        "prompts": rng.integers(3, 501, (N_SEQ, PROMPT_LEN), dtype=np.int32),
        "completions": rng.integers(3, 501, shape, dtype=np.int32),
        "rollout": rollout.astype(np.float32),
        "train": train.astype(np.float32),
    }


def build_tables(data):
    from pipeline.fixture.table import table_from_sequences

    ids = data["ids"].tolist()
    prompts, completions = list(data["prompts"]), list(data["completions"])

    def table(kind, channel, values):
        return table_from_sequences(
            kind, ids, prompts, completions, {channel: list(values)},
            metadata={"dtype": "float32"},
        )  # fmt: skip

    return table("fixture", "rollout", data["rollout"]), table("replay", "replay", data["train"])


def loadavg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def med(values):
    return statistics.median(values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--rlk-src", type=Path, required=True, help="an RL-Kernel checkout at commit 71f0e7c2"
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work", type=Path, help="scratch directory [default: a temporary one]")
    args = parser.parse_args()
    if not (args.rlk_src / "rl_engine" / "benchmarks" / "logprob_cross_engine.py").is_file():
        sys.exit(
            f"{args.rlk_src}: not an RL-Kernel checkout (no "
            "rl_engine/benchmarks/logprob_cross_engine.py)"
        )
    args.work = args.work or Path(tempfile.mkdtemp(prefix="lpx-rlk-"))

    from pipeline.compare.run import compare_tables
    from pipeline.fixture.io import write_table

    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    print(f"load average at start: {loadavg()}  (cores: {os.cpu_count()})")

    data = make_data(args.seed)
    npz = work / "workload.npz"
    np.savez(npz, **data)
    t0 = time.perf_counter()
    fixture, replay = build_tables(data)
    build_s = time.perf_counter() - t0
    fixture_path = write_table(fixture, work / "fixture.parquet")
    replay_path = write_table(replay, work / "replay.parquet")
    print(
        f"workload: {fixture.num_sequences} sequences, {fixture.num_completion_tokens} "
        f"completion tokens; lpx table_from_sequences x2: {build_s:.3f}s"
    )

    # 1. lpx compare, whole command.
    cli = []
    for i in range(args.repeats):
        out = work / f"lpx-out-{i}"
        shutil.rmtree(out, ignore_errors=True)
        seconds, proc = run_lpx("compare", fixture_path, replay_path, "--out", out, "--quiet")
        cli.append(seconds)
        if proc.returncode not in (0, 1):
            sys.exit(f"lpx compare exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
        print(
            f"  lpx compare run {i}: {cli[-1]:.3f}s exit {proc.returncode}: "
            f"{proc.stdout.strip()[:120]}"
        )
    lpx_report = json.loads((work / "lpx-out-0" / "report.json").read_text())
    print(f"load average after lpx cli: {loadavg()}")

    # 2. lpx compare_tables in-process on the tables in memory.
    core = []
    comparison = None
    for i in range(args.repeats):
        del comparison
        gc.collect()
        t0 = time.perf_counter()
        comparison = compare_tables(fixture, replay, fixture_path, replay_path)
        core.append(time.perf_counter() - t0)
        print(f"  lpx compare_tables run {i}: {core[-1]:.3f}s verdict {comparison.report.verdict}")
    m = comparison.report.metrics
    del comparison
    print(f"load average after lpx core: {loadavg()}")

    # 3. RL-Kernel compare_logprobs in its own process (same python: it has torch).
    proc = subprocess.run(
        [
            sys.executable,
            str(HERE / "rlkernel_worker.py"),
            str(args.rlk_src),
            str(npz),
            str(args.repeats),
        ],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        sys.exit(f"rlk worker failed:\n{proc.stdout}\n{proc.stderr}")
    rlk = json.loads(proc.stdout.strip().splitlines()[-1])
    for i, r in enumerate(rlk["runs"]):
        print(
            f"  RL-Kernel run {i}: convert {r['convert_s']:.3f}s + compare_logprobs "
            f"{r['call_s']:.3f}s = {r['total_s']:.3f}s"
        )
    print(f"  (RL-Kernel module import, mostly torch, not counted: {rlk['import_s']:.3f}s)")
    print(f"load average after RL-Kernel: {loadavg()}")

    s = rlk["summary"]
    print("\nsame numbers? (RL-Kernel vs lpx)")
    print(f"  tokens      {s['active_tokens']} vs {m['tokens']}")
    print(f"  max |d|     {s['max_abs_error']:.9g} vs {m['max_abs_diff']:.9g}")
    print(f"  mean |d|    {s['mean_abs_error']:.9g} vs {m['mean_abs_diff']:.9g}")
    print(
        f"  max rel     {s['max_relative_error']:.9g} vs {m['max_rel_diff']:.9g}"
        "  (differs by design: eps 1e-8 vs lpx's floor on |train|; train hits 0)"
    )
    print(f"  verdict     {s['status']} vs {lpx_report['verdict']}")

    rlk_total = med([r["total_s"] for r in rlk["runs"]])
    rlk_call = med([r["call_s"] for r in rlk["runs"]])
    rlk_conv = med([r["convert_s"] for r in rlk["runs"]])
    cli_m, core_m = med(cli), med(core)
    print(f"\nmedians of {args.repeats} runs (seconds):")
    print(
        f"  RL-Kernel compare_logprobs (convert+call): {rlk_total:.3f}  "
        f"[convert {rlk_conv:.3f}, call only {rlk_call:.3f}]"
    )
    print(f"  lpx compare whole command:                 {cli_m:.3f}")
    print(f"  lpx compare_tables in-process:             {core_m:.3f}")
    print("ratios (RL-Kernel time / lpx time):")
    print(
        f"  vs lpx whole command:   {rlk_total / cli_m:.2f}x  (call only: {rlk_call / cli_m:.2f}x)"
    )
    print(
        f"  vs lpx compare_tables:  {rlk_total / core_m:.2f}x  (call only: "
        f"{rlk_call / core_m:.2f}x)"
    )
    print(
        json.dumps(
            {
                "rlk_total_s": rlk_total,
                "rlk_call_s": rlk_call,
                "rlk_convert_s": rlk_conv,
                "rlk_import_s": rlk["import_s"],
                "lpx_cli_s": cli_m,
                "lpx_core_s": core_m,
                "ratio_cli": rlk_total / cli_m,
                "ratio_core": rlk_total / core_m,
                "raw": {"rlk": rlk["runs"], "lpx_cli": cli, "lpx_core": core},
            }
        )
    )


if __name__ == "__main__":
    main()
