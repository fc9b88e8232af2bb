"""lpx benchmark: comparator throughput and memory, the whole comparison (diagnosis included)
in one process and as a whole `lpx compare` command, fixture size and load time, replay overhead.

Run with one command (prints ratios against the targets of issues #2 and #10):

    .venv/bin/python bench/run.py            # 10 million tokens, ~1 minute
    .venv/bin/python bench/run.py --tokens 1000000
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import tracemalloc
from pathlib import Path

# One core for the comparator target; set before numpy loads its thread pools.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import _bootstrap  # noqa: E402, F401
import numpy as np  # noqa: E402
from _commands import run_lpx  # noqa: E402

from pipeline.compare.metrics import batch_metrics, sequence_metrics  # noqa: E402
from pipeline.fixture.io import read_table, write_table  # noqa: E402
from pipeline.fixture.table import TokenTable, offsets_from_lengths  # noqa: E402

TARGET_TOKENS_PER_S = 20e6
TARGET_MEMORY_RATIO = 3.0
TARGET_BYTES_PER_TOKEN = 12.0
TARGET_LOAD_S = 2.0
TARGET_REPLAY_OVERHEAD = 1.10
TARGET_COMPARE_TOKENS_PER_S = 5e6  # compare_tables, diagnosis included, on 1 M tokens
TARGET_COMMAND_S = 5.0  # `lpx compare` from files to written outputs on 10 M tokens
DRIFT_SIGMA = 0.05  # nats: every token of every sequence drifts above any tau


def synthetic_logprobs(rng, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Rollout logprobs shaped like a sampled LM's (mostly near 0, a long tail) and a
    bf16-like training side."""
    rollout = -rng.exponential(0.6, n).astype(np.float32)
    train = (rollout + rng.normal(0, 0.01, n)).astype(np.float32)
    np.minimum(train, 0, out=train)
    return train, rollout


