"""Write run directories shaped exactly like lpx's own outputs (report.json per compare
directory, lpx-run.json, optionally tokens.parquet), with chosen metric values and engine
versions: seeded histories for the history tests, the browser tests and the benchmark.

Real reports come from real engines elsewhere in the suite (tests/history/test_history_e2e.py);
these let a test say "a step at night 30 when vLLM went 0.31 -> 0.32" in one line.
"""

from __future__ import annotations

import json
from datetime import datetime, timedelta
from pathlib import Path

import numpy as np

from pipeline.compare.drift_map import drift_map

BASE_METRICS = {
    "max_abs_diff": 0.08,
    "mean_abs_diff": 0.004,
    "rms_diff": 0.006,
    "p50_abs_diff": 0.002,
    "p99_abs_diff": 0.03,
    "p999_abs_diff": 0.06,
    "mean_diff": 0.0002,
    "frac_over_tau": 0.0,
    "max_prob_diff": 0.02,
    "mean_prob_diff": 0.001,
    "k1": -0.0002,
    "k2": 2e-5,
    "k3": 4.9e-5,
    "is_ratio_mean": 1.0002,
    "chi2_token": 1e-4,
    "ess": 0.9999,
    "clip_frac": 0.0,
    "token_mult_prob_error": 1.004,
    "max_seq_mean_abs_diff": 0.006,
    "top1_flip_rate": 0.002,
}
WEIGHTS = "sha256:" + "ab" * 32
TOKENIZER = "sha256:" + "cd" * 32
PROMPTS = "sha256:" + "ef" * 32
TESTBED = {
    "name": None,
    "host": "runner-1",
    "cpu_model": "Synthetic CPU",
    "cpu_count": 2,
    "gpu_model": "H100",
    "gpu_count": 8,
    "driver": "570.1",
}


def pair_report(
    *,
    rollout: str = "vllm",
    replay: str = "hf",
    rollout_version: str = "0.32.0",
    replay_version: str = "5.19.0",
    rollout_dtype: str = "bfloat16",
    replay_dtype: str = "bfloat16",
    metrics: dict | None = None,
    verdict: str = "pass",
    sequence_ids: list[str] | None = None,
    tp: int = 1,
    model_path: str = "/models/tiny",
    findings: list[dict] | None = None,
    violations: list[dict] | None = None,
) -> dict:
    metrics = {**BASE_METRICS, **(metrics or {})}
    sequence_ids = sequence_ids or ["0-0", "0-1"]
    positions = 32
    rng = np.random.default_rng(len(sequence_ids))
    drift = np.abs(rng.normal(0, metrics["mean_abs_diff"], len(sequence_ids) * positions))
    profile = "bfloat16" if "bfloat16" in (rollout_dtype, replay_dtype) else "float32"
    tau = 0.1 if profile == "bfloat16" else 1e-4

    def side(name, version, dtype, role):
        package = {"hf": "transformers", "fsdp": "torch"}.get(name, name)
        return {
            "path": f"/runs/x/{role}-{name}.parquet",
            "channel": "rollout" if role == "rollout" else "replay",
            "engine": {
                "name": name,
                "role": role,
                "versions": {"lpx": "0.1.0", "torch": "2.13.0+cpu", package: version},
            },
            "dtype": dtype,
            "knobs": {"dtype": dtype, "tensor_parallel_size": tp},
            "model": {
                "path": model_path,
                "weights_fingerprint": WEIGHTS,
                "tokenizer_fingerprint": TOKENIZER,
                "vocab_size": 512,
            },
            "prompt_set_fingerprint": PROMPTS,
            "sampling": {"temperature": 1.0, "seed": 0, "max_tokens": 32}
            if role == "rollout"
            else None,
            "layout": {"world_size": tp, "tensor_parallel_size": tp} if role == "replay" else None,
        }

    return {
        "verdict": verdict,
        "sign_convention": "d = logp_train - logp_rollout",
        "metrics": {"tokens": 64 * len(sequence_ids), "tau": tau, **metrics},
        "sequences": [
            {
                "sequence_id": s,
                "tokens": 64,
                "max_abs_diff": metrics["max_abs_diff"] / (i + 1),
                "mean_abs_diff": metrics["mean_abs_diff"],
                "over_tau": False,
            }
            for i, s in enumerate(sequence_ids)
        ],
        "worst": [
            {
                "sequence_id": s,
                "position": 3 + i,
                "token_id": 17 + i,
                "region": "completion",
                "logprob_rollout": -1.0,
                "logprob_train": -1.0 - metrics["max_abs_diff"] / (i + 1),
                "abs_diff": metrics["max_abs_diff"] / (i + 1),
                "context_ids": [5, 6, 7],
            }
            for i, s in enumerate(sequence_ids)
        ],
        "drift_map": drift_map(
            sequence_ids,
            np.repeat(np.arange(len(sequence_ids)), positions),
            np.tile(np.arange(positions), len(sequence_ids)),
            drift,
            tau,
        ),
        "diagnosis": findings or [],
        "policy": {
            "verdict": verdict,
            "profile": profile,
            "tau": tau,
            "limits": {},
            "violations": violations or [],
            "failing_findings": [f["cause"] for f in findings or []],
            "source": "default policy",
        },
        "metadata": {
            "fixture": side(rollout, rollout_version, rollout_dtype, "rollout"),
            "replay": side(replay, replay_version, replay_dtype, "replay"),
            "command_line": "lpx compare fixture.parquet replay.parquet --out compare",
            "testbed": dict(TESTBED),
        },
    }


