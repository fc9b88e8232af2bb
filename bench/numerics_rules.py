"""Numerics an engine applies to part of the model, or from a position on, or with its own
arithmetic (issue 61, items 2-5): named at three scales, from rollouts computed by
support/engine_numerics.py (each format written by its definition, not lpx's emulation).

For each scale, 24 sequences x 128 tokens (24-token prompts) are sampled in plain bf16 by
the HF engine; each case re-scores the same tokens the engine's way and leaves its numerics
out of the metadata (undeclared) except where it says; the bf16 HF replay is the other
side; a plain bf16 calibration of the first 12 sequences judges the other 12, compared and
verified as `lpx compare --verify` does. Cases:

- ``fp8-kept``: FP8 blocks (verl's recipe) on every decoder layer but the first and last;
- ``kv96``: an E4M3 KV cache read by the queries from position 96 on;
- ``int8-deq``: INT8 W8A8 whose operands are dequantized into bf16 and multiplied there;
- ``kv-lost``: an E4M3 KV cache declared with its calibrated scales (amax / 448), computed
  with 1.0, on the model rewritten to hold keys and values 300x larger (q and o scaled to
  match: the same function), as models whose FP8 cache needs scales do;
- ``nvfp4-experts`` (MoE scales): NVFP4 on the routed experts only.

Prints, per case: the verdict, each fault's cause, status and the numerics found, and the
seconds verification took, as replays of the judged sequences.

    .venv/bin/python bench/numerics_rules.py --scales tiny
    .venv/bin/python bench/numerics_rules.py            # every scale, ~1 h on 2 cores
Fixtures are cached under ~/.cache/lpx/bench-numerics-rules.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import _bootstrap  # noqa: F401
import models

from pipeline.calibrate.run import calibrate
from pipeline.compare.run import compare_tables
from pipeline.contracts.numerics import parse_numerics
from pipeline.engines.base import SamplingParams
from pipeline.engines.hf.replay import HFScoringEngine
from pipeline.engines.hf.rollout import HFRolloutEngine
from pipeline.fixture.io import read_table, write_table
from pipeline.fixture.table import select_sequences
from pipeline.verify import verify_report
from support import engine_numerics as engine

CACHE = Path.home() / ".cache" / "lpx" / "bench-numerics-rules"
SCALES = {
    "tiny": models.tiny,
    "16x1024": lambda: models.random_llama(16, 1024),
    "32x512": lambda: models.random_llama(32, 512),
    "moe-tiny": lambda: models.family("qwen3_moe"),
    "moe-8x512": lambda: models.random_moe(8, 512, arch="qwen3_moe"),
    "moe-16x1024": lambda: models.random_moe(16, 1024, arch="qwen3_moe"),
}
DENSE_CASES = ("fp8-kept", "kv96", "int8-deq", "kv-lost")
MOE_CASES = ("nvfp4-experts",)
SEQUENCES, TOKENS, PROMPT_TOKENS, CALIBRATION = 24, 128, 24, 12
LARGE_KV = 300.0  # keys and values scaled so that a KV scale of 1.0 saturates at 448


def case_score(case: str):
    return {
        "fp8-kept": lambda: engine.fp8_blocks_keeping(1, 1),
        "kv96": lambda: engine.kv_from(96),
        "int8-deq": engine.int8_dequantized,
        "kv-lost": lambda: engine.kv_from(0),
        "nvfp4-experts": engine.nvfp4_experts,
    }[case]()


def sampled(model_dir: Path, work: Path):
    path = work / "sampled.parquet"
    if not path.is_file():
        prompts = models.corpus_prompts(model_dir, SEQUENCES, PROMPT_TOKENS)
        params = SamplingParams(max_tokens=TOKENS, seed=0, ignore_eos=True)
        table = HFRolloutEngine().rollout(model_dir, prompts, params, {"dtype": "bf16"})
        write_table(table, path)
    return read_table(path)


def declared_as(table, text: str):
    """The table's metadata declaring the numerics ``text`` (the KV scales it was told)."""
    numerics = parse_numerics(text)
    table.metadata = {**table.metadata, "numerics": numerics.as_dict()}
    return table


def run_case(scale: str, case: str, model_dir: Path, work: Path, fixture, replay) -> str:
    scales = None
    if case == "kv-lost":  # keys and values LARGE_KV times larger, the same function
        model_dir, scales = engine.with_large_kv(model_dir, work / "large-kv", LARGE_KV)
        replay = HFScoringEngine().score(fixture, model_dir, {"dtype": "bf16"})
    path = work / f"{case}.parquet"
    if not path.is_file():
        rows = range(fixture.num_sequences)
        write_table(engine.engine_scored(model_dir, fixture, rows, case_score(case)), path)
    rollout = read_table(path)
    precisions = ["bfloat16"]
    if case == "kv-lost":
        text = f"kv=fp8_e4m3@{scales[0]:.4g}/{scales[1]:.4g}"
        rollout = declared_as(rollout, text)
        rollout.metadata["model"] = replay.metadata["model"]  # the rewritten model ran it
        precisions.append(f"bfloat16+{text}")
    cached = (
        work / f"calibration-{case if scales else ''}{'-'.join(precisions).replace('/', '_')}.json"
    )
    if not cached.is_file():
        rows = list(range(CALIBRATION))
        cached.write_text(json.dumps(calibrate(rollout, model_dir, precisions, rows=rows)))
    calibration = json.loads(cached.read_text())
    held = list(range(CALIBRATION, rollout.num_sequences))
    rollout, judged_replay = select_sequences(rollout, held), select_sequences(replay, held)
    began = time.perf_counter()
    report = compare_tables(rollout, judged_replay, "f", "r", calibration=calibration).report
    gate = report.precision_gate or {}
    failed = [t["name"] for t in gate.get("tests", []) if not t["passed"]]
    verify_report(report, rollout, judged_replay, model_dir, calibration=calibration)
    seconds = time.perf_counter() - began
    faults = [
        f"{f.cause} {f.status} "
        f"{(f.details.get('verified_by') or {}).get('params', {}).get('found') or f.details.get('found', '')}"
        for f in report.diagnosis
        if f.is_fault
    ]
    return (f"  {case:14s} {report.verdict:5s} {seconds:6.1f} s  gate failed {failed or '-'}; "
            f"{'; '.join(faults) or 'no fault'}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scales", default=",".join(SCALES))
    parser.add_argument("--cases", default=",".join(DENSE_CASES + MOE_CASES))
    args = parser.parse_args()
    for scale in args.scales.split(","):
        model_dir = SCALES[scale]()
        work = CACHE / scale
        work.mkdir(parents=True, exist_ok=True)
        fixture = sampled(model_dir, work)
        began = time.perf_counter()
        replay = HFScoringEngine().score(fixture, model_dir, {"dtype": "bf16"})
        replay_s = time.perf_counter() - began
        write_table(replay, work / "replay.parquet")
        print(f"\n== {scale}: {fixture.num_sequences} x {TOKENS} tokens, one bf16 replay "
              f"{replay_s:.1f} s", flush=True)  # fmt: skip
        cases = MOE_CASES if scale.startswith("moe") else DENSE_CASES
        for case in (c for c in args.cases.split(",") if c in cases):
            print(run_case(scale, case, model_dir, work, fixture, replay), flush=True)


if __name__ == "__main__":
    main()
