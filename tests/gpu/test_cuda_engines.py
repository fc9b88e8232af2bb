"""Every engine on CUDA, for real: HF, FSDP2, DeepSpeed and Megatron-core replays on the GPU
against the CPU fp32 replay of the same tokens, bf16 and TF32 on the GPU judged by their
profiles, `lpx serve` on CUDA against the in-process CUDA replay, a CUDA out-of-memory, and
the GPU nightly plan end to end with the local runner.

Skipped where no CUDA device is visible (CI is CPU-only); run on a GPU host with
`python -m pytest tests/gpu`. Numbers measured on an H100 are in docs/gpu.md.
"""

from __future__ import annotations

import gc
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from pipeline.engines.hf.replay import HFScoringEngine
from pipeline.fixture.io import read_table, write_table
from support.helpers import read_report, run_lpx

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device visible"),
]

REPO = Path(__file__).resolve().parents[2]
# fp32 on the GPU vs fp32 on the CPU, same tokens: 7e-7 mean |d| on the tiny model (H100);
# the fp32 profile's own max limit is 1e-4.
FP32_DEVICE_GAP = 1e-5
ENGINES = {
    "hf": [],
    "fsdp": ["--nproc", "1"],
    "deepspeed": ["--nproc", "1", "--set", "zero_stage=3"],
    "megatron": ["--nproc", "1"],
}
PRECISION_CAUSES = {"dtype"}


def installed(engine: str) -> bool:
    module = {"deepspeed": "deepspeed", "megatron": "megatron.core"}.get(engine)
    return module is None or importlib.util.find_spec(module.split(".")[0]) is not None


def replay(run: Path, engine: str, out: Path, *more) -> dict:
    result = run_lpx(
        "replay", run / "fixture.parquet", "--model", run / "tiny-llama", "--engine", engine,
        *ENGINES[engine], "--device", "cuda", *more, "--out", out,
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    return read_table(out)


def compare(run: Path, replay_path: Path, out: Path) -> tuple[int, dict]:
    result = run_lpx("compare", run / "fixture.parquet", replay_path, "--out", out)
    return result.exit_code, read_report(out)


def gap(a, b) -> float:
    return float(np.max(np.abs(a.channels["replay"].astype(np.float64) - b.channels["replay"])))


@pytest.mark.parametrize("engine", list(ENGINES))
def test_cuda_fp32_equals_the_cpu_fp32_replay(engine, cpu_run, tmp_path):
    if not installed(engine):
        pytest.skip(f"{engine} is not installed here")
    table = replay(cpu_run, engine, tmp_path / "cuda.parquet")
    assert gap(table, read_table(cpu_run / "replay-cpu.parquet")) < FP32_DEVICE_GAP
    code, report = compare(cpu_run, tmp_path / "cuda.parquet", tmp_path / "cmp")
    assert code == 0, report["diagnosis"]
    hardware = table.metadata["hardware"]
    assert hardware["device"].startswith("cuda:")
    major, minor = torch.cuda.get_device_capability(0)
    assert hardware["compute_capability"] == f"{major}.{minor}"
    assert hardware["allow_tf32"] is False and hardware["matmul_precision"] == "highest"
    versions = table.metadata["engine"]["versions"]
    assert versions["cuda"] == torch.version.cuda and versions["driver"]
    assert versions["cudnn"] and versions["nccl"]
    assert table.metadata["layout"]["device"] == "cuda"


@pytest.mark.parametrize("engine", list(ENGINES))
def test_cuda_bf16_passes_the_bf16_profile_with_no_semantic_finding(engine, cpu_run, tmp_path):
    if not installed(engine):
        pytest.skip(f"{engine} is not installed here")
    replay(cpu_run, engine, tmp_path / "bf16.parquet", "--dtype", "bf16")
    code, report = compare(cpu_run, tmp_path / "bf16.parquet", tmp_path / "cmp")
    causes = {finding["cause"] for finding in report["diagnosis"]}
    assert code == 0, report["diagnosis"]
    assert causes <= PRECISION_CAUSES
    assert report["metrics"]["mean_abs_diff"] > 1e-4  # bf16 really ran: not fp32 in disguise


def test_tf32_fails_the_fp32_profile_only_as_precision(cpu_run, tmp_path):
    table = replay(cpu_run, "hf", tmp_path / "tf32.parquet", "--set", "allow_tf32=true")
    assert table.metadata["hardware"]["allow_tf32"] is True
    assert table.metadata["knobs"]["allow_tf32"] is True
    code, report = compare(cpu_run, tmp_path / "tf32.parquet", tmp_path / "cmp")
    assert code == 1
    assert report["metrics"]["mean_abs_diff"] > 1e-5  # TF32 drift is above the fp32 limit
    assert {finding["cause"] for finding in report["diagnosis"]} <= PRECISION_CAUSES


def test_serve_on_cuda_equals_the_in_process_cuda_replay_bit_for_bit(cpu_run, tmp_path):
    """One sequence per batch on both sides: the same shapes, so the same kernels."""
    from pipeline.engines.logprob_server.replay import LogprobServerEngine
    from pipeline.serve.process import serving

    fixture = read_table(cpu_run / "fixture.parquet")
    model = cpu_run / "tiny-llama"
    local = HFScoringEngine().score(fixture, model, {"device": "cuda", "micro_batch_size": 1})
    options = ("--device", "cuda", "--max-batch", "1")
    with serving(model, *options, log_path=tmp_path / "serve.log") as url:
        health = json.loads(__import__("urllib.request").request.urlopen(url + "/health").read())
        served = LogprobServerEngine().score(fixture, model, {"url": url, "batch_size": "1"})
    assert health["device"] == "cuda:0"
    assert float(np.max(np.abs(served.channels["replay"] - local.channels["replay"]))) == 0.0


def test_cuda_out_of_memory_is_exit_2_naming_the_micro_batch(cpu_run, tmp_path):
    """Eager attention over 8 x 2048 tokens needs ~0.5 GB for its scores alone; the process
    may hold 256 MiB, so the first micro-batch cannot fit."""
    from pipeline.fixture.table import table_from_sequences

    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 500, 1024) for _ in range(8)]
    completions = [rng.integers(3, 500, 1024) for _ in range(8)]
    long = table_from_sequences(
        "fixture", [f"long-{i}" for i in range(8)], prompts, completions,
        {"rollout": [np.zeros(1024, np.float32)] * 8},
    )  # fmt: skip
    write_table(long, tmp_path / "long.parquet")
    gc.collect()
    torch.cuda.empty_cache()  # what earlier tests cached would count against the cap
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction((256 << 20) / total, 0)
    try:
        result = run_lpx(
            "replay", tmp_path / "long.parquet", "--model", cpu_run / "tiny-llama",
            "--device", "cuda", "--set", "attn_implementation=eager", "--out",
            tmp_path / "oom.parquet",
        )  # fmt: skip
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, 0)
        torch.cuda.empty_cache()
    assert result.exit_code == 2, result.output
    assert "CUDA out of memory on cuda:0" in result.output
    assert "micro-batch 1 of 1 (sequences 'long-0' to 'long-7', 8 x 2048 tokens" in result.output
    assert "lower --micro-batch-size (now 8)" in result.output
    assert "Traceback" not in result.output
    assert not (tmp_path / "oom.parquet").exists()


