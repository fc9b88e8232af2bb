"""Each engine records the model config it computed with, and a config changed through the
engine's own way of changing it is named from that evidence at compare, then verified by
re-scoring: vLLM's `hf_overrides` and SGLang's `--json-model-override-args` (each resolved by
the engine, read back), and another config.json for FSDP2, DeepSpeed and Megatron-core
(launched on 2 ranks). The HF engines: tests/compare/test_model_config.py.

Measured here (tiny Qwen3 / Llama, RoPE theta 10,000 read as 20,000): the engines' drift
0.04-0.09 mean |d| against the HF replay of the checkpoint as it is, reproduced by lpx's
re-score of the recorded reading to 2e-7-3e-7. A top-level `rope_theta` override leaves
vLLM 0.32 and SGLang 0.5.23 computing (and recording) the checkpoint's theta: their
configs keep RoPE's parameters in `rope_parameters`."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from pipeline.compare.run import compare_files
from pipeline.engines.base import SamplingParams
from pipeline.fixture.io import write_table
from support.helpers import run_lpx

SAMPLING = SamplingParams(max_tokens=24, temperature=1.0, seed=0, samples_per_prompt=1)
THETA = {"rope_parameters": {"rope_theta": 20000.0, "rope_type": "default"}}


def _named(fixture, replay, model):
    """The comparison's model_config finding, verified by re-scoring with ``model``."""
    out = fixture.parent / "cmp"
    result = run_lpx("compare", fixture, replay, "--model", model, "--out", out)
    assert result.exit_code == 1, result.output
    report = json.loads((out / "report.json").read_text())
    (named,) = [f for f in report["diagnosis"] if f["cause"] == "model_config"]
    return named


def _engine_or_skip(module: str):
    if os.environ.get("CI", "").lower() == "true":
        __import__(module)  # CI must have it
    else:
        pytest.importorskip(module)


@pytest.mark.vllm
def test_vllm_hf_overrides_are_read_back_and_named(tiny_model, prompts, tmp_path):
    _engine_or_skip("vllm")
    from pipeline.engines.vllm.engine import VLLMRolloutEngine

    fixture = VLLMRolloutEngine().rollout(
        tiny_model, prompts, SAMPLING, {"dtype": "fp32", "hf_overrides": json.dumps(THETA)}
    )
    model = fixture.metadata["model"]
    assert model["config_read_from"] == "engine"
    assert model["config"]["rope"]["rope_theta"] == 20000.0
    assert fixture.metadata["knobs"]["hf_overrides"] == THETA
    path = write_table(fixture, tmp_path / "fixture.parquet")
    replay = tmp_path / "replay.parquet"
    result = run_lpx("replay", path, "--model", tiny_model, "--out", replay)
    assert "rope.rope_theta 20000 (rollout) against 10000 (replay)" in result.output
    named = _named(path, replay, tiny_model)
    assert named["status"] == "verified" and named["severity"] == "fault"
    assert "rope.rope_theta=20000" in named["evidence"]
    assert named["residual_after"] < 1e-5  # measured 3e-7, against a drift of 0.09


@pytest.mark.sglang
def test_sglang_model_override_args_are_read_back_and_named(
    sglang_python, tiny_model, prompts, tmp_path
):
    from pipeline.engines.sglang.engine import SGLangRolloutEngine

    engine = SGLangRolloutEngine()
    engine.log_dir = tmp_path
    fixture = engine.rollout(tiny_model, prompts, SAMPLING, {
        "python": str(sglang_python), "dtype": "fp32",
        "json_model_override_args": json.dumps(THETA)})  # fmt: skip
    assert fixture.metadata["model"]["config"]["rope"]["rope_theta"] == 20000.0
    assert json.loads(fixture.metadata["knobs"]["json_model_override_args"]) == THETA
    path = write_table(fixture, tmp_path / "fixture.parquet")
    replay = tmp_path / "replay.parquet"
    assert run_lpx("replay", path, "--model", tiny_model, "--out", replay).exit_code == 0
    named = _named(path, replay, tiny_model)
    assert named["status"] == "verified"
    assert "rope.rope_theta=20000" in named["evidence"]
    assert named["residual_after"] < 1e-5  # measured 1.6e-7, against a drift of 0.044


@pytest.mark.distributed
@pytest.mark.parametrize(
    "engine,extra",
    [("fsdp", []), ("deepspeed", ["--set", "zero_stage=3"]),
     ("megatron", ["--set", "tensor_parallel_size=2"])],
)  # fmt: skip
def test_a_training_engine_on_another_config_json_records_it_and_it_is_named(
    engine, extra, run_dir, tiny_model, tmp_path
):
    other = tmp_path / "model"
    shutil.copytree(tiny_model, other)
    config = json.loads((other / "config.json").read_text())
    config["rope_parameters"] = {**config["rope_parameters"], "rope_theta": 20000.0}
    (other / "config.json").write_text(json.dumps(config))
    replay = tmp_path / "replay.parquet"
    result = run_lpx("replay", run_dir / "fixture.parquet", "--engine", engine, "--nproc", 2,
                     *extra, "--model", other, "--out", replay)  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "rope.rope_theta 10000 (rollout) against 20000 (replay)" in result.output
    report = compare_files(run_dir / "fixture.parquet", replay).report
    (named,) = [f for f in report.diagnosis if f.cause == "model_config"]
    assert named.is_fault and named.details["differences"] == [
        {"key": "rope.rope_theta", "rollout": 10000.0, "replay": 20000.0}
    ]
    assert named.details["read_from"] == {"rollout": "engine", "replay": "engine"}
