"""Trainer faults smaller than an FP8 rollout's own noise (issue 61), under a declared FP8
rollout (block FP8 weights and activations, an FP8 KV cache): a temperature of 0.97, computed
the way an engine that tempers its logprobs does, and transformers' repetition penalty of 1.1
over the prompt and the output, each in the trainer (support/engine_like.py, not lpx's
emulation). Every magnitude stays inside its calibrated band; the drift's slope on surprisal,
or its gap between tokens seen before and the rest, does not, and verification names each.
The clean bf16 replay of the same rollout passes every test, sign tests included.

The model is a random llama (4 x 256, init std 0.02, tiny's vocabulary): its next-token
distributions are flat like a large model's, where a temperature moves each logprob by
little, not the tiny model's peaked ones, where 0.97 already fattens the tails."""

from __future__ import annotations

import json
import shutil
from importlib import resources

import pytest

from pipeline.calibrate.run import calibrate
from pipeline.compare.run import compare_tables
from pipeline.contracts.calibration import Calibration
from pipeline.engines.base import SamplingParams
from pipeline.engines.hf.replay import HFScoringEngine
from pipeline.engines.hf.rollout import HFRolloutEngine
from pipeline.prompts import tokenize
from pipeline.verify import verify_report
from support.engine_like import (
    repetition_penalty,
    replay_scored_by,
    temperature_after_log_softmax,
)

FP8 = {"quantization": "fp8-block", "kv_cache_dtype": "fp8_e4m3"}
DECLARED = "bfloat16+fp8-block+kv=fp8_e4m3"
MAGNITUDES = ("mean_abs_diff", "tokens_over_q99", "tokens_over_q999", "tokens_over_tau")


@pytest.fixture(scope="module")
def fp8_run(tiny_model, tmp_path_factory) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("fp8-fault")
    model_dir = out / "model"
    vocab = json.loads((tiny_model / "config.json").read_text())["vocab_size"]
    torch.manual_seed(0)
    LlamaForCausalLM(
        LlamaConfig(
            vocab_size=vocab, hidden_size=256, intermediate_size=640, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=1, initializer_range=0.02,
            bos_token_id=1, eos_token_id=2, pad_token_id=0,
        )
    ).save_pretrained(model_dir)  # fmt: skip
    for path in tiny_model.glob("tokenizer*"):
        shutil.copy(path, model_dir / path.name)
    # 32 prompts (the sign tests' clusters), one sample each
    lines = resources.files("pipeline").joinpath("tinymodel/corpus.txt").read_text()
    texts = [line for line in lines.splitlines() if line.strip()][:32]
    prompts = [ids[:24] for ids in tokenize(model_dir, texts)]
    sampling = SamplingParams(max_tokens=64, samples_per_prompt=1, seed=0, ignore_eos=True)
    fixture = HFRolloutEngine().rollout(model_dir, prompts, sampling, {"dtype": "bf16", **FP8})
    clean = HFScoringEngine().score(fixture, model_dir, {"dtype": "bf16"})
    # the trainer at temperature 0.97, in fp32: the replay's values replaced by the engine-like
    # scorer's, its metadata an fp32 replay's
    tempered = HFScoringEngine().score(fixture, model_dir, {"dtype": "fp32"})
    penalised = replay_scored_by(tempered, model_dir, repetition_penalty(1.1))
    tempered = replay_scored_by(tempered, model_dir, temperature_after_log_softmax(0.97))
    calibration = calibrate(fixture, model_dir, ["bfloat16", DECLARED], sequences=32)
    return {
        "model": model_dir,
        "fixture": fixture,
        "clean": clean,
        "tempered": tempered,
        "penalised": penalised,
        "calibration": calibration,
    }


def _tests(report) -> dict:
    return {t["name"]: t for t in report.precision_gate["tests"]}


