"""The device lane on a CPU host: `--device` resolution and its errors, the hardware each
replay records, distributed ranks that fail (their own exception quoted, their logs kept),
`nproc: auto` plans, GPU device requests for containers, and the ground under the stages.

What needs a GPU (CUDA replays of every engine, TF32, out-of-memory, `lpx serve` on CUDA,
the nightly plan) is in tests/gpu and runs on a GPU host.
"""

from __future__ import annotations

import ast
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from pipeline import devices
from pipeline.errors import BadInput
from pipeline.fixture.io import read_table, write_table
from pipeline.fixture.table import table_from_sequences
from support.helpers import run_lpx

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("spec", ["auto", "cpu", "cuda", "cuda:0", "cuda:12", " CUDA:1 "])
def test_device_specs_that_parse(spec):
    assert devices.parse_device(spec) == spec.strip().lower()


@pytest.mark.parametrize("spec", ["gpu", "cuda:", "cuda:-1", "cpu:0", "auto:1", "", "mps"])
def test_device_specs_that_do_not_parse_name_the_choices(spec):
    with pytest.raises(BadInput, match=r"expected auto, cpu, cuda or cuda:N"):
        devices.parse_device(spec)


def test_auto_is_the_cpu_where_no_gpu_is_visible_and_cuda_is_refused():
    assert devices.resolve_device("auto") == "cpu"
    with pytest.raises(BadInput, match=r"no CUDA device is visible here \(torch .* CPU build\)"):
        devices.resolve_device("cuda:0")
    devices.check_ranks(8, "cpu")  # gloo ranks share the CPU: any number


def test_cuda_refused_in_one_line_by_every_command_that_places_a_model(run_dir, tmp_path):
    fixture = run_dir / "fixture.parquet"
    for args in (
        ["replay", fixture, "--device", "cuda", "--out", tmp_path / "r.parquet"],
        ["replay", fixture, "--engine", "fsdp", "--device", "cuda", "--out", tmp_path / "f.parquet"],
        ["inject", fixture, "--kind", "bf16", "--sequence", "all", "--device", "cuda",
         "--out", tmp_path / "i.parquet"],
    ):  # fmt: skip
        result = run_lpx(*args)
        assert result.exit_code == 2, result.output
        assert result.output.count("\n") == 1
        assert "no CUDA device is visible here" in result.output
    result = run_lpx("replay", fixture, "--device", "tpu", "--out", tmp_path / "r.parquet")
    assert result.exit_code == 2 and "--device 'tpu': expected auto, cpu, cuda or cuda:N" in (
        result.output
    )


def test_an_engine_that_places_itself_takes_only_auto(run_dir, tmp_path):
    result = run_lpx(
        "replay", run_dir / "fixture.parquet", "--engine", "logprob-server", "--device", "cpu",
        "--out", tmp_path / "r.parquet",
    )  # fmt: skip
    assert result.exit_code == 2
    assert "engine 'logprob-server' runs where its own build or server runs" in result.output


def test_the_device_comes_from_the_environment_too(run_dir, tmp_path):
    env = {**os.environ, "LPX_REPLAY_DEVICE": "cuda"}
    base = [sys.executable, "-m", "pipeline", "replay", str(run_dir / "fixture.parquet")]
    refused = subprocess.run(
        [*base, "--out", str(tmp_path / "r.parquet")], env=env, capture_output=True, text=True
    )
    assert refused.returncode == 2 and "--device cuda: no CUDA device" in refused.stderr


def test_every_replay_and_rollout_records_where_it_ran(run_dir):
    for name in ("fixture.parquet", "replay-float32.parquet"):
        meta = read_table(run_dir / name).metadata
        assert meta["knobs"]["device"] == "cpu"
        assert meta["knobs"]["allow_tf32"] is False
        assert meta["hardware"]["device"] == "cpu"
        assert meta["hardware"]["name"] and meta["hardware"]["cpu_count"] >= 1
        assert "cuda" not in meta["engine"]["versions"]  # a CPU replay claims no CUDA stack


