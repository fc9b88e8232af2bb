"""`lpx calibrate` and calibrated comparisons, on real HF scorings: the floor's numbers, a
clean bf16 replay of a noisy model (uncalibrated it fails the constants and is named
precision; calibrated it passes with nothing to explain), a user's limit exceeded by noise
named precision, and calibrations kept in and reused from the history."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pipeline.engines.base import SamplingParams
from pipeline.engines.hf.replay import HFScoringEngine
from pipeline.engines.hf.rollout import HFRolloutEngine
from pipeline.fixture.io import write_table
from pipeline.prompts import smoke_prompt_texts, tokenize
from support.helpers import read_report, run_lpx


@pytest.fixture(scope="module")
def calibrated_run(run_dir, tmp_path_factory) -> Path:
    """The shared tiny-model run, copied, with calibration.json beside its replays."""
    out = tmp_path_factory.mktemp("calibrated")
    for name in ("fixture.parquet", "replay-float32.parquet", "replay-bfloat16.parquet"):
        shutil.copy(run_dir / name, out / name)
    result = run_lpx("calibrate", out / "fixture.parquet", "--sequences", 8)
    assert result.exit_code == 0, result.output
    return out


@pytest.fixture(scope="module")
def noisy_run(tiny_model, tmp_path_factory) -> Path:
    """A random llama (4 x 256, init std 0.1) whose bf16 noise exceeds the bf16 constants:
    an fp32 rollout and its bf16 replay, nothing else wrong."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("noisy")
    model_dir = out / "model"
    config = json.loads((tiny_model / "config.json").read_text())
    torch.manual_seed(0)
    LlamaForCausalLM(
        LlamaConfig(
            vocab_size=config["vocab_size"], hidden_size=256, intermediate_size=640,
            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=1,
            initializer_range=0.1, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        )
    ).save_pretrained(model_dir)  # fmt: skip
    for path in tiny_model.glob("tokenizer*"):
        shutil.copy(path, model_dir / path.name)
    prompts = tokenize(model_dir, smoke_prompt_texts())
    sampling = SamplingParams(max_tokens=32, samples_per_prompt=2, seed=0)
    fixture = HFRolloutEngine().rollout(model_dir, prompts, sampling, {"device": "cpu"})
    write_table(fixture, out / "fixture.parquet")
    replay = HFScoringEngine().score(fixture, model_dir, {"dtype": "bfloat16", "device": "cpu"})
    write_table(replay, out / "replay-bfloat16.parquet")
    return out


def test_the_floor_is_measured_per_pair_of_precisions(calibrated_run):
    calibration = json.loads((calibrated_run / "calibration.json").read_text())
    assert calibration["precisions"] == ["bfloat16", "float32"]
    assert calibration["sequences"] == 8 and calibration["tokens"] > 100
    pairs = calibration["pairs"]
    assert set(pairs) == {"bfloat16|bfloat16", "bfloat16|float32", "float32|float32"}
    fp32, mixed = pairs["float32|float32"]["all"], pairs["bfloat16|float32"]["all"]
    # fp32 scorings differ by reduction order only (~1e-7); bf16 by ~5e-3 on the tiny model
    assert fp32["mean"] < 1e-5 and fp32["max"] < 1e-4
    assert 1e-3 < mixed["mean"] < 3e-2 and mixed["q999"] > mixed["q99"] > mixed["mean"]
    # decoding against two batchings and eager attention against SDPA; in fp32 also each
    # against fp64 and two independent fp32 errors; across two precisions 5 ways
    assert pairs["float32|float32"]["variants"] == 6 and pairs["bfloat16|float32"]["variants"] == 5
    assert pairs["bfloat16|bfloat16"]["variants"] == 5  # and each bf16 way against fp32
    # fitted at the widest level, times the wide variants' own spread (another engine's room)
    widest = max(pairs["bfloat16|float32"]["variant_means"].values())
    allowance = pairs["bfloat16|float32"]["allowance"]
    assert 1.0 <= allowance < 1.5
    assert mixed["mean"] == pytest.approx(widest * allowance, rel=1e-9)
    assert 0 <= pairs["bfloat16|float32"]["design"]["icc"] < 0.2
    assert calibration["key"]["model_fingerprint"].startswith("sha256:")