def test_the_calibration_holds_the_sign_statistics_of_noise_drawn_at_the_rollouts_temperature(
    fp8_run,
):
    calibration = Calibration.model_validate(fp8_run["calibration"])
    pair = next(key for key in calibration.pairs if "fp8" in key and "float32" in key)
    signed = calibration.pairs[pair].signed
    assert signed.temperature == 1.0 and signed.draws == 4
    rollout = next(p for p in signed.by_rollout if p.startswith("bfloat16+fp8"))
    null = signed.by_rollout[rollout]
    # 4 draws a token; the prefills three ways over every token, decoding two ways over the
    # 16 decoded sequences (half of them)
    assert null.tokens == 4 * (3 * calibration.tokens + 2 * calibration.tokens // 2)
    assert null.sequences == 32  # clusters: the 32 prompts
    assert null.seen_gap is not None  # drawn tokens both seen before and not
    # selection: a rollout's noise made its own tokens likelier, so the ratio's mean is ~0
    # while the plain drift of its draws is negative
    assert abs(null.ratio_mean.value) < 4 * null.ratio_mean.se + 1e-3


def test_a_clean_bf16_replay_of_an_fp8_rollout_passes_every_test(fp8_run):
    report = compare_tables(fp8_run["fixture"], fp8_run["clean"], "f", "r",
                            calibration=fp8_run["calibration"]).report  # fmt: skip
    tests = _tests(report)
    assert {"surprisal_slope", "position_slope", "seen_gap", "ratio_mean"} <= set(tests)
    assert report.verdict == "pass" and report.precision_gate["passed"], tests
    assert report.calibration["sign_tests"] == {"used": True, "ratio_mean": True}


def test_a_trainer_temperature_under_fp8_noise_passes_every_magnitude_and_fails_the_slope(
    fp8_run,
):
    """Measured with lpx's own temperature on these tokens: mean |d| z +2.2 against the noise,
    no tail count; the slope -0.031 where noise gives +0.0006 (z -15)."""
    comparison = compare_tables(fp8_run["fixture"], fp8_run["tempered"], "f", "r",
                                calibration=fp8_run["calibration"])  # fmt: skip
    report = comparison.report
    tests = _tests(report)
    assert all(tests[name]["passed"] for name in MAGNITUDES), tests
    slope = tests["surprisal_slope"]
    assert not slope["passed"] and slope["z"] < -8, slope
    assert slope["observed"] - slope["expected"] == pytest.approx(-(1 / 0.97 - 1), abs=0.015)
    assert report.verdict == "fail"
    (finding,) = [f for f in report.diagnosis if f.is_fault]
    assert "leans on the token's surprisal" in finding.evidence
    verify_report(report, fp8_run["fixture"], fp8_run["tempered"], fp8_run["model"],
                  calibration=fp8_run["calibration"])  # fmt: skip
    faults = [f for f in report.diagnosis if f.is_fault]
    named = {str(f.cause): f for f in faults}
    assert "temperature" in named and named["temperature"].verified, [
        (str(f.cause), str(f.status), f.evidence[-200:]) for f in report.diagnosis
    ]
    verified_by = named["temperature"].details["verified_by"]
    assert verified_by["side"] == "replay"
    assert verified_by["params"]["T"] == pytest.approx(0.97, abs=0.01)
    assert "precision" not in named and "dtype" not in named


def test_a_trainer_repetition_penalty_under_fp8_noise_fails_by_the_seen_tokens_gap(fp8_run):
    """Measured: mean |d| z +1.6, no tail count; the gap between tokens seen before and the
    rest -0.027 where noise gives +0.002 (z -10.7); verified as transformers' penalty of 1.1
    over the prompt and the output, on the replay side."""
    comparison = compare_tables(fp8_run["fixture"], fp8_run["penalised"], "f", "r",
                                calibration=fp8_run["calibration"])  # fmt: skip
    report = comparison.report
    tests = _tests(report)
    assert all(tests[name]["passed"] for name in MAGNITUDES), tests
    assert not tests["seen_gap"]["passed"] and tests["seen_gap"]["z"] < -6, tests["seen_gap"]
    (finding,) = [f for f in report.diagnosis if f.is_fault]
    assert "tokens seen earlier in their context" in finding.evidence
    verify_report(report, fp8_run["fixture"], fp8_run["penalised"], fp8_run["model"],
                  calibration=fp8_run["calibration"])  # fmt: skip
    named = {str(f.cause): f for f in report.diagnosis if f.is_fault}
    assert "logits_processing" in named and named["logits_processing"].verified, [
        (str(f.cause), str(f.status), f.evidence[-200:]) for f in report.diagnosis
    ]
    params = named["logits_processing"].details["verified_by"]["params"]
    assert params["repetition_penalty"] == pytest.approx(1.1, abs=0.01)
