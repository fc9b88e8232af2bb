"""Logits-processing faults (issue 41): found by re-scoring, at two scales and two lengths.

Each fault is committed by transformers' own `generate` (its repetition penalty, min-p,
sequence bias, temperature, top-k and top-p; vLLM's presence/frequency penalties and a
soft-cap as logits processors in float64), the way an engine that applied it samples and
returns processed logprobs; the fixture records no sampling, as many a dump does. The replay
is HF's, raw, in fp32 and in bf16 (judged against the model's calibrated floor). Each case
goes through `lpx compare --model` (compare, then verify by re-scoring) and the table gives
the verdict, the cause, its status, the parameters found and the seconds verification took.
A clean rollout (no processing) is the control.

    .venv/bin/python bench/processing.py                        # tiny and 16x1024, 96 and 1024
    .venv/bin/python bench/processing.py --scales tiny --tokens 96 --dtypes float32
    .venv/bin/python bench/processing.py --scales qwen3,qwen3_moe --tokens 96   # other families
    .venv/bin/python bench/processing.py --scales 32x512 --tokens 96 --dtypes float32
Rows are cached under ~/.cache/lpx/bench-processing (delete it to re-run); --report prints
the cached ones.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import _bootstrap  # noqa: F401
import models
import numpy as np

from pipeline.calibrate.run import calibrate
from pipeline.compare.run import compare_tables
from pipeline.engines.base import SamplingParams
from pipeline.engines.hf.replay import HFScoringEngine
from pipeline.engines.hf.rollout import HFRolloutEngine
from pipeline.fixture.io import read_table, write_table
from pipeline.verify import verify_report
from support.engine_like import (
    PresenceFrequency,
    SoftCap,
    generated_rollout,
    penalty_counting_the_scored_token,
    rescored,
)

CACHE = Path(os.environ.get("LPX_PROCESSING_CACHE") or Path.home() / ".cache/lpx/bench-processing")
SCALES = {
    "tiny": lambda: models.tiny(),
    "16x1024": lambda: models.random_llama(16, 1024, 0.05),
    # the deeper scale of this CPU (not in the default --scales)
    "32x512": lambda: models.random_llama(32, 512, 0.05),
    # the families users train in 2026, tiny (not in the default --scales)
    "qwen3": lambda: models.family("qwen3"),
    "qwen3_moe": lambda: models.family("qwen3_moe"),
}
SEQUENCES = {96: (8, 2), 1024: (4, 1)}  # tokens: (prompts, samples per prompt)
# 1,024 tokens on the 16-layer model: 2 sequences (each case's generation is one forward a
# token on this CPU, and the calibration's decode variant one a token per precision)
SEQUENCES_AT = {("16x1024", 1024): (1, 2)}


def cases(base) -> dict:
    """The faults, as transformers' generate arguments (the commonest completion tokens of
    the clean rollout get the logit bias)."""
    tokens = base.completion_ids.astype(np.int64)
    common = [int(t) for t in np.argsort(-np.bincount(tokens), kind="stable")[:3]]
    return {
        "clean (control)": {},
        "presence 0.5 + frequency 0.3": {"processors": lambda n: [PresenceFrequency(n, 0.5, 0.3)]},
        "repetition penalty 1.3": {"repetition_penalty": 1.3},
        # issue 61: the penalty's seen set holds the token being scored (an off-by-one
        # processor in the logprob path), transformers' penalty over the fixture's tokens
        "repetition penalty 1.2, scored token counted": {
            "rescore": penalty_counting_the_scored_token(1.2)
        },
        "min-p 0.1": {"min_p": 0.1},
        "soft-cap 2 (extra)": {"processors": lambda n: [SoftCap(2.0)]},
        "logit bias +2 on 3 tokens": {"sequence_bias": {(t,): 2.0 for t in common}},
        "Qwen3 defaults: T 0.6, top-k 20, top-p 0.95": {
            "temperature": 0.6,
            "top_k": 20,
            "top_p": 0.95,
        },  # fmt: skip
        "T 0.7, top-k 20, top-p 0.8": {"temperature": 0.7, "top_k": 20, "top_p": 0.8},
    }


def setup(scale: str, tokens: int, dtypes: list[str]) -> dict:
    folder = CACHE / f"{scale}-{tokens}"
    folder.mkdir(parents=True, exist_ok=True)
    model_dir = SCALES[scale]()
    fixture_path = folder / "fixture.parquet"
    if not fixture_path.exists():
        prompts, samples = SEQUENCES_AT.get((scale, tokens), SEQUENCES[tokens])
        ids = [[1, *range(10 + 7 * i, 26 + 9 * i)] for i in range(prompts)]
        sampling = SamplingParams(
            max_tokens=tokens, seed=0, samples_per_prompt=samples, ignore_eos=True
        )
        write_table(HFRolloutEngine().rollout(model_dir, ids, sampling, {}), fixture_path)
    calibration_path = folder / "calibration.json"
    if not calibration_path.exists():
        # the precisions the replays run in (fp32 always: the reference's own noise)
        precisions = ["float32", *(d for d in dtypes if d != "float32")]
        result = calibrate(read_table(fixture_path), model_dir, precisions, 16)
        calibration_path.write_text(json.dumps(result))
    return {
        "folder": folder,
        "model_dir": model_dir,
        "fixture": read_table(fixture_path),
        "calibration": json.loads(calibration_path.read_text()),
    }


def run_case(state: dict, name: str, generate: dict, dtype: str) -> dict:
    slug = "".join(c if c.isalnum() else "-" for c in name)
    faulted_path = state["folder"] / f"{slug}.parquet"
    if not faulted_path.exists():
        started = time.perf_counter()
        if "rescore" in generate:
            fixture = state["fixture"]
            faulted = rescored(
                state["model_dir"], fixture, range(fixture.num_sequences), generate["rescore"]
            )
            faulted.metadata = {**fixture.metadata, "sampling": {}}  # a dump that records none
        else:
            faulted = generated_rollout(state["model_dir"], state["fixture"], seed=5, **generate)
        write_table(faulted, faulted_path)
        print(f"  generated {name} in {time.perf_counter() - started:.0f} s", flush=True)
    faulted = read_table(faulted_path)
    replay = HFScoringEngine().score(faulted, state["model_dir"], {"dtype": dtype})
    calibration = state["calibration"] if dtype != "float32" else None
    comparison = compare_tables(
        faulted, replay, "f", "r", calibration=calibration, calibration_source="bench"
    )
    report = comparison.report
    started = time.perf_counter()
    verify_report(report, faulted, replay, state["model_dir"], calibration=state["calibration"])
    seconds = time.perf_counter() - started
    faults = [f for f in report.diagnosis if f.is_fault]
    return {
        "case": name,
        "replay": dtype,
        "verdict": report.verdict,
        "findings": [
            {
                "cause": str(f.cause),
                "status": str(f.status),
                "params": {
                    k: v
                    for k, v in ((f.details.get("verified_by") or {}).get("params") or {}).items()
                    if k not in ("searched",)
                },
                "after_floors": (f.residual_after or 0) / max(f.floor or 1e-12, 1e-12),
            }
            for f in faults
        ],
        "seconds": round(seconds, 1),
    }


def _short(params: dict) -> str:
    def fmt(value):
        if isinstance(value, float):
            return f"{value:.4g}"
        if isinstance(value, list):
            return "[" + ", ".join(fmt(v) for v in value) + "]"
        return str(value)

    return ", ".join(f"{k}={fmt(v)}" for k, v in params.items() if k != "what")


def print_table(rows: list[dict]) -> None:
    print("| scale | tokens | replay | fault | verdict | cause | status | parameters found | s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        findings = row["findings"] or [{"cause": "-", "status": "-", "params": {}}]
        for f in findings:
            print(
                f"| {row['scale']} | {row['tokens']} | {row['replay']} | {row['case']} | "
                f"{row['verdict'].upper()} | {f['cause']} | {f['status']} | "
                f"{_short(f['params'])} | {row['seconds']} |"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scales", default="tiny,16x1024")
    parser.add_argument("--tokens", default="96,1024")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--report", action="store_true", help="print the cached rows only")
    parser.add_argument(
        "--cases",
        default="",
        help="run only the faults whose name contains one of these (comma-separated)",
    )
    args = parser.parse_args()
    rows = []
    for scale in args.scales.split(","):
        for tokens in (int(t) for t in args.tokens.split(",")):
            state = None
            for dtype in args.dtypes.split(","):
                cached = CACHE / f"{scale}-{tokens}-{dtype}.json"
                done = json.loads(cached.read_text()) if cached.exists() else {}
                if not args.report:
                    state = state or setup(scale, tokens, args.dtypes.split(","))
                    for name, generate in cases(state["fixture"]).items():
                        wanted = not args.cases or any(c in name for c in args.cases.split(","))
                        if name not in done and wanted:
                            row = run_case(state, name, generate, dtype)
                            done[name] = {**row, "scale": scale, "tokens": tokens}
                            # re-read first: another run (--cases) may have added rows meanwhile
                            on_disk = json.loads(cached.read_text()) if cached.exists() else {}
                            cached.write_text(json.dumps({**on_disk, name: done[name]}, indent=1))
                            print(json.dumps(done[name]), flush=True)
                rows += done.values()
    print_table(rows)


if __name__ == "__main__":
    main()
