"""Time RL-Kernel's compare_logprobs (commit 71f0e7c2) on the workload in an .npz file.

Run in its own process by bench/rlkernel.py:  python rlkernel_worker.py RLK_SRC DATA.npz REPEATS
Prints one JSON line with the timings and the metrics RL-Kernel computed.

Each repeat times, separately:
  convert: numpy arrays -> LogprobBenchmarkFixture (LogprobSequence objects holding
           Python lists) + training_scores {channel: {sequence_id: list[float]}},
           which is the input form compare_logprobs' API takes;
  call:    compare_logprobs(...) itself (one call over all 20,000 sequences, the way
           run_cross_engine_benchmark calls it).
"""

from __future__ import annotations

import gc
import json
import sys
import time

import _bootstrap
import numpy as np

_bootstrap.put_first(sys.argv[1])  # an RL-Kernel checkout at commit 71f0e7c2
_IMPORT_T0 = time.perf_counter()

from rl_engine.benchmarks.logprob_cross_engine import (  # noqa: E402
    DEFAULT_POLICY_CHANNEL,
    SCHEMA_VERSION,
    LogprobBenchmarkFixture,
    LogprobCrossBenchmarkConfig,
    LogprobSequence,
    compare_logprobs,
)

IMPORT_S = time.perf_counter() - _IMPORT_T0  # mostly torch; not counted in the timings


def convert(data) -> tuple[LogprobBenchmarkFixture, dict]:
    ids = data["ids"].tolist()
    prompts = data["prompts"].tolist()
    completions = data["completions"].tolist()
    rollout = data["rollout"].tolist()  # float32 -> exact Python floats
    train = data["train"].tolist()
    sequences = [
        LogprobSequence(
            sequence_id=sid,
            prompt_token_ids=p,
            completion_token_ids=c,
            rollout_logprobs={DEFAULT_POLICY_CHANNEL: r},
            completion_mask=[True] * len(c),
        )
        for sid, p, c, r in zip(ids, prompts, completions, rollout, strict=True)
    ]
    fixture = LogprobBenchmarkFixture(
        schema_version=SCHEMA_VERSION,
        created_at="2026-01-01T00:00:00+00:00",
        rollout_engine="fixture",
        model="fixture",
        tokenizer=None,
        dtype="float32",
        sequences=sequences,
    )
    training_scores = {DEFAULT_POLICY_CHANNEL: dict(zip(ids, train, strict=True))}
    return fixture, training_scores


def main() -> None:
    path, repeats = sys.argv[2], int(sys.argv[3])
    npz = np.load(path)
    data = {k: npz[k] for k in npz.files}
    config = LogprobCrossBenchmarkConfig(
        rollout_engine="fixture", training_engine="torch", device="cpu", dtype="float32"
    )
    runs = []
    summary = None
    for _ in range(repeats):
        gc.collect()
        t0 = time.perf_counter()
        fixture, training_scores = convert(data)
        t1 = time.perf_counter()
        report, token_drifts = compare_logprobs(
            fixture=fixture,
            training_scores=training_scores,
            config=config,
            duration_seconds=0.0,
        )
        t2 = time.perf_counter()
        runs.append({"convert_s": t1 - t0, "call_s": t2 - t1, "total_s": t2 - t0})
        summary = {
            k: report["summary"][k]
            for k in (
                "sequence_count",
                "active_tokens",
                "max_abs_error",
                "mean_abs_error",
                "max_relative_error",
            )
        }
        summary["status"] = report["status"]
        del fixture, training_scores, report, token_drifts
    print(json.dumps({"runs": runs, "summary": summary, "import_s": IMPORT_S}))


if __name__ == "__main__":
    main()
