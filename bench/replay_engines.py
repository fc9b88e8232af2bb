"""Replay throughput of every engine on the tiny model vs the HF reference, same batches.

    .venv/bin/python bench/replay_engines.py            # 64 sequences x 64 tokens

Each engine scores the same fixture with micro-batch 8 through `lpx replay` (distributed
engines on 2 ranks over gloo, launched by lpx). `score_s` is the scoring loop as the engine
timed it (model load and process start excluded); `wall_s` is the whole command.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.engines.base import SamplingParams  # noqa: E402
from pipeline.engines.hf_rollout import HFRolloutEngine  # noqa: E402
from pipeline.fixture.io import read_table, write_table  # noqa: E402
from pipeline.prompts import smoke_prompt_texts, tokenize  # noqa: E402
from pipeline.smoke import default_model_dir, ensure_tiny_model  # noqa: E402

ENGINES = [
    ("hf", []),
    ("vllm", []),
    ("fsdp", ["--nproc", "2"]),
    ("deepspeed", ["--nproc", "2", "--set", "zero_stage=3"]),
    ("megatron", ["--nproc", "2", "--set", "tensor_parallel_size=2"]),
]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--samples", type=int, default=8, help="samples per prompt (8 prompts)")
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    model = ensure_tiny_model(default_model_dir())
    sampling = SamplingParams(
        max_tokens=args.tokens, samples_per_prompt=args.samples, ignore_eos=True
    )
    fixture = HFRolloutEngine().rollout(model, tokenize(model, smoke_prompt_texts()), sampling, {})
    tokens = fixture.num_completion_tokens
    with tempfile.TemporaryDirectory() as tmp:
        fixture_path = write_table(fixture, Path(tmp) / "fixture.parquet")
        results = {}
        for engine, extra in ENGINES:
            out = Path(tmp) / f"{engine}.parquet"
            started = time.perf_counter()
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "pipeline",
                    "replay",
                    str(fixture_path),
                    "--engine",
                    engine,
                    "--micro-batch-size",
                    "8",
                    *extra,
                    "--out",
                    str(out),
                ],
                check=True,
                capture_output=True,
            )
            wall = time.perf_counter() - started
            timing = read_table(out).metadata["timing"]
            results[engine] = (timing["score_s"], timing["load_s"], wall)
    reference = results["hf"][0]
    print(
        f"{tokens:,} completion tokens ({fixture.num_sequences} sequences), micro-batch 8, tiny llama, CPU"
    )
    print(
        f"{'engine':<28} {'score_s':>8} {'tokens/s':>10} {'vs hf':>7} {'load_s':>7} {'wall_s':>7}"
    )
    for (engine, extra), (score, load, wall) in zip(ENGINES, results.values(), strict=True):
        label = engine + (" (2 ranks)" if "--nproc" in extra else "")
        print(
            f"{label:<28} {score:>8.3f} {tokens / score:>10,.0f} {score / reference:>6.2f}x {load:>7.2f} {wall:>7.1f}"
        )


if __name__ == "__main__":
    main()