def test_compare_finds_the_calibration_beside_the_replay(calibrated_run, tmp_path):
    run_lpx(
        "compare", calibrated_run / "fixture.parquet", calibrated_run / "replay-bfloat16.parquet",
        "--out", tmp_path / "cmp",
    )  # fmt: skip
    report = read_report(tmp_path / "cmp")
    note = report["calibration"]
    assert note["used"] and note["pair"] == "bfloat16|float32"
    assert note["source"] == str(calibrated_run / "calibration.json")
    # calibrated limits never tighten the bundled constants
    assert report["policy"]["limits"]["mean_abs_diff"] >= 0.03
    assert "noise floor: calibrated (bfloat16" in (tmp_path / "cmp" / "summary.md").read_text()
    run_lpx(
        "compare", calibrated_run / "fixture.parquet", calibrated_run / "replay-bfloat16.parquet",
        "--no-calibration", "--out", tmp_path / "plain",
    )  # fmt: skip
    plain = read_report(tmp_path / "plain")["calibration"]
    assert not plain["used"] and plain["judged_by"] == "the profile's constants"


def test_clean_precision_drift_is_never_a_semantic_finding(noisy_run, tmp_path):
    fixture, replay = noisy_run / "fixture.parquet", noisy_run / "replay-bfloat16.parquet"
    result = run_lpx("compare", fixture, replay, "--out", tmp_path / "plain")
    report = read_report(tmp_path / "plain")
    assert result.exit_code == 1  # the bf16 constants are too tight for this model
    assert report["metrics"]["mean_abs_diff"] > 0.03
    assert [f["cause"] for f in report["diagnosis"]] == ["dtype"]
    # re-scored in the declared bf16 and fp32 (the fixture's model is on disk): precision
    assert report["diagnosis"][0]["status"] == "verified"
    assert report["diagnosis"][0]["severity"] == "info"
    assert "uncalibrated" in report["diagnosis"][0]["evidence"]
    assert "no calibration" in report["calibration"]["reason"]
    result = run_lpx("compare", fixture, replay, "--no-verify", "--out", tmp_path / "guess")
    guess = read_report(tmp_path / "guess")["diagnosis"]
    assert [(f["cause"], f["status"]) for f in guess] == [("dtype", "plausible")]

    assert (
        run_lpx("calibrate", fixture, "--sequences", 8, "--out", tmp_path / "cal.json").exit_code
        == 0
    )
    result = run_lpx(
        "compare",
        fixture,
        replay,
        "--calibration",
        tmp_path / "cal.json",
        "--out",
        tmp_path / "cal",
    )
    report = read_report(tmp_path / "cal")
    assert result.exit_code == 0, report["policy"]["violations"]
    assert all(f["cause"] == "dtype" for f in report["diagnosis"])
    expected = report["calibration"]["expected_under_noise"]["mean_abs_diff"]
    assert 0.5 * expected < report["metrics"]["mean_abs_diff"] < 2 * expected


def test_a_user_limit_exceeded_by_noise_is_named_precision(calibrated_run, tmp_path):
    policy = tmp_path / "policy.yaml"
    policy.write_text(
        "version: 1\nprofiles:\n  bfloat16:\n    tau: 0.1\n    limits: {mean_abs_diff: 0.001}\n"
        "fail_on_findings: [unexplained]\n"
    )
    result = run_lpx(
        "compare", calibrated_run / "fixture.parquet", calibrated_run / "replay-bfloat16.parquet",
        "--policy", policy, "--out", tmp_path / "cmp",
    )  # fmt: skip
    report = read_report(tmp_path / "cmp")
    assert result.exit_code == 1
    assert report["policy"]["limits"] == {"mean_abs_diff": 0.001}  # the user's limit stands
    (finding,) = [f for f in report["diagnosis"] if f["cause"] == "dtype"]
    assert finding["status"] == "verified"  # re-scored in bf16 and fp32 by default
    assert "passes the precision gate" in finding["evidence"]
    assert "the drift is precision" in finding["evidence"]