def write_run(
    run_dir: Path,
    pairs: dict[str, dict],
    *,
    started_at: datetime,
    kind: str = "nightly",
    run_id: str | None = None,
    stage_errors: list[str] | None = None,
    tokens: bool = False,
    cases: dict[str, str] | None = None,
) -> Path:
    """A run directory: one compare directory per pair (name -> report) and lpx-run.json."""
    run_dir = Path(run_dir)
    for name, report in pairs.items():
        out = run_dir / name
        out.mkdir(parents=True, exist_ok=True)
        (out / "report.json").write_text(json.dumps(report))
        if tokens:
            write_tokens(out / "tokens.parquet", report)
    stages = [
        {"name": name, "status": "ok" if r["verdict"] == "pass" else "fail", "message": ""}
        for name, r in pairs.items()
    ]
    stages += [
        {"name": f"replay-{i}", "status": "error", "message": message}
        for i, message in enumerate(stage_errors or [])
    ]
    status = (
        "error"
        if stage_errors
        else "fail"
        if any(r["verdict"] != "pass" for r in pairs.values())
        else "pass"
    )
    manifest = {
        "lpx_run": 1,
        "run_id": run_id or f"{run_dir.name}-{started_at.isoformat()}",
        "kind": kind,
        "trigger": "schedule",
        "started_at": started_at.isoformat(),
        "ended_at": (started_at + timedelta(minutes=20)).isoformat(),
        "command_line": "lpx run nightly.yaml",
        "lpx_version": "0.1.0",
        "lpx_revision": "abc123",
        "testbed": dict(TESTBED),
        "stages": stages,
        "status": status,
        **({"cases": cases} if cases else {}),
    }
    (run_dir / "lpx-run.json").write_text(json.dumps(manifest))
    return run_dir


