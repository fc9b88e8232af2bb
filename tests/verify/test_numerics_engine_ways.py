"""Numerics an engine applies its own way, named by `compare` and verification (issue 61):
each rollout re-scored by support/engine_numerics.py (the format by its definition, not lpx's
emulation), undeclared unless the case says, against a plain bf16 HF replay, judged by a bf16
calibration of other sequences. The same cases at 16 x 1024 and 32 x 512:
bench/numerics_rules.py."""

from __future__ import annotations

import pytest

from pipeline.calibrate.run import calibrate
from pipeline.compare.run import compare_tables
from pipeline.contracts.numerics import parse_numerics
from pipeline.engines.base import SamplingParams
from pipeline.engines.hf.replay import HFScoringEngine
from pipeline.engines.hf.rollout import HFRolloutEngine
from pipeline.fixture.table import select_sequences
from pipeline.verify import verify_report
from support import engine_numerics as engine

CALIBRATION = 12


def _sampled(model_dir, tokens=128):
    """24 sequences of 128 tokens after 24-token prompts of the tiny model's corpus (so that
    every one reaches past position 96), sampled in plain bf16."""
    from importlib import resources

    from pipeline.prompts import tokenize

    lines = resources.files("pipeline").joinpath("tinymodel/corpus.txt").read_text()
    texts = [x for x in lines.splitlines() if x.strip()][:24]
    prompts = [p[:24] for p in tokenize(model_dir, texts)]
    params = SamplingParams(max_tokens=tokens, seed=0, ignore_eos=True)
    return HFRolloutEngine().rollout(model_dir, prompts, params, {"dtype": "bf16"})


@pytest.fixture(scope="module")
def sampled(tiny_model):
    """The tiny model's 24 sampled sequences and their bf16 replay; a plain bf16 calibration
    of the first 12 (the other 12 are judged)."""
    fixture = _sampled(tiny_model)
    replay = HFScoringEngine().score(fixture, tiny_model, {"dtype": "bf16"})
    rows = list(range(CALIBRATION))
    return fixture, replay, calibrate(fixture, tiny_model, ["bfloat16"], rows=rows)


def diagnosed(rollout, replay, calibration, model_dir):
    held = list(range(CALIBRATION, rollout.num_sequences))
    rollout, replay = select_sequences(rollout, held), select_sequences(replay, held)
    report = compare_tables(rollout, replay, "f", "r", calibration=calibration).report
    assert report.verdict == "fail"
    verify_report(report, rollout, replay, model_dir, calibration=calibration)
    faults = [f for f in report.diagnosis if f.is_fault]
    shown = [(str(f.cause), str(f.status), f.evidence[-300:]) for f in faults]
    return faults, shown


def _found(finding) -> str:
    return (finding.details.get("verified_by") or {}).get("params", {}).get("found", "")


@pytest.mark.parametrize(
    "case, cause, found",
    [
        # FP8 KV read by the queries from position 96 on (FA3's and SGLang's FP8 attention
        # paths parted prefill from decode there): named with the onset
        ("kv96", "kv_cache_precision", "kv=fp8_e4m3,from=96"),
        # INT8 W8A8 on operands dequantized into bf16: INT8, by the GEMM variant
        ("int8-deq", "quantization", "int8:w=channel,a=token,gemm=dequantized"),
    ],
)
def test_numerics_applied_the_engines_way_are_named(sampled, tiny_model, case, cause, found):
    fixture, replay, calibration = sampled
    score = {"kv96": lambda: engine.kv_from(96), "int8-deq": engine.int8_dequantized}[case]()
    rollout = engine.engine_scored(tiny_model, fixture, range(fixture.num_sequences), score)
    faults, shown = diagnosed(rollout, replay, calibration, tiny_model)
    assert [str(f.cause) for f in faults] == [cause], shown
    assert faults[0].verified and _found(faults[0]) == found, shown


def test_kv_scales_the_engine_lost_are_named_with_both_values(sampled, tiny_model, tmp_path):
    """Declared calibrated scales, computed with 1.0 (NeMo-RL#3225), on the model rewritten
    to hold keys and values 300x larger (the same function): 1.0 saturates at 448."""
    fixture = sampled[0]
    model_dir, scales = engine.with_large_kv(tiny_model, tmp_path / "large-kv", 300.0)
    assert min(scales) > 0.5  # what a calibration gives these keys and values (5.1, 0.79)
    replay = HFScoringEngine().score(fixture, model_dir, {"dtype": "bf16"})
    rollout = engine.engine_scored(model_dir, fixture, range(fixture.num_sequences),
                                   engine.kv_from(0))  # fmt: skip
    declared = f"kv=fp8_e4m3@{scales[0]:.4g}/{scales[1]:.4g}"
    rollout.metadata = {**rollout.metadata, "numerics": parse_numerics(declared).as_dict(),
                        "model": replay.metadata["model"]}  # fmt: skip
    calibration = calibrate(rollout, model_dir, ["bfloat16", f"bfloat16+{declared}"],
                            rows=list(range(CALIBRATION)))  # fmt: skip
    faults, shown = diagnosed(rollout, replay, calibration, model_dir)
    assert [str(f.cause) for f in faults] == ["kv_cache_precision"], shown
    assert faults[0].verified and _found(faults[0]) == "kv=fp8_e4m3", shown
    assert f"not the calibrated {scales[0]:.4g}/{scales[1]:.4g}" in faults[0].evidence, shown
    assert "K/V scales 1/1" in faults[0].evidence


def test_nvfp4_on_the_routed_experts_of_a_moe_is_named(tmp_path_factory):
    """NVFP4 on a Qwen3-MoE's experts only, their sum in float32 (the engine's way; lpx's
    emulation sums in bf16, and routing amplifies the difference): named FP4, verified or
    plausible with the ranking by family."""
    from pipeline.tinymodel.build import build_tiny_model

    model_dir = build_tiny_model(tmp_path_factory.mktemp("moe"), "qwen3_moe", 0)
    fixture = _sampled(model_dir)
    replay = HFScoringEngine().score(fixture, model_dir, {"dtype": "bf16"})
    calibration = calibrate(fixture, model_dir, ["bfloat16"], rows=list(range(CALIBRATION)))
    rollout = engine.engine_scored(model_dir, fixture, range(fixture.num_sequences),
                                   engine.nvfp4_experts())  # fmt: skip
    faults, shown = diagnosed(rollout, replay, calibration, model_dir)
    named = [f for f in faults if str(f.cause) == "quantization"]
    assert named, shown
    for finding in named:
        found = _found(finding) or finding.details.get("found", "")
        assert found.startswith("fp4_e2m1:w=nv16,a=nv16,") and "only=" in found, shown
    assert not [f for f in faults if str(f.cause) in ("unexplained", "weights_differ")], shown
