"""GPU lane benchmark (issue 20): the HF replay harness on CUDA against a bare forward of the
same micro-batches (fp32 and bf16), and one fixture replayed on the CPU and on CUDA as whole
`lpx replay` commands, at three model scales; the distributed engines' CUDA replays too.

    python bench/gpu.py                                   # tiny, 16x1024, 24x2048 on CUDA
    python bench/gpu.py --scales tiny,16x1024 --cpu-scales tiny --engine-scales tiny

Scales are `tiny` (the model lpx builds) or `LAYERSxWIDTH`, a random-init llama (std 0.02,
vocabulary 32,000) built offline. Prints one line per measurement with its ratio to target:
harness / bare forward <= 1.05. Needs a CUDA device for everything but the CPU replays.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import tempfile
import time
from pathlib import Path

import _bootstrap  # noqa: F401
import models
import numpy as np
from _commands import run_lpx

from pipeline.engines.hf.model import load_model
from pipeline.engines.hf.replay import ReplayKnobs, _padded_inputs, score_batches
from pipeline.engines.metadata import model_metadata
from pipeline.fixture.io import read_table, write_table
from pipeline.fixture.table import table_from_sequences

TARGET_HARNESS_RATIO = 1.05
ENGINE_ARGS = {
    "hf": [],
    "fsdp": ["--nproc", "1"],
    "deepspeed": ["--nproc", "1", "--set", "zero_stage=3"],
    "megatron": ["--nproc", "1"],
}


def build_model(scale: str, root: Path) -> Path:
    """The tiny model, or a random llama "LAYERSxWIDTH" in ``root``."""
    if scale == "tiny":
        return models.tiny()
    layers, width = (int(part) for part in scale.split("x"))
    return models.llama_without_tokenizer(root / f"llama-{scale}", layers, width)


def workload(model_dir: Path, sequences: int, completion: int, seed: int = 0):
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    rng = np.random.default_rng(seed)
    return [
        (
            rng.integers(3, vocab, int(rng.integers(16, 48))).astype(np.int64),
            rng.integers(3, vocab, completion).astype(np.int64),
        )
        for _ in range(sequences)
    ]


def harness_vs_bare(model_dir: Path, pairs, dtype: str, micro_batch: int, repeats: int) -> dict:
    """The scoring loop `lpx replay --engine hf` runs (host-side padding, copies to the GPU,
    selected-row head, fp32 log-softmax, copies back) against `model(input_ids,
    attention_mask)` on inputs already on the GPU, same micro-batches, both synchronised."""
    import torch

    model = load_model(model_dir, dtype, device="cuda:0")
    settings = ReplayKnobs(dtype=dtype, micro_batch_size=micro_batch, device="cuda:0")
    batches = [pairs[i : i + micro_batch] for i in range(0, len(pairs), micro_batch)]
    padded = []
    for batch in batches:
        sequences = [np.concatenate(pair) for pair in batch]
        inputs = _padded_inputs(model, sequences, [np.arange(len(s)) for s in sequences], "right")
        padded.append({k: v.to("cuda:0") for k, v in inputs[0].items()})

    def harness():
        score_batches(model, batches, settings, progress=False)
        torch.cuda.synchronize()

    def bare():
        with torch.no_grad():
            for inputs in padded:
                model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"])
        torch.cuda.synchronize()

    harness(), bare()  # warm up: kernels chosen, allocator cached
    timings = {"harness": [], "bare": []}
    for _ in range(repeats):
        for name, function in (("harness", harness), ("bare", bare)):
            start = time.perf_counter()
            function()
            timings[name].append(time.perf_counter() - start)
    harness_s, bare_s = statistics.median(timings["harness"]), statistics.median(timings["bare"])
    return {"harness_s": harness_s, "bare_s": bare_s, "ratio": harness_s / bare_s}


def whole_replay(fixture: Path, model_dir: Path, out: Path, engine: str, *extra: str) -> dict:
    wall, done = run_lpx(
        "replay", fixture, "--model", model_dir, "--engine", engine, *ENGINE_ARGS[engine],
        *extra, "--out", out,
    )  # fmt: skip
    if done.returncode != 0:
        return {"error": (done.stderr.strip().splitlines() or ["?"])[-1]}
    timing = read_table(out).metadata["timing"]
    return {"wall_s": wall, "load_s": timing["load_s"], "score_s": timing["score_s"]}


def write_fixture(model_dir: Path, pairs, path: Path) -> Path:
    table = table_from_sequences(
        "fixture",
        [f"{i}-0" for i in range(len(pairs))],
        [p for p, _ in pairs],
        [c for _, c in pairs],
        {"rollout": [np.zeros(len(c), np.float32) for _, c in pairs]},
        metadata={"model": model_metadata(model_dir), "dtype": "float32"},
    )
    return write_table(table, path)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--scales", default="tiny,16x1024,24x2048")
    parser.add_argument("--cpu-scales", default="tiny,16x1024", help="also replayed on the CPU")
    parser.add_argument(
        "--engine-scales", default="tiny,16x1024", help="where fsdp, deepspeed, megatron run too"
    )
    parser.add_argument("--harness-only", action="store_true", help="no whole lpx replays")
    parser.add_argument("--sequences", type=int, default=64)
    parser.add_argument("--completion", type=int, default=512)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    import torch

    cuda = torch.cuda.is_available()
    print(
        f"device: {torch.cuda.get_device_name(0) if cuda else 'no CUDA device'}; torch "
        f"{torch.__version__}; {args.sequences} sequences x {args.completion} completion "
        f"tokens, micro-batch {args.micro_batch}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for scale in args.scales.split(","):
            model_dir = build_model(scale, root)
            pairs = workload(model_dir, args.sequences, args.completion)
            tokens = sum(len(c) for _, c in pairs)
            if cuda:
                for dtype in ("float32", "bfloat16"):
                    r = harness_vs_bare(model_dir, pairs, dtype, args.micro_batch, args.repeats)
                    gc.collect()
                    torch.cuda.empty_cache()
                    print(
                        f"{scale:>8} {dtype:8} harness {r['harness_s'] * 1e3:8.1f} ms vs bare "
                        f"forward {r['bare_s'] * 1e3:8.1f} ms = {r['ratio']:.3f}x (target <= "
                        f"{TARGET_HARNESS_RATIO}: ratio {r['ratio'] / TARGET_HARNESS_RATIO:.2f}); "
                        f"{tokens / r['harness_s']:,.0f} tokens/s"
                    )
            if args.harness_only:
                continue
            fixture = write_fixture(model_dir, pairs, root / f"fixture-{scale}.parquet")
            devices = (["cuda"] if cuda else []) + (
                ["cpu"] if scale in args.cpu_scales.split(",") else []
            )
            for device in devices:
                on_all = device == "cuda" and scale in args.engine_scales.split(",")
                engines = list(ENGINE_ARGS) if on_all else ["hf"]
                for engine in engines:
                    out = root / f"replay-{scale}-{device}-{engine}.parquet"
                    r = whole_replay(fixture, model_dir, out, engine, "--device", device)
                    if "error" in r:
                        print(f"{scale:>8} lpx replay --engine {engine} on {device}: {r['error']}")
                        continue
                    print(
                        f"{scale:>8} lpx replay --engine {engine:9} on {device:4}: whole command "
                        f"{r['wall_s']:7.2f} s (load {r['load_s']:6.2f} s, score "
                        f"{r['score_s']:7.2f} s = {tokens / r['score_s']:,.0f} tokens/s)"
                    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
