"""The precision gate and precision verified by re-scoring, on real models and real faults:
the documented flow (`lpx calibrate`, then `lpx compare`, verification by default) on a clean
bf16 replay, on stale weights hot-loaded into the replay engine (its files on record the
fixture's) on a Llama and a Qwen3, and on a Qwen2-MoE whose replay side routes one layer
with another router. Each fault is about 2-4x the clean drift: under the old fixed multiples
they passed, or failed with `dtype` verified."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from pipeline.engines.base import SamplingParams
from pipeline.engines.hf.replay import HFScoringEngine
from pipeline.engines.hf.rollout import HFRolloutEngine
from pipeline.fixture.io import read_table, write_table
from pipeline.fixture.table import REPLAY_CHANNEL
from pipeline.prompts import smoke_prompt_texts, tokenize
from support.helpers import read_report, run_lpx

pytestmark = pytest.mark.engine


def build(kind: str, tiny_model: Path, out: Path) -> Path:
    """A small random model of another family, with the tiny model's tokenizer."""
    import torch
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM, Qwen3Config, Qwen3ForCausalLM

    vocab = json.loads((tiny_model / "config.json").read_text())["vocab_size"]
    common = dict(vocab_size=vocab, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, initializer_range=0.05, bos_token_id=1, eos_token_id=2,
                  pad_token_id=0, tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(0)
    if kind == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(intermediate_size=256, head_dim=32, **common))
    else:
        model = Qwen2MoeForCausalLM(
            Qwen2MoeConfig(intermediate_size=256, moe_intermediate_size=128, num_experts=4,
                           num_experts_per_tok=2, shared_expert_intermediate_size=128, **common)
        )  # fmt: skip
    model.save_pretrained(out)
    for path in tiny_model.glob("tokenizer*"):
        shutil.copy(path, out / path.name)
    return out


def run(model_dir: Path, out: Path) -> Path:
    """An fp32 rollout (32 sequences x 48 tokens), its clean bf16 replay, the calibration."""
    prompts = tokenize(model_dir, smoke_prompt_texts())
    sampling = SamplingParams(max_tokens=48, samples_per_prompt=4, seed=0, ignore_eos=True)
    fixture = HFRolloutEngine().rollout(model_dir, prompts, sampling, {"device": "cpu"})
    write_table(fixture, out / "fixture.parquet")
    replay = HFScoringEngine().score(fixture, model_dir, {"dtype": "bfloat16", "device": "cpu"})
    write_table(replay, out / "replay-clean.parquet")
    done = run_lpx("calibrate", out / "fixture.parquet", "--out", out / "calibration.json")
    assert done.exit_code == 0, done.output
    return out


def hot_loaded(out: Path, model_dir: Path, change, name: str, size: float) -> Path:
    """A bf16 replay by weights ``change`` made from the fixture's, scaled so the drift is
    about ``size`` times the clean replay's; the engine's files on record are the fixture's
    (weights hot-loaded in memory), so only the logprobs can tell."""
    from pipeline.engines.hf.model import load_model

    fixture = read_table(out / "fixture.parquet")
    clean = _mean_drift(fixture, read_table(out / "replay-clean.parquet"))
    scale, ratio = 1.0, 0.0
    for _ in range(4):  # the drift grows about linearly with the change's size
        model = load_model(model_dir, "float32")
        change(model, scale)
        folder = out / f"{name}-weights"
        shutil.rmtree(folder, ignore_errors=True)
        model.save_pretrained(folder)
        for path in model_dir.glob("tokenizer*"):
            shutil.copy(path, folder / path.name)
        replay = HFScoringEngine().score(fixture, folder, {"dtype": "bfloat16", "device": "cpu"})
        ratio = _mean_drift(fixture, replay) / clean
        if abs(ratio - size) < 0.35 * size:
            break
        # noise and fault add about in quadrature
        scale *= np.sqrt(max(size**2 - 1, 0.1)) / np.sqrt(max(ratio**2 - 1, 0.01))
    assert abs(ratio - size) < 0.35 * size, ratio
    replay.metadata["model"] = dict(fixture.metadata["model"])
    write_table(replay, out / f"replay-{name}.parquet")
    return out / f"replay-{name}.parquet"


def optimiser_step(fixture_path: Path):
    """Stale weights: one AdamW step of the size asked on the fixture's first sequences."""
    from pipeline.faults import optimiser_step as step

    fixture = read_table(fixture_path)
    pairs = [(fixture.prompt_of(r), fixture.completion_of(r)) for r in range(4)]

    def change(model, scale):
        stepped = step(model, pairs, 3e-4 * scale)
        model.load_state_dict(stepped.state_dict())

    return change


def another_router(layer: int):
    """One MoE layer's router weights moved by a random matrix of the size asked."""
    import torch

    def change(model, scale):
        gate = model.model.layers[layer].mlp.gate.weight
        generator = torch.Generator().manual_seed(1)
        with torch.no_grad():
            gate += 0.3 * scale * gate.std() * torch.randn(gate.shape, generator=generator)

    return change


