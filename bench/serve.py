"""lpx serve benchmark (issue 11): throughput at saturation against direct in-process
replay on the same engine (the `lpx replay --engine hf` loop, and a length-sorted best case), p50/p99 latency at 1, 8 and 64 concurrent clients, and the
batching gain over a server that scores one sequence at a time.

With --invariance (issue 28) it measures instead what batching does to the logprobs: how far
an answer under concurrent load moves from the same request scored alone (the default, and
--batch-invariant, whose answers are also checked against the in-process HF replay at
micro-batch 1), and the saturation throughput of --batch-invariant against the default.
The default's number is what /health states (pipeline/serve/variance.py).

Each server is a real `lpx serve` process on the tiny model; clients are threads sending
JSON over HTTP from this process (on a 2-core machine they share the CPU with the server).

    .venv/bin/python bench/serve.py                     # ~2 minutes
    .venv/bin/python bench/serve.py --hidden 512 --layers 6   # a model big enough to batch
    .venv/bin/python bench/serve.py --invariance        # ~2 minutes
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import statistics
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import _bootstrap  # noqa: F401
import models
import numpy as np

from pipeline.serve.model_slot import ModelSlot
from pipeline.serve.process import serving

TARGET_SATURATION_RATIO = 0.9
SEQUENCES_PER_REQUEST = 4


def workload(sequences: int, prompt: int, completion: int, vocab: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    return [
        (
            rng.integers(3, vocab, int(rng.integers(prompt // 2, prompt * 3 // 2))).tolist(),
            rng.integers(
                3, vocab, int(rng.integers(completion // 2, completion * 3 // 2))
            ).tolist(),
        )
        for _ in range(sequences)
    ]


def in_process(
    model_dir: Path, pairs, max_batch: int, device: str = "cpu", repeats: int = 3
) -> float:
    """Completion tokens/s of ModelSlot.score over the pairs in batches of max_batch,
    sorted by length (what the server's scheduler does at saturation)."""
    slot = ModelSlot(model_dir, {"micro_batch_size": str(max_batch), "device": device})
    arrays = sorted(
        ((np.array(p), np.array(c)) for p, c in pairs), key=lambda x: len(x[0]) + len(x[1])
    )
    tokens = sum(len(c) for _, c in arrays)
    slot.score(arrays[:max_batch], False)  # warm up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for i in range(0, len(arrays), max_batch):
            slot.score(arrays[i : i + max_batch], False)
        best = min(best, time.perf_counter() - start)
    return tokens / best


def lpx_replay_rate(
    model_dir: Path, pairs, micro_batch: int, device: str = "cpu", repeats: int = 3
) -> float:
    """Completion tokens/s of the HF engine's replay loop as `lpx replay --engine hf` runs it:
    the pairs in fixture order, micro-batches of ``micro_batch``; model load and file I/O
    left out (the server has its model loaded too)."""
    from pipeline.engines.hf.model import load_model
    from pipeline.engines.hf.replay import ReplayKnobs, score_batch

    model = load_model(model_dir, device="cuda:0" if device == "cuda" else device)
    knobs = ReplayKnobs(micro_batch_size=micro_batch, device=str(model.device))
    arrays = [(np.array(p), np.array(c)) for p, c in pairs]
    tokens = sum(len(c) for _, c in arrays)
    score_batch(model, arrays[:micro_batch], knobs)  # warm up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for i in range(0, len(arrays), micro_batch):
            score_batch(model, arrays[i : i + micro_batch], knobs)
        best = min(best, time.perf_counter() - start)
    return tokens / best


@contextlib.contextmanager
def server(model_dir: Path, *options: str):
    with (
        tempfile.TemporaryDirectory() as tmp,
        serving(model_dir, *options, log_path=Path(tmp) / "log") as url,
    ):
        yield url


def drive(url: str, pairs, clients: int, per_request: int) -> dict:
    """Every pair scored once by `clients` threads taking requests of `per_request` pairs
    from a shared queue; returns completion tokens/s and request latencies."""
    requests = [pairs[i : i + per_request] for i in range(0, len(pairs), per_request)]
    bodies = [
        json.dumps({"sequences": [{"prompt_ids": p, "completion_ids": c} for p, c in r]}).encode()
        for r in requests
    ]
    latencies: list[float] = []
    lock = threading.Lock()
    next_index = iter(range(len(bodies)))

    def client():
        while True:
            with lock:
                i = next(next_index, None)
            if i is None:
                return
            request = urllib.request.Request(
                url + "/score", data=bodies[i], headers={"Content-Type": "application/json"}
            )
            start = time.perf_counter()
            with urllib.request.urlopen(request, timeout=600) as response:
                response.read()
            with lock:
                latencies.append(time.perf_counter() - start)

    threads = [threading.Thread(target=client) for _ in range(clients)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - start
    tokens = sum(len(c) for _, c in pairs)
    return {
        "tokens_per_s": tokens / elapsed,
        "p50_ms": 1000 * statistics.median(latencies),
        "p99_ms": 1000 * float(np.quantile(latencies, 0.99)),
    }


def invariance_requests(count: int, vocab: int, max_tokens: int = 64, seed: int = 0) -> list[dict]:
    """``count`` distinct /score bodies of 1-4 sequences whose prompt and completion hold
    1-``max_tokens`` tokens each; every fourth asks for prompt logprobs."""
    rng = np.random.default_rng(seed)
    return [
        {
            "sequences": [
                {
                    "prompt_ids": rng.integers(0, vocab, rng.integers(1, max_tokens + 1)).tolist(),
                    "completion_ids": rng.integers(
                        0, vocab, rng.integers(1, max_tokens + 1)
                    ).tolist(),
                }
                for _ in range(int(rng.integers(1, 5)))
            ],
            "prompt_logprobs": k % 4 == 3,
        }
        for k in range(count)
    ]


def post_score(url: str, body: bytes) -> list[np.ndarray]:
    """The completion logprobs of each sequence of one /score answer, as float32."""
    request = urllib.request.Request(
        url + "/score", data=body, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=600) as response:
        answer = json.loads(response.read())
    return [np.asarray(r["logprobs"], dtype=np.float32) for r in answer["results"]]


def under_load(url: str, bodies: list[bytes], clients: int, seconds: float) -> list:
    """(request index, logprobs) of every answer while ``clients`` threads send the bodies
    in turn (each from its own offset) for ``seconds``."""
    answers, lock, stop = [], threading.Lock(), time.monotonic() + seconds

    def client(offset: int):
        for k in itertools.count(offset):
            if time.monotonic() > stop:
                return
            i = k % len(bodies)
            got = post_score(url, bodies[i])
            with lock:
                answers.append((i, got))

    threads = [
        threading.Thread(target=client, args=(n * len(bodies) // clients,)) for n in range(clients)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return answers


def deviation(answers: list, alone: list[list[np.ndarray]]) -> dict:
    """Answers not bit-identical (float32 bytes) to the same request scored alone, and the
    largest |d| of any completion logprob."""
    differing, worst = 0, 0.0
    for i, got in answers:
        pairs = list(zip(got, alone[i], strict=True))
        differing += any(g.tobytes() != a.tobytes() for g, a in pairs)
        worst = max(worst, *(float(np.abs(g - a).max()) for g, a in pairs))
    return {"answers": len(answers), "differing": differing, "max_abs_diff": worst}


def in_process_alone(model_dir: Path, requests: list[dict], device: str, dtype: str) -> list:
    """Each request's sequences scored one per forward in process, as `lpx replay --engine hf
    --micro-batch-size 1` scores them (with the request's prompt_logprobs)."""
    from pipeline.engines.hf.model import load_model
    from pipeline.engines.hf.replay import ReplayKnobs, score_batch

    model = load_model(model_dir, dtype, device="cuda:0" if device == "cuda" else device)
    scored = []
    for request in requests:
        knobs = ReplayKnobs(
            dtype=dtype,
            micro_batch_size=1,
            device=str(model.device),
            prompt_logprobs=request["prompt_logprobs"],
        )
        scored.append(
            [
                score_batch(
                    model, [(np.array(s["prompt_ids"]), np.array(s["completion_ids"]))], knobs
                )[0].completion
                for s in request["sequences"]
            ]
        )
    return scored


def invariance(model_dir: Path, pairs, args) -> None:
    """What batching does to the answers, default vs --batch-invariant, and what the mode
    costs in saturation throughput."""
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    requests = invariance_requests(args.requests, vocab, args.max_tokens, args.seed)
    bodies = [json.dumps(r).encode() for r in requests]
    options = ("--device", args.device, "--set", f"dtype={args.dtype}", *args.serve_option)
    print(
        f"invariance ({' '.join(args.serve_option) or 'hf'}): {len(requests)} distinct requests of 1-4 sequences x 1-{args.max_tokens} "
        f"prompt and completion tokens, {args.dtype}, {args.device}, {args.clients} clients x "
        f"{args.seconds:g} s"
    )
    # the hf replay at micro-batch 1 is what an hf server in batch-invariant mode must equal
    replay_alone = (
        in_process_alone(model_dir, requests, args.device, args.dtype)
        if not args.serve_option
        else None
    )
    rates: dict[str, list[float]] = {"default": [], "batch-invariant": []}
    for mode, extra in (("default", ()), ("batch-invariant", ("--batch-invariant",))):
        with server(model_dir, *options, *extra) as url:
            alone = [post_score(url, body) for body in bodies]  # one at a time: nothing shared
            found = deviation(under_load(url, bodies, args.clients, args.seconds), alone)
            print(
                f"{mode}: {found['answers']:,} answers, {found['differing']:,} not bit-identical "
                f"to the same request scored alone, max |d| {found['max_abs_diff']:.3g}"
            )
            if replay_alone is not None:
                versus = deviation(list(enumerate(alone)), replay_alone)
                print(
                    f"{mode}: requests scored alone vs in-process hf replay at micro-batch 1: "
                    f"{versus['differing']} of {versus['answers']} differ, max |d| "
                    f"{versus['max_abs_diff']:.3g}"
                )
    if not args.repeats:
        return
    # alternate the two servers: this machine's other load drifts over minutes
    for _ in range(args.repeats):
        for mode, extra in (("default", ()), ("batch-invariant", ("--batch-invariant",))):
            with server(model_dir, *options, *extra) as url:
                drive(url, pairs[:64], 8, SEQUENCES_PER_REQUEST)  # warm up
                run = drive(url, pairs, 64, SEQUENCES_PER_REQUEST)
                rates[mode].append(run["tokens_per_s"])
    best = {mode: max(values) for mode, values in rates.items()}
    print(
        f"saturation (64 clients x {SEQUENCES_PER_REQUEST} sequences/request, best of "
        f"{args.repeats}): default {best['default']:,.0f} tokens/s, --batch-invariant "
        f"{best['batch-invariant']:,.0f} = {best['batch-invariant'] / best['default']:.2f}x "
        f"(runs: {', '.join(f'{m} {r:,.0f}' for m, v in rates.items() for r in v)})"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=int, default=512)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--completion", type=int, default=128)
    parser.add_argument("--max-batch", type=int, default=64)
    parser.add_argument(
        "--hidden",
        type=int,
        default=0,
        help="a random llama of this width instead of the tiny model",
    )
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--device", default="cpu", help="cpu or cuda: the server's and the loop's")
    parser.add_argument("--invariance", action="store_true",
                        help="measure batch dependence and --batch-invariant's cost instead")  # fmt: skip
    parser.add_argument("--requests", type=int, default=40, help="--invariance: distinct requests")
    parser.add_argument("--max-tokens", type=int, default=64,
                        help="--invariance: longest prompt and completion")  # fmt: skip
    parser.add_argument("--clients", type=int, default=16, help="--invariance: client threads")
    parser.add_argument("--seconds", type=float, default=20.0, help="--invariance: load time")
    parser.add_argument("--dtype", default="float32", help="--invariance: the servers' dtype")
    parser.add_argument("--seed", type=int, default=0, help="--invariance: the requests' seed")
    parser.add_argument("--serve-option", action="append", default=[],
                        help="--invariance: passed to both servers, e.g. --serve-option=--engine "
                        "--serve-option=fsdp --serve-option=--nproc --serve-option=2")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=2,
                        help="--invariance: saturation runs per mode (0: none)")  # fmt: skip
    args = parser.parse_args()
    if args.hidden:
        tmp = tempfile.TemporaryDirectory()
        model_dir = models.multi_head_llama(Path(tmp.name) / "model", args.layers, args.hidden)
    else:
        model_dir = models.tiny()
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    pairs = workload(args.sequences, args.prompt, args.completion, vocab)
    tokens = sum(len(c) for _, c in pairs)
    size = f"random llama {args.hidden}x{args.layers}" if args.hidden else "tiny model"
    print(
        f"workload: {len(pairs)} sequences, {tokens:,} completion tokens, {size}, fp32, "
        f"{args.device}"
    )
    if args.invariance:
        invariance(model_dir, pairs, args)
        return 0

    direct = in_process(model_dir, pairs, args.max_batch, args.device)
    print(
        f"in-process ModelSlot.score, length-sorted batches of {args.max_batch}: "
        f"{direct:,.0f} tokens/s (the best case: the whole workload sorted up front)"
    )
    replay = {
        mb: lpx_replay_rate(model_dir, pairs, mb, args.device) for mb in sorted({8, args.max_batch})
    }
    for mb, rate in replay.items():
        print(f"in-process lpx replay loop, fixture order, micro-batch {mb}: {rate:,.0f} tokens/s")
    replay_best = max(replay.values())
    device = ("--device", args.device)
    with server(model_dir, *device, "--max-batch", str(args.max_batch)) as url:
        drive(url, pairs[:64], 8, SEQUENCES_PER_REQUEST)  # warm up
        saturated = drive(url, pairs, 64, SEQUENCES_PER_REQUEST)
        ratio = saturated["tokens_per_s"] / replay_best
        print(
            f"server at saturation (64 clients x {SEQUENCES_PER_REQUEST} sequences/request): "
            f"{saturated['tokens_per_s']:,.0f} tokens/s = {ratio:.2f}x the faster in-process "
            f"lpx replay loop (target >= {TARGET_SATURATION_RATIO}x: ratio "
            f"{ratio / TARGET_SATURATION_RATIO:.2f}); "
            f"{saturated['tokens_per_s'] / direct:.2f}x the length-sorted best case"
        )
        for clients in (1, 8, 64):
            sample = pairs[: max(64, clients * 4)]
            run = drive(url, sample, clients, 1)
            print(
                f"latency, {clients:2d} concurrent clients, 1 sequence/request: p50 {run['p50_ms']:.1f} ms, "
                f"p99 {run['p99_ms']:.1f} ms, {run['tokens_per_s']:,.0f} tokens/s"
            )
        batched = drive(url, pairs[:256], 64, 1)
    with server(model_dir, *device, "--max-batch", "1") as url:
        drive(url, pairs[:16], 8, 1)
        single = drive(url, pairs[:256], 64, 1)
    print(
        f"batching gain, 64 clients x 1 sequence/request: {batched['tokens_per_s']:,.0f} tokens/s "
        f"batched vs {single['tokens_per_s']:,.0f} at batch size 1 = "
        f"{batched['tokens_per_s'] / single['tokens_per_s']:.2f}x"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