def test_inject_records_the_device_it_rescored_on(run_dir, tmp_path):
    result = run_lpx(
        "inject", run_dir / "fixture.parquet", "--kind", "bf16", "--sequence", "0-0",
        "--device", "cpu", "--out", tmp_path / "faulted.parquet",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    (fault,) = read_table(tmp_path / "faulted.parquet").metadata["injected_faults"]
    assert fault["device"] == "cpu"


# The CPU's ranks are forked warm (pipeline/engines/warm_ranks.py); a GPU's are torchrun's,
# as the CPU's are with LPX_WARM_START=0: both launchers' failures are named the same way.
LAUNCHERS = {"warm": ("1", "launch.log", "forked warm"), "torchrun": ("0", "torchrun.log", "torch.distributed")}  # fmt: skip


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_a_failing_rank_is_quoted_with_its_own_exception_and_log(
    launcher, tiny_model, tmp_path, monkeypatch
):
    """Token ids past the vocabulary reach the ranks (the fixture records no model to check
    them against): the embedding lookup fails inside a rank, as a device mismatch did."""
    warm, launch_log, says = LAUNCHERS[launcher]
    monkeypatch.setenv("LPX_WARM_START", warm)
    rng = np.random.default_rng(0)
    table = table_from_sequences(
        "fixture", ["a", "b"], [rng.integers(3, 400, 6), rng.integers(3, 400, 6)],
        [np.array([5, 7, 900]), np.array([9, 11, 13])],
        {"rollout": [np.zeros(3, np.float32)] * 2},
    )  # fmt: skip
    write_table(table, tmp_path / "fixture.parquet")
    out = tmp_path / "replay.parquet"
    result = run_lpx(
        "replay", tmp_path / "fixture.parquet", "--model", tiny_model, "--engine", "fsdp",
        "--nproc", 2, "--micro-batch-size", 1, "--out", out,
    )  # fmt: skip
    assert result.exit_code == 2
    line = result.output.strip()
    assert line.count("\n") == 0
    assert "fsdp replay on 2 rank(s) failed: rank 0: IndexError: index out of range" in line
    assert "ChildFailedError" not in line
    log = tmp_path / "replay.logs" / "rank0.log"
    assert f"(log: {log})" in line
    assert "Traceback" in log.read_text() and (tmp_path / "replay.logs/rank1.log").is_file()
    assert says in (tmp_path / "replay.logs" / launch_log).read_text()
    assert not out.exists()


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_a_rank_killed_by_a_signal_is_named(launcher, run_dir, tmp_path):
    """What the kernel's OOM killer does to a rank: SIGKILL, no Python error written."""
    out, logs = tmp_path / "replay.parquet", tmp_path / "ranks"
    process = subprocess.Popen(
        [sys.executable, "-m", "pipeline", "replay", str(run_dir / "fixture.parquet"),
         "--engine", "fsdp", "--nproc", "2", "--micro-batch-size", "1", "--rank-logs",
         str(logs), "--out", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "LPX_WARM_START": LAUNCHERS[launcher][0]},
    )  # fmt: skip
    victim = None
    deadline = time.monotonic() + 120
    while victim is None and time.monotonic() < deadline and process.poll() is None:
        found = _rank_pid(process.pid, 1)
        victim = found if found and (logs / "rank1.log").is_file() else None
        time.sleep(0.05)
    assert victim is not None, "rank 1 never started"
    os.kill(victim, signal.SIGKILL)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 2
    assert "rank 1 was killed by SIGKILL" in stderr, stderr
    assert f"(log: {logs / 'rank1.log'})" in stderr


def _rank_pid(root: int, rank: int) -> int | None:
    """The pid of rank ``rank`` among ``root``'s descendants: a warm fork named lpx-rankN, or
    a torchrun rank with RANK=N."""
    import psutil

    try:
        descendants = psutil.Process(root).children(recursive=True)
    except psutil.NoSuchProcess:
        return None
    for child in descendants:
        try:
            if child.name() == f"lpx-rank{rank}" or (
                "pipeline.engines.distributed" in child.cmdline()
                and _rank_of(str(child.pid)) == str(rank)
            ):
                return child.pid
        except psutil.NoSuchProcess:
            continue
    return None


def _rank_of(pid: str) -> str | None:
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for entry in environ:
        if entry.startswith(b"RANK="):
            return entry[5:].decode()
    return None


def test_rank_logs_are_kept_beside_the_output(run_dir, tmp_path):
    out = tmp_path / "fsdp.parquet"
    result = run_lpx(
        "replay", run_dir / "fixture.parquet", "--engine", "fsdp", "--nproc", 2, "--out", out
    )
    assert result.exit_code == 0, result.output
    logs = tmp_path / "fsdp.logs"
    assert sorted(p.name for p in logs.iterdir()) == ["launch.log", "rank0.log", "rank1.log"]
    meta = read_table(out).metadata
    assert meta["layout"]["device"] == "cpu" and meta["hardware"]["device"] == "cpu"


def test_nproc_auto_is_one_rank_on_the_cpu(run_dir, tmp_path):
    out = tmp_path / "fsdp.parquet"
    result = run_lpx(
        "replay", run_dir / "fixture.parquet", "--engine", "fsdp", "--nproc", "auto", "--out", out
    )
    assert result.exit_code == 0, result.output
    assert read_table(out).metadata["layout"]["world_size"] == 1


def test_plans_take_devices_and_auto_ranks(tmp_path):
    from pipeline.orchestrator.plan import load_plan
    from pipeline.orchestrator.stages import expand

    plan = load_plan(REPO / "examples/nightly-gpu.yaml")
    stages = {stage.name: stage for stage in expand(plan)}
    megatron = stages["replay-megatron-bf16"].argv
    assert megatron[megatron.index("--nproc") + 1] == "auto"
    assert megatron[megatron.index("--rank-logs") + 1] == "logs/replay-megatron-bf16"
    bad = tmp_path / "plan.yaml"
    bad.write_text(
        "version: 1\nname: x\nmodel: tiny\nrollout: {engine: hf}\n"
        "replays: [{name: a, engine: hf, device: gpu0}]\n"
    )
    with pytest.raises(BadInput, match=r"replays\.0\.device"):
        load_plan(bad)
    bad.write_text(
        "version: 1\nname: x\nmodel: tiny\nrollout: {engine: hf, device: cuda:1}\n"
        "replays: [{name: a, engine: fsdp, device: cpu, nproc: auto}]\n"
    )
    stages = {stage.name: stage for stage in expand(load_plan(bad))}
    assert stages["rollout"].argv[-2:] == ["--device", "cuda:1"]
    assert "--device" in stages["replay-a"].argv and "auto" in stages["replay-a"].argv


def test_gpu_stages_get_the_gpus_cuda_visible_devices_names(monkeypatch):
    pytest.importorskip("docker")
    from pipeline.orchestrator.runners import gpu_requests

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1, 3")
    (request,) = gpu_requests()
    assert request["DeviceIDs"] == ["1", "3"] and request["Capabilities"] == [["gpu"]]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    (request,) = gpu_requests()
    assert request["Count"] == -1 and not request.get("DeviceIDs")


def test_stage_containers_get_the_callers_thread_counts(monkeypatch):
    """A container sees every core; a thread count the caller set (the test workers set one
    each) reaches the stage's container as it reaches a local stage, and compose's smoke
    passes the host's on to the runner."""
    import yaml

    from pipeline.orchestrator.runners import _thread_settings

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    assert _thread_settings() == {"OMP_NUM_THREADS": "1"}
    monkeypatch.setenv("OMP_NUM_THREADS", "")
    assert _thread_settings() == {}  # unset or empty: torch's own default in the container
    compose = yaml.safe_load((Path(__file__).parents[2] / "compose.yaml").read_text())
    smoke = compose["services"]["smoke"]["environment"]
    assert "OMP_NUM_THREADS" in smoke and smoke["OMP_NUM_THREADS"] is None  # from the host


def test_the_testbed_reads_the_cuda_build_without_importing_torch():
    from pipeline.testbed import cuda_from_version_file, describe_testbed

    assert cuda_from_version_file("cuda: Optional[str] = '13.0'\nhip = None\n") == "13.0"
    assert cuda_from_version_file("cuda: Optional[str] = None\n") is None
    code = (
        "import sys; from pipeline.testbed import describe_testbed; describe_testbed(); "
        "print('torch' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.stdout.strip() == "False", done.stderr
    assert describe_testbed()["gpu_count"] == 0  # this host: no nvidia-smi, no GPU


def test_no_stage_below_the_engines_imports_them():
    """The fixture schema, compare, history, report and the orchestrator read names and
    devices from the ground (pipeline.names, pipeline.devices), never from pipeline.engines."""
    for package in ("fixture", "compare", "history", "report", "orchestrator"):
        for path in sorted((REPO / "pipeline" / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                names = []
                if isinstance(node, ast.ImportFrom) and node.module:
                    names = [node.module]
                elif isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                bad = [
                    n for n in names if n == "pipeline.engines" or n.startswith("pipeline.engines.")
                ]
                assert not bad, f"{path.relative_to(REPO)} imports {bad}"
    for path in (REPO / "pipeline").rglob("*.py"):
        if path.name != "devices.py":
            text = path.read_text()
            assert "torch.cuda" not in text, f"{path.relative_to(REPO)} names torch.cuda"


def test_torch_threads_holds_where_vllm_made_set_num_threads_a_no_op(monkeypatch):
    """vLLM's CPU worker assigns torch.set_num_threads a function that only logs, in every
    process it ran in (pytest's, lpx localize's): devices.torch_threads still sets the count
    for the block and gives the old one back."""
    import torch

    monkeypatch.setattr(torch, "set_num_threads", lambda count: None)  # as vLLM's worker does
    before = torch.get_num_threads()
    with devices.torch_threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
    if before > 1:  # on one core the no-op is invisible; on CI's two it is what failed
        torch.set_num_threads(1)
        assert torch.get_num_threads() == before