def test_more_ranks_than_gpus_is_refused_in_one_line(cpu_run, tmp_path):
    ranks = torch.cuda.device_count() + 1
    result = run_lpx(
        "replay", cpu_run / "fixture.parquet", "--engine", "fsdp", "--nproc", ranks,
        "--device", "cuda", "--out", tmp_path / "x.parquet",
    )  # fmt: skip
    assert result.exit_code == 2
    assert f"--nproc {ranks}: only {ranks - 1} CUDA device(s) are visible" in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_cuda_visible_devices_is_respected(cpu_run, tmp_path):
    """No visible GPU: auto scores on the CPU, and an explicit cuda is refused."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    base = [sys.executable, "-m", "pipeline", "replay", str(cpu_run / "fixture.parquet")]
    auto = subprocess.run(
        [*base, "--out", str(tmp_path / "auto.parquet")], env=env, capture_output=True, text=True
    )
    assert auto.returncode == 0, auto.stderr
    assert read_table(tmp_path / "auto.parquet").metadata["hardware"]["device"] == "cpu"
    forced = subprocess.run(
        [*base, "--device", "cuda", "--out", str(tmp_path / "cuda.parquet")],
        env=env,
        capture_output=True,
        text=True,
    )
    assert forced.returncode == 2
    assert "no CUDA device is visible here (CUDA_VISIBLE_DEVICES is empty)" in forced.stderr


def test_the_gpu_nightly_plan_runs_end_to_end_with_the_local_runner(tmp_path):
    """examples/nightly-gpu.yaml as shipped, on this host without Docker: vLLM's rollout
    where vLLM is installed, else the HF rollout on CUDA; every replay on the GPU."""
    plan = yaml.safe_load((REPO / "examples/nightly-gpu.yaml").read_text())
    if importlib.util.find_spec("vllm") is None:
        plan["rollout"] = {"engine": "hf", "dtype": plan["rollout"]["dtype"]}
    plan["replays"] = [r for r in plan["replays"] if installed(r["engine"])]
    plan["sampling"]["max_tokens"] = 64
    plan["history"] = {"kind": "nightly", "db": str(tmp_path / "lpx.db"), "report": "report"}
    (tmp_path / "plan.yaml").write_text(yaml.safe_dump(plan))
    run_dir = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-m", "pipeline", "run", str(tmp_path / "plan.yaml"), "--runner",
         "local", "--out", str(run_dir)],
        capture_output=True, text=True, cwd=tmp_path,
    )  # fmt: skip
    manifest = json.loads((run_dir / "lpx-run.json").read_text())
    errors = [s for s in manifest["stages"] if s["status"] == "error"]
    assert not errors, errors
    assert done.returncode in (0, 1), done.stdout + done.stderr
    testbed = manifest["testbed"]
    assert testbed["gpu_count"] >= 1 and testbed["compute_capability"] and testbed["cuda"]
    for replay_plan in plan["replays"]:
        table = read_table(run_dir / f"replay-{replay_plan['name']}.parquet")
        assert table.metadata["hardware"]["device"].startswith("cuda")
    assert (tmp_path / "report" / "index.html").is_file()
    history = subprocess.run(
        [sys.executable, "-m", "pipeline", "history", "--db", str(tmp_path / "lpx.db")],
        capture_output=True, text=True,
    )  # fmt: skip
    assert history.returncode == 0, history.stderr
    assert "runs (1)" in history.stdout and "nightly" in history.stdout, history.stdout
