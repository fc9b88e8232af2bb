"""The sign tests' error rates (issue 61): false alarms on clean runs, and a trainer temperature
that the magnitudes alone pass, at three scales, in bf16 and under a declared FP8 rollout.

For each scale (the tiny model; random llamas 16 x 1024 and 32 x 512, init std 0.02, whose
flat distributions are a large model's, not the tiny one's peaked ones) and each rollout
precision (bf16; bf16 with block FP8 weights and activations and an FP8 KV cache, declared)
the HF engine rolls out a pool of 128 sequences x 64 tokens at temperature 1, and scores it:

- clean: an HF bf16 replay;
- faults, each the trainer in fp32 computing its logprobs an engine's own way
  (support/engine_like.py, not lpx's emulation): at temperature 0.97 (tempering its
  logprobs), and with transformers' repetition penalty of 1.1 over the prompt and the output.

The model is calibrated (`lpx calibrate`'s function) on the pool's first 32 sequences; then
random batches of 16 and 32 held-out sequences (of the other 96) are judged by the precision
gate as `lpx compare` judges them (`calibrated_judging`), and the table gives, per pair and
batch size, how often the gate fails with the magnitude tests alone and with the sign tests
too. A clean pair should fail at most at the gate's rate (1e-3; the sign tests share it);
trials of one size overlap (a finite pool), so the rates are estimates.

    .venv/bin/python bench/signed.py --scales tiny          # ~2 minutes on 2 cores
    .venv/bin/python bench/signed.py                        # three scales, ~20 minutes
Pools and calibrations are cached under ~/.cache/lpx/bench-signed (delete it to rebuild).
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

from pipeline.calibrate.run import calibrate
from pipeline.compare.calibrated import (
    SignedSides,
    calibrated_judging,
    pair_key,
    side_precision,
    surprisal_side,
)
from pipeline.compare.signed import STATISTICS, prompt_clusters, seen_before
from pipeline.engines.base import SamplingParams
from pipeline.engines.hf.replay import HFScoringEngine
from pipeline.engines.hf.rollout import HFRolloutEngine
from pipeline.fixture.io import read_table, write_table
from pipeline.fixture.table import REPLAY_CHANNEL
from pipeline.prompts import tokenize
from support.engine_like import (
    repetition_penalty,
    replay_scored_by,
    temperature_after_log_softmax,
)

CACHE = Path.home() / ".cache" / "lpx" / "bench-signed"
SCALES = {
    "tiny": models.tiny,
    "16x1024": lambda: models.random_llama(16, 1024, 0.02),
    "32x512": lambda: models.random_llama(32, 512, 0.02),
}
MODES = {
    "bf16": {"dtype": "bf16"},
    "fp8": {"dtype": "bf16", "quantization": "fp8-block", "kv_cache_dtype": "fp8_e4m3"},
}
DECLARED = {"bf16": ["bfloat16"], "fp8": ["bfloat16", "bfloat16+fp8-block+kv=fp8_e4m3"]}
SEQUENCES, TOKENS, PROMPT_TOKENS = 128, 64, 24
CALIBRATION_SEQUENCES = 32
BATCH_SEQUENCES = (16, 32)
FAULT_T = 0.97
PENALTY = 1.1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scales", default=",".join(SCALES))
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--trials", type=int, default=200, help="batches per pair and size")
    parser.add_argument("--work", type=Path, default=CACHE)
    args = parser.parse_args()
    rows = []
    for scale in args.scales.split(","):
        for mode in args.modes.split(","):
            started = time.perf_counter()
            pool = build_pool(scale, mode, args.work / f"{scale}-{mode}")
            print(f"== {scale} {mode}: pool ready in {time.perf_counter() - started:.0f} s",
                  flush=True)  # fmt: skip
            rows += rates(scale, mode, pool, args.trials)
    print_table(rows)


def build_pool(scale: str, mode: str, work: Path) -> dict:
    work.mkdir(parents=True, exist_ok=True)
    model_dir = SCALES[scale]()
    lines = resources.files("pipeline").joinpath("tinymodel/corpus.txt").read_text()
    texts = [x for x in lines.splitlines() if x.strip()]
    prompts = [p[:PROMPT_TOKENS] for p in tokenize(model_dir, texts)][: SEQUENCES // 2]
    params = SamplingParams(max_tokens=TOKENS, samples_per_prompt=2, seed=0, ignore_eos=True)

    def cached(name: str, make):
        path = work / f"{name}.parquet"
        if not path.is_file():
            began = time.perf_counter()
            write_table(make(), path)
            print(f"  {scale} {mode}: {name} in {time.perf_counter() - began:.0f} s", flush=True)
        return read_table(path)

    fixture = cached(
        "fixture",
        lambda: HFRolloutEngine().rollout(
            model_dir, prompts, params, {**MODES[mode], "device": "cpu"}
        ),
    )
    clean = cached("clean", lambda: HFScoringEngine().score(fixture, model_dir, {"dtype": "bf16"}))
    fault = cached(
        "fault", lambda: _scored(fixture, model_dir, temperature_after_log_softmax(FAULT_T))
    )
    penalty = cached("penalty", lambda: _scored(fixture, model_dir, repetition_penalty(PENALTY)))
    path = work / "calibration.json"
    if not path.is_file():
        began = time.perf_counter()
        result = calibrate(fixture, model_dir, DECLARED[mode], device="cpu",
                           rows=list(range(CALIBRATION_SEQUENCES)))  # fmt: skip
        path.write_text(json.dumps(result))
        print(f"  {scale} {mode}: calibration in {time.perf_counter() - began:.0f} s", flush=True)
    return {
        "fixture": fixture,
        "replays": {
            "clean bf16": clean,
            f"trainer T {FAULT_T}": fault,
            f"trainer penalty {PENALTY}": penalty,
        },
        "calibration": json.loads(path.read_text()),
    }


def _scored(fixture, model_dir, score):
    """The trainer in fp32, its logprobs ``score``'s (an engine's own arithmetic)."""
    replay = HFScoringEngine().score(fixture, model_dir, {"dtype": "fp32"})
    return replay_scored_by(replay, model_dir, score)


def rates(scale: str, mode: str, pool: dict, trials: int) -> list[dict]:
    fixture, calibration = pool["fixture"], pool["calibration"]
    held_out = np.arange(CALIBRATION_SEQUENCES, fixture.num_sequences)
    rng = np.random.default_rng(0)
    rows = []
    for name, replay in pool["replays"].items():
        rollout_precision = side_precision(fixture.metadata)
        replay_precision = side_precision(replay.metadata)
        pair = pair_key(rollout_precision, replay_precision)
        nearer = surprisal_side(rollout_precision, replay_precision)
        per_row = [_row(fixture, replay, r) for r in range(fixture.num_sequences)]
        for size in BATCH_SEQUENCES:
            magnitude_fails = sign_fails = 0
            z_of = {"surprisal_slope": [], "seen_gap": []}
            for _ in range(trials):
                chosen = rng.choice(held_out, size, replace=False)
                rollout, train, positions = (np.concatenate([per_row[r][k] for r in chosen])
                                             for k in range(3))  # fmt: skip
                offsets = np.concatenate([[0], np.cumsum([len(per_row[r][0]) for r in chosen])])
                judged = calibrated_judging(
                    calibration, pair, train, positions, offsets, "bench",
                    np.abs(train - rollout),
                    gate_logprob=rollout if nearer == "rollout" else None,
                    sides=SignedSides(rollout, train, rollout_precision,
                                      fixture.metadata.get("sampling"),
                                      prompt_clusters([fixture.prompt_of(r) for r in chosen],
                                                      [len(per_row[r][0]) for r in chosen]),
                                      np.concatenate([per_row[r][3] for r in chosen])),
                )  # fmt: skip
                tests = judged.gate["tests"]
                magnitude_fails += not all(
                    t["passed"] for t in tests if t["name"] not in STATISTICS
                )
                sign_fails += not judged.gate["passed"]
                for t in tests:
                    if t["name"] in z_of:
                        z_of[t["name"]].append(t["z"])
            rows.append({
                "scale": scale, "mode": mode, "pair": name, "sequences": int(size),
                "tokens": int(size * TOKENS), "trials": trials,
                "magnitude_only": magnitude_fails / trials, "with_sign": sign_fails / trials,
                **{f"z {name}": float(np.median(z)) if z else float("nan")
                   for name, z in z_of.items()},
            })  # fmt: skip
            print(_line(rows[-1]), flush=True)
    return rows


def _row(fixture, replay, row: int):
    span = fixture.completion_slice(row)
    rollout = fixture.channels["rollout"][span].astype(np.float64)
    train = replay.channels[REPLAY_CHANNEL][span].astype(np.float64)
    seen = seen_before(fixture.prompt_of(row), fixture.completion_of(row))
    return rollout, train, np.arange(len(rollout), dtype=np.float64), seen


def _line(row: dict) -> str:
    return (
        f"  {row['scale']:8s} {row['mode']:5s} {row['pair']:18s} {row['sequences']:3d} seq "
        f"{row['tokens']:5d} tok  fails: magnitudes {row['magnitude_only']:6.1%}  "
        f"with sign tests {row['with_sign']:6.1%}  (median z: slope "
        f"{row['z surprisal_slope']:+.1f}, seen gap {row['z seen_gap']:+.1f}; "
        f"{row['trials']} batches)"
    )


def print_table(rows: list[dict]) -> None:
    print("\n| scale | rollout | replay | sequences x tokens | fails: magnitudes alone | "
          "with the sign tests | median z: surprisal slope, seen gap |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['scale']} | {r['mode']} | {r['pair']} | {r['sequences']} x {TOKENS} | "
              f"{r['magnitude_only']:.1%} | {r['with_sign']:.1%} | "
              f"{r['z surprisal_slope']:+.1f}, {r['z seen_gap']:+.1f} |")  # fmt: skip


if __name__ == "__main__":
    main()