def write_tokens(path: Path, report: dict, positions: int = 32) -> None:
    """A tokens.parquet matching the report's sequences (for heatmaps and decoding)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    ids = [row["sequence_id"] for row in report["sequences"]]
    rng = np.random.default_rng(0)
    n = len(ids) * positions
    diff = rng.normal(0, report["metrics"]["mean_abs_diff"], n)
    table = pa.table(
        {
            "sequence_id": pa.DictionaryArray.from_arrays(
                np.repeat(np.arange(len(ids), dtype=np.int32), positions), pa.array(ids)
            ),
            "position": np.tile(np.arange(positions, dtype=np.int32), len(ids)),
            "region": pa.array(["completion"] * n).dictionary_encode(),
            "token_id": rng.integers(0, 512, n).astype(np.int32),
            "logprob_rollout": np.full(n, -1.0, dtype=np.float32),
            "logprob_train": (-1.0 + diff).astype(np.float32),
            "diff": diff,
            "over_tau": np.abs(diff) > report["policy"]["tau"],
        }
    )
    pq.write_table(table, path)


def nightly_history(
    root: Path,
    nights: int,
    *,
    start: datetime = datetime(2026, 1, 1, 3, 0),
    step_at: int | None = None,
    step_factor: float = 3.0,
    upgrade_at: int | None = None,
    noise: float = 0.03,
    seed: int = 0,
    pairs: tuple[str, ...] = ("vllm-hf-bf16",),
) -> list[Path]:
    """``nights`` nightly runs: max/mean |d| with multiplicative noise, vLLM 0.31.0 -> 0.32.0
    at ``upgrade_at`` and the drift metrics times ``step_factor`` from ``step_at`` on."""
    rng = np.random.default_rng(seed)
    dirs = []
    for night in range(nights):
        version = "0.32.0" if upgrade_at is not None and night >= upgrade_at else "0.31.0"
        scale = step_factor if step_at is not None and night >= step_at else 1.0
        reports = {}
        moved = ("max_abs_diff", "mean_abs_diff", "k3", "p99_abs_diff")
        for name in pairs:
            noisy = np.exp(rng.normal(0, noise, len(moved)))
            reports[name] = pair_report(
                rollout_version=version,
                metrics={
                    m: BASE_METRICS[m] * scale * float(f) for m, f in zip(moved, noisy, strict=True)
                },
            )
        dirs.append(
            write_run(
                root / f"night-{night:03d}", reports, started_at=start + timedelta(days=night)
            )
        )
    return dirs


# One finding of each status, as lpx compare writes them after verification (and the older
# stale_weights one without a status, as reports written before statuses had them).
UNEXPLAINED_SEQUENCES = [f"{i}-0" for i in range(40)]
CLAIMED_FINDINGS = [
    {
        "cause": "temperature",
        "severity": "fault",
        "status": "verified",
        "sequences": ["0-0"],
        "first_position": {"sequence_id": "0-0", "position": 3},
        "evidence": "re-scored with temperature (T=0.7), the rollout side matches to mean |d| "
        "0.002 (floor 0.003; the drift was 0.21): the bug is on the rollout side",
        "confidence": 0.9,
        "runner_up": None,
        "residual_before": 0.21,
        "residual_after": 0.002,
        "floor": 0.003,
        "details": {"temperature": 0.7},
    },
    {
        "cause": "top_k",
        "severity": "fault",
        "status": "plausible",
        "sequences": ["0-0", "7-1"],
        "first_position": {"sequence_id": "0-0", "position": 5},
        "evidence": "tokens outside the top 20 carry rollout logprob -inf",
        "confidence": 0.6,
        "runner_up": None,
        "residual_before": None,
        "residual_after": None,
        "floor": None,
        "details": {},
    },
    {
        "cause": "token_shift",
        "severity": "info",
        "status": "ruled_out",
        "sequences": ["0-0"],
        "first_position": {"sequence_id": "0-0", "position": 3},
        "evidence": "drift starts at one position; ruled out by re-scoring: token_shift "
        "(offset=1): mean |d| 0.21 -> 0.19 (floor 0.003)",
        "confidence": 0.4,
        "runner_up": None,
        "residual_before": 0.21,
        "residual_after": 0.19,
        "floor": 0.003,
        "details": {"ruled_out": [{"kind": "token_shift", "params": {"offset": 1}}]},
    },
    {
        "cause": "unexplained",
        "severity": "fault",
        "status": "plausible",
        "sequences": UNEXPLAINED_SEQUENCES,
        "first_position": {},
        "evidence": "drift in 40 sequences that no re-scored hypothesis reproduces; ruled out: "
        "token_shift/token_shift; inspect the worst tokens",
        "confidence": 0.0,
        "runner_up": None,
        "residual_before": 0.05,
        "residual_after": 0.05,
        "floor": 0.003,
        "details": {"ruled_out": [{"kind": "token_shift", "params": {"offset": 1}}]},
    },
]
STALE_WEIGHTS_GUESS = {  # no status, no verification: an older report, or --no-verify
    "cause": "stale_weights",
    "severity": "fault",
    "sequences": ["7-1"],
    "first_position": {"sequence_id": "7-1", "position": 0},
    "evidence": "every token moves a little, as other weights give: engines likely hold "
    "different weights",
    "confidence": 0.7,
    "runner_up": None,
    "details": {},
}


def claimed_history(root: Path, start: datetime = datetime(2026, 4, 1, 3, 0)) -> list[Path]:
    """Three nights of vllm-hf and vllm-fsdp; both fail at the third. vllm-hf was verified
    (CLAIMED_FINDINGS: verified, plausible, ruled out, unexplained); vllm-fsdp holds one
    stale_weights finding with no status and no verification note (read as plausible)."""
    dirs = []
    for night in range(3):
        failing = night == 2
        metrics = {"max_abs_diff": 0.5} if failing else None
        violations = [{"metric": "max_abs_diff", "value": 0.5, "limit": 0.1}] if failing else None
        verified = pair_report(
            metrics=metrics,
            verdict="fail" if failing else "pass",
            sequence_ids=["0-0", "7-1"],
            findings=CLAIMED_FINDINGS if failing else None,
            violations=violations,
        )
        guessed = pair_report(
            replay="fsdp",
            replay_version="2.13.0",
            metrics=metrics,
            verdict="fail" if failing else "pass",
            sequence_ids=["0-0", "7-1"],
            findings=[STALE_WEIGHTS_GUESS] if failing else None,
            violations=violations,
        )
        if failing:
            # the policy fails on faults only (pipeline/compare/policy.py)
            verified["policy"]["failing_findings"] = ["temperature", "top_k", "unexplained"]
            verified["verification"] = {"ran": True, "model": "/models/tiny", "source": "--model"}
        dirs.append(
            write_run(
                root / f"claims-{night}",
                {"vllm-hf": verified, "vllm-fsdp": guessed},
                started_at=start + timedelta(days=night),
            )
        )
    return dirs


def drifting_pair(sequences: int, seed: int = 0, drifting: float = 0.1):
    """A fixture and its replay of ``sequences`` short sequences (prompts of 2-5 tokens,
    completions of 2-7): bf16-like noise on every token and a 0.5 shift on a ``drifting``
    share of the sequences, so compare finds one cause naming thousands of them. For the
    report's size at scale (tests/compare/test_sequence_table.py, bench/report_size.py)."""
    from pipeline.fixture.table import TokenTable, offsets_from_lengths

    rng = np.random.default_rng(seed)
    prompt_lengths = rng.integers(2, 6, sequences)
    completion_lengths = rng.integers(2, 8, sequences)
    prompts, completions = (
        offsets_from_lengths(prompt_lengths),
        offsets_from_lengths(completion_lengths),
    )
    tokens = int(completions[-1])
    rollout = -rng.exponential(1.0, tokens).astype(np.float32)
    replay = np.minimum(rollout + rng.normal(0, 0.01, tokens).astype(np.float32), 0)
    replay[np.repeat(rng.random(sequences) < drifting, completion_lengths)] -= 0.5
    model = {"vocab_size": 1000, "weights_fingerprint": WEIGHTS}
    common = dict(
        sequence_ids=[f"seq-{i:06d}" for i in range(sequences)],
        prompt_offsets=prompts,
        prompt_ids=rng.integers(0, 1000, int(prompts[-1])).astype(np.int32),
        completion_offsets=completions,
        completion_ids=rng.integers(0, 1000, tokens).astype(np.int32),
        completion_mask=np.ones(tokens, dtype=np.bool_),
    )
    fixture = TokenTable(
        kind="fixture",
        channels={"rollout": rollout},
        metadata={"dtype": "bfloat16", "model": model},
        **common,
    )
    scored = TokenTable(
        kind="replay",
        channels={"replay": replay},
        metadata={"dtype": "float32", "model": model},
        **common,
    )
    return fixture, scored