def test_a_calibration_of_other_weights_is_refused_unless_allowed(
    calibrated_run, noisy_run, tmp_path
):
    args = ["compare", noisy_run / "fixture.parquet", noisy_run / "replay-bfloat16.parquet",
            "--calibration", calibrated_run / "calibration.json", "--no-verify"]  # fmt: skip
    result = run_lpx(*args, "--out", tmp_path / "cmp")
    assert result.exit_code == 2
    assert f"{calibrated_run / 'calibration.json'}: a calibration of weights" in result.output
    assert "--allow-calibration-mismatch" in result.output
    assert not (tmp_path / "cmp" / "report.json").exists()
    result = run_lpx(*args, "--allow-calibration-mismatch", "--out", tmp_path / "allowed")
    note = read_report(tmp_path / "allowed")["calibration"]
    assert note["used"] and note["mismatch_allowed"]["allowed"]
    assert note["mismatch_allowed"]["calibration"] == str(calibrated_run / "calibration.json")


def test_contradicting_calibration_options_are_refused(calibrated_run, tmp_path):
    result = run_lpx(
        "compare", calibrated_run / "fixture.parquet", calibrated_run / "replay-bfloat16.parquet",
        "--calibration", calibrated_run / "calibration.json", "--no-calibration",
        "--out", tmp_path / "cmp",
    )  # fmt: skip
    assert result.exit_code == 2
    assert "--no-calibration contradict each other" in result.output


def test_a_broken_calibration_is_refused_by_name(calibrated_run, tmp_path):
    broken = tmp_path / "calibration.json"
    broken.write_text('{"lpx_calibration": 2, "pairs": {"x": 1}}')
    result = run_lpx(
        "compare", calibrated_run / "fixture.parquet", calibrated_run / "replay-bfloat16.parquet",
        "--calibration", broken, "--out", tmp_path / "cmp",
    )  # fmt: skip
    assert result.exit_code == 2
    assert f"Error: {broken}: not a calibration lpx can judge with: `key`" in result.output
    assert result.output.count("\n") == 1 and "rerun `lpx calibrate`" in result.output


def test_calibrations_are_kept_in_the_history_and_reused(calibrated_run, tmp_path):
    db = tmp_path / "lpx.db"
    first = run_lpx("calibrate", calibrated_run / "fixture.parquet", "--sequences", 4,
                    "--db", db, "--out", tmp_path / "first.json")  # fmt: skip
    assert first.exit_code == 0 and "reused" not in first.output
    again = run_lpx("calibrate", calibrated_run / "fixture.parquet", "--sequences", 4,
                    "--db", db, "--out", tmp_path / "again.json")  # fmt: skip
    assert again.exit_code == 0 and "reused the one made" in again.output
    assert (tmp_path / "first.json").read_text() == (tmp_path / "again.json").read_text()
    fresh = run_lpx("calibrate", calibrated_run / "fixture.parquet", "--sequences", 4,
                    "--db", db, "--no-reuse", "--out", tmp_path / "fresh.json")  # fmt: skip
    assert fresh.exit_code == 0 and "reused" not in fresh.output


def test_lpx_record_keeps_the_runs_calibration(calibrated_run, tmp_path):
    from pipeline.db.models import Calibration
    from sqlalchemy import select

    from pipeline.history.database import open_history

    run = tmp_path / "run"
    shutil.copytree(calibrated_run, run)
    assert run_lpx("compare", run / "fixture.parquet", run / "replay-bfloat16.parquet",
                   "--out", run / "compare").exit_code == 0  # fmt: skip
    db = tmp_path / "lpx.db"
    assert run_lpx("record", run, "--db", db).exit_code == 0
    with open_history(str(db)).read() as session:
        (row,) = session.scalars(select(Calibration)).all()
        assert row.precisions == ["bfloat16", "float32"] and row.run_id is not None
        assert row.payload["pairs"].keys() >= {"bfloat16|float32"}


def test_fp16_from_the_fixture_is_left_out_where_the_cpu_emulates_it(monkeypatch, capsys):
    from pipeline import devices
    from pipeline.commands import calibrate as command

    monkeypatch.setattr(devices, "fp16_emulated", lambda device: "no fp16 here")
    assert command._without_emulated_fp16(["float16", "bfloat16"], False, "cpu") == ["bfloat16"]
    assert "float16 left out: no fp16 here" in capsys.readouterr().err
    asked = command._without_emulated_fp16(["float16"], True, "cpu")
    assert asked == ["float16"] and "as asked" in capsys.readouterr().err
    monkeypatch.setattr(devices, "fp16_emulated", lambda device: None)
    assert command._without_emulated_fp16(["float16"], False, "cpu") == ["float16"]
