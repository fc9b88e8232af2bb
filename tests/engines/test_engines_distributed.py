"""Real FSDP2, DeepSpeed and megatron-core replays on 2 ranks over gloo, launched by lpx.

Measured here (fp32 vs HF fp32, 384 tokens): FSDP2 0.0, DeepSpeed ZeRO-3 0.0, Megatron
~4-6e-6 at TP=1 and TP=2. bf16 runs land at the bf16 floor.
"""

import json

import numpy as np
import pytest

from pipeline.compare.run import compare_files
from pipeline.engines.base import SamplingParams
from pipeline.engines.hf.rollout import HFRolloutEngine
from pipeline.fixture.io import read_table, write_table
from pipeline.tinymodel.build import build_tiny_model
from support.helpers import read_report, run_lpx

pytestmark = pytest.mark.distributed

ENGINES = [
    ("fsdp", []),
    ("deepspeed", ["--set", "zero_stage=3"]),
    ("megatron", ["--set", "tensor_parallel_size=2"]),
]


@pytest.fixture(scope="module")
def qwen_run(tmp_path_factory, prompts):
    """The tiny Qwen2 (GQA + qkv bias) with its own HF rollout and replay."""
    out = tmp_path_factory.mktemp("qwen")
    model = build_tiny_model(out / "tiny-qwen2", "qwen2", 0)
    sampling = SamplingParams(max_tokens=16, seed=2, samples_per_prompt=1)
    fixture = HFRolloutEngine().rollout(model, prompts, sampling, {})
    write_table(fixture, out / "fixture.parquet")
    assert (
        run_lpx(
            "replay", out / "fixture.parquet", "--out", out / "replay-float32.parquet"
        ).exit_code
        == 0
    )
    return out


@pytest.fixture(scope="module")
def llama_fp32(run_dir, tmp_path_factory):
    """Each engine's fp32 replay of the tiny Llama on 2 ranks, launched once for the module
    (the fp32, TP and matrix tests read the same replays)."""
    out = tmp_path_factory.mktemp("llama-fp32")
    return {
        engine: (
            replay(run_dir, engine, extra, out / f"{engine}.parquet"),
            out / f"{engine}.parquet",
        )
        for engine, extra in ENGINES
    }


def replay(run_dir, engine, extra, out, *more):
    result = run_lpx(
        "replay",
        run_dir / "fixture.parquet",
        "--engine",
        engine,
        "--nproc",
        2,
        *extra,
        *more,
        "--out",
        out,
    )
    assert result.exit_code == 0, result.output
    return read_table(out)


def max_gap(a, b) -> float:
    return float(np.max(np.abs(a.channels["replay"].astype(np.float64) - b.channels["replay"])))


@pytest.mark.parametrize("engine,extra", ENGINES, ids=[e for e, _ in ENGINES])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_fp32_two_ranks_agree_with_hf(engine, extra, arch, run_dir, qwen_run, request, tmp_path):
    base = run_dir if arch == "llama" else qwen_run
    if arch == "llama":
        table = request.getfixturevalue("llama_fp32")[engine][0]
    else:
        table = replay(base, engine, extra, tmp_path / "replay.parquet")
    hf = read_table(base / "replay-float32.parquet")
    assert max_gap(table, hf) < 1e-5
    layout = table.metadata["layout"]
    assert layout["world_size"] == 2
    assert layout["tensor_parallel_size"] == (2 if engine == "megatron" else 1)
    weights = table.metadata["weights"]
    assert weights["held_tensor_fingerprint"] == weights["checkpoint_tensor_fingerprint"]
    assert table.metadata["engine"]["versions"]["torch"]


def test_megatron_tp1_and_tp2_agree(run_dir, llama_fp32, tmp_path):
    tp1 = replay(run_dir, "megatron", ["--set", "tensor_parallel_size=1"], tmp_path / "tp1.parquet")
    tp2 = llama_fp32["megatron"][0]
    assert tp1.metadata["layout"]["data_parallel_size"] == 2
    assert max_gap(tp1, tp2) < 1e-5  # measured 4.3e-6
    assert tp2.metadata["layout"]["logprobs"].startswith("vocab-parallel")


