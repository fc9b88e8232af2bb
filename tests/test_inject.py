"""Every planted fault is caught: compare fails, the worst token sits in the faulted
sequence at or after the fault, and the diagnosis names the cause."""

import pytest

from pipeline.engines.hf_replay import HFScoringEngine
from tests.helpers import read_report, run_lpx

CAUSE_OF_KIND = {
    "token_shift": "token_shift",
    "mask": "mask_padding",
    "position_ids": "position_ids",
    "temperature": "temperature",
    "dtype": "dtype",
    "stale_weights": "stale_weights",
}
PLACES = [("3-1", 5), ("0-0", 2), ("7-0", 9)]


def test_clean_fp32_run_passes_without_findings(run_dir, tmp_path):
    result = run_lpx(
        "compare",
        run_dir / "fixture.parquet",
        run_dir / "replay-float32.parquet",
        "--out",
        tmp_path,
    )
    assert result.exit_code == 0, result.output
    report = read_report(tmp_path)
    assert report["verdict"] == "pass" and report["diagnosis"] == []
    assert report["metrics"]["max_abs_diff"] < 1e-5


@pytest.mark.parametrize("kind", sorted(CAUSE_OF_KIND))
@pytest.mark.parametrize("place", PLACES, ids=lambda p: f"{p[0]}@{p[1]}")
def test_injected_fault_is_caught_and_named(run_dir, tmp_path, kind, place):
    sequence, from_position = place
    faulted = tmp_path / "faulted.parquet"
    result = run_lpx(
        "inject",
        run_dir / "fixture.parquet",
        "--kind",
        kind,
        "--sequence",
        sequence,
        "--from-position",
        from_position,
        "--out",
        faulted,
    )
    assert result.exit_code == 0, result.output
    result = run_lpx(
        "compare", faulted, run_dir / "replay-float32.parquet", "--out", tmp_path / "cmp"
    )
    assert result.exit_code == 1, result.output
    report = read_report(tmp_path / "cmp")
    assert report["verdict"] == "fail"
    worst = report["worst"][0]
    assert worst["sequence_id"] == sequence and worst["position"] >= from_position
    causes = {f["cause"]: f for f in report["diagnosis"]}
    assert list(causes) == [CAUSE_OF_KIND[kind]]
    finding = causes[CAUSE_OF_KIND[kind]]
    assert finding["sequences"] == [sequence]
    assert finding["first_position"]["sequence_id"] == sequence
    assert finding["first_position"]["position"] >= from_position
    assert finding["evidence"]


def test_injecting_into_a_replay_works_too(run_dir, tmp_path):
    faulted = tmp_path / "replay-shifted.parquet"
    run_lpx(
        "inject",
        run_dir / "replay-float32.parquet",
        "--kind",
        "token_shift",
        "--sequence",
        "0-0",
        "--from-position",
        2,
        "--out",
        faulted,
    )
    result = run_lpx("compare", run_dir / "fixture.parquet", faulted, "--out", tmp_path / "cmp")
    assert result.exit_code == 1
    finding = read_report(tmp_path / "cmp")["diagnosis"][0]
    assert finding["cause"] == "token_shift" and finding["details"]["shift"] == 1


def perturbed_model(tiny_model, out_dir):
    """A copy of the tiny model with every weight nudged (an older or wrongly converted policy)."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(tiny_model, out_dir)
    weights = load_file(out_dir / "model.safetensors")
    generator = torch.Generator().manual_seed(0)
    for name, tensor in weights.items():
        weights[name] = tensor + 0.02 * tensor.std() * torch.randn(
            tensor.shape, generator=generator
        )
    save_file(weights, out_dir / "model.safetensors", metadata={"format": "pt"})
    return out_dir


def test_replay_with_other_weights_is_bad_input_unless_allowed(run_dir, tiny_model, tmp_path):
    stale = perturbed_model(tiny_model, tmp_path / "stale-model")
    replay = tmp_path / "replay-stale.parquet"
    assert (
        run_lpx("replay", run_dir / "fixture.parquet", "--model", stale, "--out", replay).exit_code
        == 0
    )

    result = run_lpx("compare", run_dir / "fixture.parquet", replay, "--out", tmp_path / "cmp")
    assert result.exit_code == 2 and "--allow-weight-mismatch" in result.output
    assert not (tmp_path / "cmp" / "report.json").exists()

    result = run_lpx(
        "compare",
        run_dir / "fixture.parquet",
        replay,
        "--out",
        tmp_path / "cmp",
        "--allow-weight-mismatch",
    )
    assert result.exit_code == 1
    report = read_report(tmp_path / "cmp")
    assert [f["cause"] for f in report["diagnosis"]] == ["stale_weights"]
    assert "fingerprint differs" in report["diagnosis"][0]["evidence"]
    assert report["metrics"]["mean_abs_diff"] > 1e-3


def test_other_weights_behind_an_equal_fingerprint_are_still_named(run_dir, tiny_model, tmp_path):
    """An engine that converts or shards weights wrongly still reports the file's fingerprint:
    the drift pattern alone must point at the weights."""
    from pipeline.fixture.io import read_table, write_table

    stale = perturbed_model(tiny_model, tmp_path / "stale-model")
    fixture = read_table(run_dir / "fixture.parquet")
    replay = HFScoringEngine().score(fixture, stale, {})
    replay.metadata["model"] = fixture.metadata["model"]
    path = write_table(replay, tmp_path / "replay.parquet")
    result = run_lpx("compare", run_dir / "fixture.parquet", path, "--out", tmp_path / "cmp")
    assert result.exit_code == 1
    findings = read_report(tmp_path / "cmp")["diagnosis"]
    assert [f["cause"] for f in findings] == ["stale_weights"]
    assert len(findings[0]["sequences"]) >= 12
    assert "equal weight fingerprints" in findings[0]["evidence"]