def _mean_drift(fixture, replay) -> float:
    rollout = np.asarray(fixture.channels["rollout"], dtype=np.float64)
    return float(np.mean(np.abs(np.asarray(replay.channels[REPLAY_CHANNEL]) - rollout)))


def compare(out: Path, replay: Path, target: Path):
    result = run_lpx("compare", out / "fixture.parquet", replay, "--out", target)
    return result, read_report(target)


@pytest.fixture(scope="module")
def llama(tiny_model, tmp_path_factory) -> Path:
    return run(tiny_model, tmp_path_factory.mktemp("gate-llama"))


def test_a_clean_bf16_replay_passes_the_gate(llama, tmp_path):
    result, report = compare(llama, llama / "replay-clean.parquet", tmp_path / "cmp")
    assert result.exit_code == 0, report["policy"]["violations"]
    gate = report["precision_gate"]
    assert gate["passed"] and gate["tokens"] == 32 * 48 and gate["alpha"] == 1e-3
    names = [t["name"] for t in gate["tests"]]
    assert names == ["mean_abs_diff", "tokens_over_q99", "tokens_over_q999", "tokens_over_tau",
                     "surprisal_slope", "position_slope", "seen_gap", "ratio_mean"]  # fmt: skip
    level = gate["tests"][0]
    assert level["observed"] < level["critical"] < 2 * level["expected"]
    assert report["policy"]["gate"] == {"passed": True, "alpha": 1e-3}


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_stale_weights_at_twice_the_noise_fail_and_are_never_precision(
    family, llama, tiny_model, tmp_path_factory, tmp_path
):
    if family == "llama":
        out = llama
    else:
        folder = tmp_path_factory.mktemp(f"gate-{family}")
        out = run(build(family, tiny_model, folder / "model"), folder)
    model_dir = Path(read_table(out / "fixture.parquet").metadata["model"]["path"])
    replay = hot_loaded(out, model_dir, optimiser_step(out / "fixture.parquet"), "stale", 2.0)
    result, report = compare(out, replay, tmp_path / "cmp")
    assert result.exit_code == 1
    level = report["precision_gate"]["tests"][0]
    assert not level["passed"] and level["z"] > 3
    assert report["verification"]["ran"]
    assert not [
        f for f in report["diagnosis"] if f["cause"] == "dtype" and f["status"] == "verified"
    ]
    assert any(f["severity"] == "fault" for f in report["diagnosis"])


def test_another_router_in_one_moe_layer_fails_and_is_never_precision(
    tiny_model, tmp_path_factory, tmp_path
):
    folder = tmp_path_factory.mktemp("gate-moe")
    model_dir = build("qwen2_moe", tiny_model, folder / "model")
    out = run(model_dir, folder)
    replay = hot_loaded(out, model_dir, another_router(1), "router", 3.0)
    result, report = compare(out, replay, tmp_path / "cmp")
    assert result.exit_code == 1
    assert not report["precision_gate"]["passed"]
    assert not [
        f for f in report["diagnosis"] if f["cause"] == "dtype" and f["status"] == "verified"
    ]
    assert any(f["severity"] == "fault" for f in report["diagnosis"])


def test_precision_over_a_user_limit_is_verified_by_re_scoring(llama, tmp_path):
    policy = tmp_path / "policy.yaml"
    policy.write_text(
        "version: 1\nprofiles:\n  bfloat16:\n    tau: 0.1\n    limits: {mean_abs_diff: 0.001}\n"
        "fail_on_findings: [unexplained]\n"
    )
    result = run_lpx("compare", llama / "fixture.parquet", llama / "replay-clean.parquet",
                     "--policy", policy, "--out", tmp_path / "cmp")  # fmt: skip
    report = read_report(tmp_path / "cmp")
    assert result.exit_code == 1  # the user's limit stands
    assert report["precision_gate"]["passed"]
    (finding,) = [f for f in report["diagnosis"] if f["cause"] == "dtype"]
    assert finding["status"] == "verified" and finding["severity"] == "info"
    check = finding["details"]["verified_by"]
    assert check["kind"] == "precision" and check["params"]["tokens"] == 16 * 48
    assert "the drift is precision" in finding["evidence"]
    # no-verify leaves the claim plausible, worded as one
    result = run_lpx("compare", llama / "fixture.parquet", llama / "replay-clean.parquet",
                     "--policy", policy, "--no-verify", "--out", tmp_path / "plain")  # fmt: skip
    plain = read_report(tmp_path / "plain")
    (finding,) = [f for f in plain["diagnosis"] if f["cause"] == "dtype"]
    assert finding["status"] == "plausible"
    assert plain["verification"] == {"ran": False, "reason": "--no-verify"}
