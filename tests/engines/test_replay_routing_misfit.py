"""`lpx replay` of a fixture whose MoE routing the model cannot have made (a dense model, or
a MoE model with other layers or top-k): exit 2 in one line naming the fixture, the model
and what to pass, before any engine loads; it was exit 0 with the routing dropped unsaid."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from pipeline.engines.base import SamplingParams
from pipeline.engines.hf.rollout import HFRolloutEngine
from pipeline.fixture.io import read_table, write_table
from pipeline.routing import routing_misfit
from support.helpers import run_lpx

QWEN3_MOE = {"model_type": "qwen3_moe", "num_hidden_layers": 4, "num_experts": 8,
             "num_experts_per_tok": 2, "moe_intermediate_size": 16, "intermediate_size": 64}  # fmt: skip


def _table(layers: int, k: int):
    return SimpleNamespace(routed_experts=np.zeros((5, layers, k), np.int16))


def test_routing_fits_only_a_model_that_routes_the_same_layers_and_top_k():
    assert routing_misfit(_table(4, 2), QWEN3_MOE) is None
    assert routing_misfit(SimpleNamespace(routed_experts=None), {"model_type": "llama"}) is None
    assert routing_misfit(_table(4, 2), {"model_type": "llama"}, "models/dense") == (
        "carries MoE routing for 4 layers (top-2), but models/dense has no experts "
        "(config.json: model_type 'llama', no expert count)"
    )
    assert routing_misfit(_table(2, 2), QWEN3_MOE, "m") == (
        "carries MoE routing for 2 layers (top-2), but m routes 4 MoE layers (top-2)"
    )
    assert routing_misfit(_table(4, 4), {**QWEN3_MOE, "decoder_sparse_step": 2}, "m") == (
        "carries MoE routing for 4 layers (top-4), but m routes 2 MoE layers (top-2)"
    )


@pytest.fixture(scope="module")
def moe_fixture(family_model, tmp_path_factory):
    model = family_model("qwen3_moe")
    path = tmp_path_factory.mktemp("misfit") / "fixture.parquet"
    sampling = SamplingParams(max_tokens=4, seed=0, ignore_eos=True)
    write_table(HFRolloutEngine().rollout(model, [[1, 5, 9]], sampling, {}), path)
    return model, path


def _error_line(result) -> str:
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in result.output, result.output
    return lines[0]


@pytest.mark.parametrize("engine", ["hf", "vllm", "sglang", "fsdp", "deepspeed", "megatron"])
def test_a_moe_fixture_against_a_dense_model_is_refused_for_every_engine(
    engine, moe_fixture, tiny_model, tmp_path
):
    model, fixture = moe_fixture
    layers = read_table(fixture).routed_experts.shape[1]
    result = run_lpx("replay", fixture, "--engine", engine, "--model", tiny_model,
                     "--out", tmp_path / "r.parquet")  # fmt: skip
    assert _error_line(result) == (
        f"Error: {fixture} carries MoE routing for {layers} layers (top-2), but {tiny_model} "
        "has no experts (config.json: model_type 'llama', no expert count): it is not the model "
        f"that rolled this fixture out; replay it against the MoE model it came from (--model "
        f"{model})."
    )
    assert not (tmp_path / "r.parquet").exists()


def test_routing_of_other_moe_layers_is_refused(moe_fixture, tmp_path):
    model, fixture = moe_fixture
    table = read_table(fixture)
    table.routed_experts = table.routed_experts[:, :1]
    table.metadata["routing"]["layers"] = table.metadata["routing"]["layers"][:1]
    write_table(table, tmp_path / "one-layer.parquet")
    line = _error_line(run_lpx("replay", tmp_path / "one-layer.parquet", "--model", model,
                               "--out", tmp_path / "r.parquet"))  # fmt: skip
    layers = read_table(fixture).routed_experts.shape[1]
    assert f"carries MoE routing for 1 layer (top-2), but {model} routes {layers} MoE" in line


def test_the_moe_fixture_replays_on_its_own_model_with_its_routing(moe_fixture, tmp_path):
    model, fixture = moe_fixture
    result = run_lpx("replay", fixture, "--model", model, "--out", tmp_path / "r.parquet")
    assert result.exit_code == 0, result.output
    replay = read_table(tmp_path / "r.parquet")
    assert replay.routed_experts.shape == read_table(fixture).routed_experts.shape
