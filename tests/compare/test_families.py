"""The model families × the HF-module engines: HF, FSDP2 and DeepSpeed ZeRO-3 (2 gloo ranks)
replay Qwen3, Qwen2-MoE and Qwen3-MoE built by `lpx make-model`, agree with the HF replay in
fp32, record the same routing, and `lpx localize` finds nothing between them.

(Llama and Qwen2 rows of this matrix: tests/engines/test_engines_distributed.py; vLLM rows:
tests/engines/test_vllm_families.py; Megatron TP=2 and EP=2 rows: tests/engines/test_megatron_families.py.)
FSDP2 and DeepSpeed run the same HF modules (0.0 from HF on Llama,
tests/engines/test_engines_distributed.py); asserted here to a few fp32 ulps, routing identical.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from pipeline.families import families, family_of, routing
from pipeline.fixture.io import read_table
from pipeline.localize.run import localize
from pipeline.localize.verdict import MARGIN
from support.helpers import run_lpx

pytestmark = pytest.mark.distributed

FAMILIES = ["qwen3", "qwen2_moe", "qwen3_moe"]
ENGINES = [("fsdp", []), ("deepspeed", ["--set", "zero_stage=3"])]
FP32_TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def family_runs(family_model, family_rollout):
    """Per family: an fp32 HF rollout (8 x 16 tokens) and its fp32 HF replay."""
    runs = {}
    for arch in FAMILIES:
        model = family_model(arch)
        out = family_rollout(arch)
        done = run_lpx("replay", out / "fixture.parquet", "--out", out / "replay-hf.parquet")
        assert done.exit_code == 0, done.output
        runs[arch] = (model, out)
    return runs


def test_make_model_builds_every_family_the_registry_names(family_model):
    for arch in families():
        config = json.loads((family_model(arch) / "config.json").read_text())
        assert family_of(config).name == arch == config["model_type"]
        spec = routing(config)
        assert (spec is not None) == families()[arch].moe
        if spec:
            assert spec.num_experts == 8 and spec.top_k == 2 and spec.layers == {0, 1}
            assert spec.norm_topk_prob == (arch == "qwen3_moe")
            assert spec.shared_ffn_hidden_size == (128 if arch == "qwen2_moe" else 0)


@pytest.mark.parametrize("engine,extra", ENGINES, ids=[e for e, _ in ENGINES])
@pytest.mark.parametrize("arch", FAMILIES)
def test_fp32_replay_agrees_with_hf_and_routes_the_same(engine, extra, arch, family_runs, tmp_path):
    _, out = family_runs[arch]
    done = run_lpx("replay", out / "fixture.parquet", "--engine", engine, "--nproc", 2, *extra,
                   "--out", tmp_path / "replay.parquet")  # fmt: skip
    assert done.exit_code == 0, done.output
    ours, hf = read_table(tmp_path / "replay.parquet"), read_table(out / "replay-hf.parquet")
    gap = np.abs(ours.channels["replay"].astype(np.float64) - hf.channels["replay"]).max()
    assert gap < FP32_TOLERANCE
    if families()[arch].moe:
        assert np.array_equal(ours.routed_experts, hf.routed_experts)
        assert ours.metadata["routing"]["layers"] == [0, 1]
    else:
        assert ours.routed_experts is None


@pytest.mark.parametrize("spec", ["fsdp:nproc=2", "deepspeed:nproc=2"])
@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_localize_against_hf_is_clean(spec, arch, family_runs, tmp_path):
    model, out = family_runs[arch]
    result = localize(read_table(out / "fixture.parquet"), model, spec, "hf", [0, 3], tmp_path)
    assert result["verdict"] == "clean" and result["first"] is None
    assert max(row["ratio"] for row in result["boundaries"]) < MARGIN
    if arch == "qwen3_moe":  # the routers' boundaries are captured and compared too
        names = {row["boundary"] for row in result["boundaries"]}
        assert {"layers.1.router_logits", "layers.1.experts"} <= names