@pytest.mark.parametrize("engine,extra", ENGINES, ids=[e for e, _ in ENGINES])
def test_bf16_lands_at_the_floor_and_passes_the_bf16_policy(engine, extra, run_dir, tmp_path):
    replay(run_dir, engine, extra, tmp_path / "replay.parquet", "--dtype", "bf16")
    report = compare_files(run_dir / "fixture.parquet", tmp_path / "replay.parquet").report
    assert report.policy["profile"] == "bfloat16" and report.verdict == "pass"
    assert 1e-3 < report.metrics["mean_abs_diff"] < 0.03  # measured 0.004-0.005


def test_wrong_qkv_conversion_is_caught_as_weights(run_dir, tmp_path):
    out = tmp_path / "bad.parquet"
    replay(
        run_dir,
        "megatron",
        ["--set", "tensor_parallel_size=2", "--set", "conversion=no_qkv_interleave"],
        out,
    )
    result = run_lpx("compare", run_dir / "fixture.parquet", out, "--out", tmp_path / "cmp")
    assert result.exit_code == 1
    report = read_report(tmp_path / "cmp")
    # other weights in memory (the held tensors differ from the checkpoint's), but not stale
    # ones: no update is recorded, so none was missed (issue 53)
    assert [(f["cause"], f["status"]) for f in report["diagnosis"]] == [
        ("stale_weights", "ruled_out"),
        ("weights_differ", "plausible"),
    ]
    assert "differ from the checkpoint" in report["diagnosis"][0]["evidence"]
    assert report["metrics"]["mean_abs_diff"] > 0.1


def test_matrix_report_has_a_row_per_engine(run_dir, llama_fp32, tmp_path):
    paths = [run_dir / "replay-float32.parquet"]
    paths += [llama_fp32[engine][1] for engine, _ in ENGINES]
    result = run_lpx("compare", run_dir / "fixture.parquet", *paths, "--out", tmp_path / "matrix")
    assert result.exit_code == 0, result.output
    matrix = json.loads((tmp_path / "matrix" / "report.json").read_text())
    assert [row["pair"] for row in matrix["pairs"]] == [
        "0-hf-float32",
        "1-fsdp-ws2-float32",
        "2-deepspeed-ws2-float32",
        "3-megatron-tp2-ws2-float32",
    ]
    assert all(row["verdict"] == "pass" and row["max_abs_diff"] < 1e-5 for row in matrix["pairs"])
    assert (
        "| megatron 0.16.1 float32 | TP2 x2 | PASS |"
        in (tmp_path / "matrix" / "summary.md").read_text()
    )


def test_missing_engine_package_is_a_clear_error(run_dir, tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_megatron(name, *args, **kwargs):
        if name.startswith("megatron"):
            raise ImportError("No module named 'megatron'")
        return real_import(name, *args, **kwargs)

    from pipeline.engines.megatron.replay import MegatronSession

    monkeypatch.setattr(builtins, "__import__", no_megatron)
    with pytest.raises(Exception, match=r"pip install -e '\.\[megatron\]'") as error:
        MegatronSession(run_dir, {}, 1)
    assert getattr(error.value, "exit_code", None) == 2


def test_runs_as_ranks_of_an_existing_torchrun_launch(run_dir, tmp_path):
    """Started by the user's own torchrun, `lpx replay` is one rank of that launch."""
    import os
    import subprocess
    import sys

    out = tmp_path / "under-torchrun.parquet"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "pipeline",
        "replay",
        str(run_dir / "fixture.parquet"),
        "--engine",
        "fsdp",
        "--set",
        "packing=true",
        "--out",
        str(out),
    ]
    result = subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    table = read_table(out)
    assert (
        table.metadata["layout"]["world_size"] == 2 and table.metadata["layout"]["packing"] is True
    )
    assert max_gap(table, read_table(run_dir / "replay-float32.parquet")) < 1e-5  # measured 2.9e-6