def bench_comparator(tokens: int, repeats: int = 3) -> dict:
    rng = np.random.default_rng(0)
    train, rollout = synthetic_logprobs(rng, tokens)
    offsets = offsets_from_lengths(np.full(tokens // 1000, 1000))
    batch_metrics(train[:100_000], rollout[:100_000], 0.1)  # warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        batch_metrics(train, rollout, 0.1)
        times.append(time.perf_counter() - start)
    tracemalloc.start()
    batch_metrics(train, rollout, 0.1)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    start = time.perf_counter()
    sequence_metrics(train, rollout, offsets)
    per_sequence_s = time.perf_counter() - start
    best = min(times)
    return {
        "tokens": tokens,
        "batch_metrics_s": best,
        "tokens_per_s": tokens / best,
        "peak_extra_memory_ratio": peak / (train.nbytes + rollout.nbytes),
        "sequence_metrics_s": per_sequence_s,
    }


def synthetic_pair(tokens: int, mean_length: int, drifting: bool, seed: int = 3):
    """A fixture and its replay of about ``tokens`` completion tokens in sequences of
    ``mean_length`` on average (uniform from a quarter to 1.75x). Clean: the replay differs
    by fp32 noise; drifting: every token moves by N(0, DRIFT_SIGMA)."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(mean_length // 4, mean_length * 7 // 4, tokens // mean_length * 2 + 8)
    lengths = lengths[: np.searchsorted(np.cumsum(lengths), tokens)]
    n, sequences = int(lengths.sum()), len(lengths)
    _, rollout = synthetic_logprobs(rng, n)
    sigma = DRIFT_SIGMA if drifting else 1e-7
    replay = np.minimum(rollout + rng.normal(0, sigma, n), 0).astype(np.float32)
    shared = {
        "sequence_ids": [f"seq-{i}" for i in range(sequences)],
        "prompt_offsets": offsets_from_lengths(np.full(sequences, 16)),
        "prompt_ids": rng.integers(3, 32_000, sequences * 16).astype(np.int32),
        "completion_offsets": offsets_from_lengths(lengths),
        "completion_ids": rng.integers(3, 32_000, n).astype(np.int32),
        "completion_mask": np.ones(n, dtype=bool),
    }
    metadata = {"dtype": "float32", "model": {"vocab_size": 32_000}}
    fixture = TokenTable(
        kind="fixture", channels={"rollout": rollout}, metadata=dict(metadata), **shared
    )
    replayed = TokenTable(
        kind="replay", channels={"replay": replay}, metadata=dict(metadata), **shared
    )
    return fixture, replayed


def bench_compare(tokens: int, mean_lengths=(512, 32), repeats: int = 3) -> list[dict]:
    """compare_tables (align, metrics, worst tokens, drift map, diagnosis, verdict) on a
    clean and on an all-drifting batch, long and short sequences."""
    from pipeline.compare.run import compare_tables

    rows = []
    for mean_length in mean_lengths:
        for drifting in (False, True):
            fixture, replay = synthetic_pair(tokens, mean_length, drifting)
            compare_tables(fixture, replay, "fixture", "replay")  # warm up
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                comparison = compare_tables(fixture, replay, "fixture", "replay")
                times.append(time.perf_counter() - start)
            n = len(fixture.completion_ids)
            rows.append(
                {
                    "tokens": n,
                    "sequences": len(fixture.sequence_ids),
                    "drifting": drifting,
                    "seconds": min(times),
                    "tokens_per_s": n / min(times),
                    "verdict": comparison.report.verdict,
                }
            )
    return rows


def bench_compare_command(tokens: int, mean_length: int = 512) -> list[dict]:
    """The whole `lpx compare` command (Python start, reading both files, the comparison,
    writing report.json, tokens.parquet and summary.md) on a clean and a drifting batch."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for drifting in (False, True):
            fixture, replay = synthetic_pair(tokens, mean_length, drifting)
            name = "drifting" if drifting else "clean"
            fixture_path = Path(tmp) / f"{name}-fixture.parquet"
            replay_path = Path(tmp) / f"{name}-replay.parquet"
            write_table(fixture, fixture_path)
            write_table(replay, replay_path)
            del fixture, replay
            out = Path(tmp) / f"{name}-out"
            seconds, done = run_lpx("compare", fixture_path, replay_path, "--out", out)
            if done.returncode not in (0, 1):
                raise SystemExit(f"lpx compare failed ({done.returncode}): {done.stderr}")
            rows.append({"drifting": drifting, "seconds": seconds, "exit": done.returncode})
    return rows


def bench_fixture(tokens: int) -> dict:
    rng = np.random.default_rng(1)
    sequences, length, prompt_length = tokens // 1000, 1000, 1
    _, rollout = synthetic_logprobs(rng, tokens)
    table = TokenTable(
        kind="fixture",
        sequence_ids=[f"seq-{i}" for i in range(sequences)],
        prompt_offsets=offsets_from_lengths(np.full(sequences, prompt_length)),
        prompt_ids=rng.integers(0, 32_000, sequences * prompt_length).astype(np.int32),
        completion_offsets=offsets_from_lengths(np.full(sequences, length)),
        completion_ids=rng.integers(0, 32_000, tokens).astype(np.int32),
        completion_mask=np.ones(tokens, dtype=bool),
        channels={"rollout": rollout},
        metadata={"dtype": "bfloat16"},
    )
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "fixture.parquet"
        start = time.perf_counter()
        write_table(table, path)
        write_s = time.perf_counter() - start
        size = path.stat().st_size
        loads = []
        for _ in range(3):
            start = time.perf_counter()
            read_table(path)
            loads.append(time.perf_counter() - start)
    return {
        "tokens": tokens,
        "bytes_per_token": size / tokens,
        "write_s": write_s,
        "load_s": min(loads),
    }


def bench_replay(
    sequences: int = 64, completion_tokens: int = 128, repeats: int = 5, model_dir=None
) -> dict:
    """HF replay harness (padding, selected-logprob gather, fp32 log-softmax; on a MoE the
    routing each router chose, recorded as replay records it) vs a bare
    ``model(input_ids, attention_mask)`` forward over the same micro-batches, on a second
    copy of the model that carries no routing hooks. The tiny model unless ``model_dir``."""
    import models
    import torch

    from pipeline.engines.hf.model import load_model
    from pipeline.engines.hf.replay import ReplayKnobs, _padded_inputs, score_batch

    model_dir = model_dir or models.tiny()
    model, bare_model = load_model(model_dir), load_model(model_dir)
    rng = np.random.default_rng(2)
    pairs = [
        (
            rng.integers(3, 512, rng.integers(8, 24)).astype(np.int32),
            rng.integers(3, 512, completion_tokens).astype(np.int32),
        )
        for _ in range(sequences)
    ]
    settings = ReplayKnobs(micro_batch_size=8)
    batches = [pairs[i : i + 8] for i in range(0, sequences, 8)]
    padded = [
        _padded_inputs(
            model,
            [np.concatenate(p).astype(np.int64) for p in batch],
            [np.arange(sum(map(len, p))) for p in batch],
            "right",
        )[0]
        for batch in batches
    ]

    def harness():
        for batch in batches:
            score_batch(model, batch, settings)

    def bare():
        with torch.no_grad():
            for inputs in padded:
                bare_model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"])

    timings = {"harness": [], "bare": []}
    harness(), bare()  # warm up
    for _ in range(repeats):
        for name, function in (("harness", harness), ("bare", bare)):
            start = time.perf_counter()
            function()
            timings[name].append(time.perf_counter() - start)
    harness_s, bare_s = statistics.median(timings["harness"]), statistics.median(timings["bare"])
    return {
        "tokens": sequences * completion_tokens,
        "harness_s": harness_s,
        "bare_forward_s": bare_s,
        "overhead_ratio": harness_s / bare_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=10_000_000)
    args = parser.parse_args()

    comparator = bench_comparator(args.tokens)
    print(
        f"comparator  {comparator['tokens']:,} tokens: batch metrics {comparator['batch_metrics_s']:.3f} s "
        f"= {comparator['tokens_per_s'] / 1e6:.1f} M tokens/s on one core "
        f"(target 20 M: ratio {comparator['tokens_per_s'] / TARGET_TOKENS_PER_S:.2f}x); "
        f"peak extra memory {comparator['peak_extra_memory_ratio']:.2f}x the two logprob arrays "
        f"(target <= {TARGET_MEMORY_RATIO:.0f}x); per-sequence metrics {comparator['sequence_metrics_s']:.3f} s"
    )
    for row in bench_compare(min(args.tokens, 1_000_000)):
        rate = row["tokens_per_s"]
        print(
            f"compare     {row['tokens']:,} tokens in {row['sequences']:,} sequences, "
            f"{'every sequence drifting' if row['drifting'] else 'clean'}: compare_tables "
            f"(diagnosis included) {row['seconds']:.3f} s = {rate / 1e6:.1f} M tokens/s "
            f"(target 5 M: ratio {rate / TARGET_COMPARE_TOKENS_PER_S:.2f}x); verdict {row['verdict']}"
        )
    for row in bench_compare_command(args.tokens):
        print(
            f"lpx compare {args.tokens:,} tokens, {'every sequence drifting' if row['drifting'] else 'clean'}: "
            f"whole command {row['seconds']:.2f} s (target < {TARGET_COMMAND_S:.0f} s: ratio "
            f"{row['seconds'] / TARGET_COMMAND_S:.2f}); exit {row['exit']}"
        )
    fixture = bench_fixture(args.tokens)
    print(
        f"fixture     {fixture['tokens']:,} tokens: {fixture['bytes_per_token']:.2f} bytes/completion token "
        f"(token id + rollout logprob + mask; target <= {TARGET_BYTES_PER_TOKEN:.0f}: ratio "
        f"{fixture['bytes_per_token'] / TARGET_BYTES_PER_TOKEN:.2f}); load {fixture['load_s']:.2f} s "
        f"(target < {TARGET_LOAD_S:.0f} s: ratio {fixture['load_s'] / TARGET_LOAD_S:.2f}); write {fixture['write_s']:.2f} s"
    )
    replay = bench_replay()
    print(
        f"hf replay   {replay['tokens']:,} completion tokens, tiny model: harness {replay['harness_s'] * 1e3:.1f} ms "
        f"vs bare forward {replay['bare_forward_s'] * 1e3:.1f} ms = {replay['overhead_ratio']:.3f}x "
        f"(target <= {TARGET_REPLAY_OVERHEAD:.2f}x)"
    )


if __name__ == "__main__":
    main()
