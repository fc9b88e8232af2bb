"""Replay throughput of every family on every engine vs the HF reference, same batches, and
the HF harness's overhead over a bare forward (MoE routing recorded, as replay records it).

    .venv/bin/python bench/replay_engines.py                       # 5 families, ~12 min
    .venv/bin/python bench/replay_engines.py --arch qwen3_moe      # one family

For each family (`lpx make-model --arch`, cached under ~/.cache/lpx/bench-models) an HF fp32
rollout of 64 sequences x 64 tokens is replayed with micro-batch 8 through the whole `lpx
replay` command by each engine: hf, vllm (CPU), fsdp and deepspeed ZeRO-3 on 2 ranks,
megatron TP=2; for a MoE also hf and megatron with router replay (R3), megatron EP=2 and
TP=2 + EP=2. `score_s` is the scoring loop as the engine timed it (model load and process
start excluded), `vs hf` its ratio to the HF engine's on the same family, `wall_s` the
whole command. The overhead line times `score_batch` against `model(input_ids,
attention_mask)` on an unhooked copy of the model (median of 5, 64 x 128 tokens), and once
more on a random Qwen3-MoE 8 x 512 where the forward, not Python, dominates.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import _bootstrap  # noqa: F401
import models
from _commands import run_lpx
from run import bench_replay

from pipeline.engines.base import SamplingParams
from pipeline.engines.hf.rollout import HFRolloutEngine
from pipeline.families import families
from pipeline.fixture.io import read_table, write_table
from pipeline.prompts import smoke_prompt_texts, tokenize

TWO_RANKS = ["--nproc", "2"]
R3 = ["--set", "router_replay=true"]
ENGINES = [
    ("hf", []),
    ("vllm", []),
    ("fsdp", TWO_RANKS),
    ("deepspeed", [*TWO_RANKS, "--set", "zero_stage=3"]),
    ("megatron TP2", [*TWO_RANKS, "--set", "tensor_parallel_size=2"]),
]
MOE_ENGINES = [
    ("hf R3", R3),
    ("megatron TP2 R3", [*TWO_RANKS, "--set", "tensor_parallel_size=2", *R3]),
    ("megatron EP2", [*TWO_RANKS, "--set", "tensor_parallel_size=1",
                      "--set", "expert_model_parallel_size=2"]),
    ("megatron TP2+EP2", [*TWO_RANKS, "--set", "tensor_parallel_size=2",
                          "--set", "expert_model_parallel_size=2",
                          "--set", "expert_tensor_parallel_size=1"]),
]  # fmt: skip


def replay_rows(model: Path, engines, samples: int, tokens: int) -> tuple[int, dict]:
    """(completion tokens, {engine: (score_s, load_s, wall_s)}) of one HF rollout replayed by
    each engine through the whole `lpx replay` command."""
    sampling = SamplingParams(max_tokens=tokens, samples_per_prompt=samples, ignore_eos=True)
    fixture = HFRolloutEngine().rollout(model, tokenize(model, smoke_prompt_texts()), sampling, {})
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        fixture_path = write_table(fixture, Path(tmp) / "fixture.parquet")
        for label, extra in engines:
            out = Path(tmp) / f"{label.replace(' ', '_')}.parquet"
            wall, done = run_lpx(
                "replay", fixture_path, "--engine", label.split()[0], "--micro-batch-size", "8",
                *extra, "--out", out,
            )  # fmt: skip
            if done.returncode:
                print(f"  {label}: exit {done.returncode}: {done.stderr.strip()[-300:]}")
                continue
            timing = read_table(out).metadata["timing"]
            results[label] = (timing["score_s"], timing["load_s"], wall)
    return fixture.num_completion_tokens, results


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--arch", action="append", help="a family (repeatable); default all")
    parser.add_argument("--samples", type=int, default=8, help="samples per prompt (8 prompts)")
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    for arch in args.arch or list(families()):
        model = models.family(arch)
        moe = families()[arch].moe
        tokens, results = replay_rows(
            model, ENGINES + (MOE_ENGINES if moe else []), args.samples, args.tokens
        )
        print(f"\n{arch}: {tokens:,} completion tokens, micro-batch 8, tiny model, CPU")
        print(
            f"  {'engine':<26} {'score_s':>8} {'tokens/s':>10} {'vs hf':>7} {'load_s':>7} {'wall_s':>7}"
        )
        reference = results.get("hf", (float("nan"),))[0]
        for label, (score, load, wall) in results.items():
            print(
                f"  {label:<26} {score:>8.3f} {tokens / score:>10,.0f} {score / reference:>6.2f}x "
                f"{load:>7.2f} {wall:>7.1f}"
            )
        overhead = bench_replay(model_dir=model)
        print(
            f"  hf harness{' (routing recorded)' if moe else ''} {overhead['harness_s'] * 1e3:.1f} ms "
            f"vs bare forward {overhead['bare_forward_s'] * 1e3:.1f} ms on "
            f"{overhead['tokens']:,} tokens = {overhead['overhead_ratio']:.3f}x"
        )
    if not args.arch:  # the harness where the forward is not tiny: a Qwen3-MoE 8 x 512
        larger = models.random_moe(8, 512, 8, 2, 0.02, arch="qwen3_moe")
        overhead = bench_replay(sequences=16, model_dir=larger)
        print(
            f"\nqwen3_moe 8 x 512 (8 experts, top-2, random): hf harness (routing recorded) "
            f"{overhead['harness_s'] * 1e3:.1f} ms vs bare forward "
            f"{overhead['bare_forward_s'] * 1e3:.1f} ms on {overhead['tokens']:,} tokens "
            f"= {overhead['overhead_ratio']:.3f}x"
        )


if __name__ == "__main__":
    main()
