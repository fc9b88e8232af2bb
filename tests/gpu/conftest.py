"""What the GPU tests share: the tiny model and its fp32 HF rollout and replay on the CPU."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.engines.base import SamplingParams
from pipeline.engines.hf.replay import HFScoringEngine
from pipeline.engines.hf.rollout import HFRolloutEngine
from pipeline.fixture.io import write_table
from pipeline.prompts import smoke_prompt_texts, tokenize
from pipeline.tinymodel.build import build_tiny_model


@pytest.fixture(scope="session")
def cpu_run(tmp_path_factory) -> Path:
    """The tiny model, an fp32 HF rollout on the CPU, and the fp32 CPU replay of it."""
    out = tmp_path_factory.mktemp("gpu-run")
    model = build_tiny_model(out / "tiny-llama", "llama", 0)
    prompts = tokenize(model, smoke_prompt_texts())
    sampling = SamplingParams(max_tokens=48, seed=0, samples_per_prompt=2)
    fixture = HFRolloutEngine().rollout(model, prompts, sampling, {"device": "cpu"})
    write_table(fixture, out / "fixture.parquet")
    replay = HFScoringEngine().score(fixture, model, {"device": "cpu"})
    write_table(replay, out / "replay-cpu.parquet")
    return out
