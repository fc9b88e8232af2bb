"""Multi-version replay benchmark (issue 12): a batch whose trajectories straddle two weight
versions, replayed token by token under each token's own version, against a single-version
replay of the same batch. Target: at most 2x the single-version time.

Real HF engine, fp32, CPU, on a random llama big enough for scoring to dominate; the two
versions differ by a small step on every tensor. Pulls are timed apart (cold: verified and
cached once per version; warm: the cache reused).

    .venv/bin/python bench/multi_version.py          # ~2 minutes
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import _bootstrap  # noqa: F401
import models
import numpy as np
from _commands import run_lpx

from pipeline.engines.hf.replay import HFScoringEngine
from pipeline.fixture.table import table_from_sequences
from pipeline.weights.multi_version import replay_by_version
from pipeline.weights.store import publish

TARGET_RATIO = 2.0


def stepped_copy(model_dir: Path, out: Path, step: float = 1e-3) -> Path:
    """The model after a small step on every tensor (a trainer's update), tokenizer kept."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(model_dir, out)
    generator = torch.Generator().manual_seed(1)
    for path in out.glob("*.safetensors"):
        tensors = load_file(path)
        moved = {
            name: (t + step * torch.randn(t.shape, generator=generator, dtype=t.dtype))
            for name, t in tensors.items()
        }
        save_file(moved, path, metadata={"format": "pt"})
    return out


def straddling_fixture(sequences: int, prompt: int, completion: int, vocab: int):
    """Random token sequences; sequence i switches from version 1 to 2 at a random index."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, vocab, prompt) for _ in range(sequences)]
    completions = [rng.integers(3, vocab, completion) for _ in range(sequences)]
    switch = rng.integers(1, completion, sequences)
    versions = [np.where(np.arange(completion) < k, "1", "2") for k in switch]
    logprobs = [np.full(completion, -1.0) for _ in range(sequences)]
    return table_from_sequences(
        "fixture",
        [f"s{i}" for i in range(sequences)],
        prompts,
        completions,
        {"rollout": logprobs},
        weight_versions=versions,
        metadata={"model": {"vocab_size": vocab}},
    )


def best_of(repeats: int, run) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--completion", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        os.environ["LPX_CACHE"] = str(root / "cache")
        v1 = models.multi_head_llama(root / "v1", args.layers, args.hidden)
        v2 = stepped_copy(v1, root / "v2")
        store = root / "store"
        publish(v1, store)
        publish(v2, store, delta=True)
        fixture = straddling_fixture(args.sequences, args.prompt, args.completion, 4096)
        tokens = fixture.num_completion_tokens
        engine = HFScoringEngine()
        knobs = {"dtype": "fp32", "micro_batch_size": 16}
        print(
            f"workload: {args.sequences} sequences x {args.completion} completion tokens "
            f"({tokens:,}), random llama {args.hidden}x{args.layers}, HF fp32, CPU; every "
            "sequence straddles versions 1 and 2"
        )

        def score(sub, model_dir):
            return engine.score(sub, model_dir, knobs)

        start = time.perf_counter()
        by_version = replay_by_version(fixture, store, score, check_claims=False)
        cold = time.perf_counter() - start
        # a rollout that really came from the two versions: the clean input for compare
        fixture.channels = {"rollout": by_version.channels["replay"]}
        single = best_of(args.repeats, lambda: engine.score(fixture, v1, knobs))
        print(f"single-version replay: {single:.2f} s ({tokens / single:,.0f} tokens/s)")
        for check_claims in (False, True):
            multi = best_of(
                args.repeats,
                lambda c=check_claims: replay_by_version(fixture, store, score, check_claims=c),
            )
            ratio = multi / single
            print(
                f"multi-version replay, check_claims={check_claims}: {multi:.2f} s = "
                f"{ratio:.2f}x single (target <= {TARGET_RATIO}x: "
                f"{'met' if ratio <= TARGET_RATIO else 'NOT met'})"
            )
        print(f"first multi-version replay, pulling both versions into the cache: {cold:.2f} s")
        commands(root, fixture, v1, store, args.repeats)
    return 0


def commands(root: Path, fixture, v1: Path, store: Path, repeats: int) -> None:
    """The whole user-facing commands (Python start, Parquet in and out, model loads):
    `lpx replay` with one --model vs with --weights-store, then `lpx compare` of each (the
    single-version one drifts on every version-1 token: the failing input; the
    multi-version one is clean)."""
    from pipeline.fixture.io import write_table

    path = write_table(fixture, root / "fixture.parquet")
    common = ["--micro-batch-size", "16"]

    def run(*args):
        run_lpx(*args, timed=False).check_returncode()

    single = best_of(
        repeats, lambda: run("replay", path, "--model", v1, *common, "--out", root / "one.parquet")
    )
    multi = best_of(
        repeats,
        lambda: run(
            "replay", path, "--weights-store", store, *common, "--out", root / "multi.parquet"
        ),
    )
    ratio = multi / single
    print(
        f"lpx replay command: --model {single:.2f} s, --weights-store {multi:.2f} s = "
        f"{ratio:.2f}x (target <= {TARGET_RATIO}x: {'met' if ratio <= TARGET_RATIO else 'NOT met'})"
    )
    for name in ("one", "multi"):
        out = root / f"cmp-{name}"
        seconds, done = run_lpx(
            "compare", path, root / f"{name}.parquet", "--out", out, "--allow-weight-mismatch"
        )
        verdict = done.stdout.strip().splitlines()[-1] if done.stdout else ""
        print(
            f"lpx compare of the {'single' if name == 'one' else 'multi'}-version replay: "
            f"{seconds:.2f} s, exit {done.returncode} ({verdict})"
        )


if __name__ == "__main__":
    raise SystemExit(main())
