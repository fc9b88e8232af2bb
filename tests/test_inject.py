"""Every planted fault is caught: compare fails, the worst token sits in the faulted
sequence at or after the fault, and the diagnosis names the cause."""

import pytest

from tests.helpers import read_report, run_lpx

CAUSE_OF_KIND = {
    "token_shift": "token_shift",
    "mask": "mask_padding",
    "position_ids": "position_ids",
    "temperature": "temperature",
    "dtype": "dtype",
    "stale_weights": "stale_weights",
}
SEQUENCE, FROM_POSITION = "3-1", 5


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
def test_injected_fault_is_caught_and_named(run_dir, tmp_path, kind):
    faulted = tmp_path / "faulted.parquet"
    result = run_lpx(
        "inject",
        run_dir / "fixture.parquet",
        "--kind",
        kind,
        "--sequence",
        SEQUENCE,
        "--from-position",
        FROM_POSITION,
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
    assert worst["sequence_id"] == SEQUENCE and worst["position"] >= FROM_POSITION
    causes = {f["cause"]: f for f in report["diagnosis"]}
    assert list(causes) == [CAUSE_OF_KIND[kind]]
    finding = causes[CAUSE_OF_KIND[kind]]
    assert finding["sequences"] == [SEQUENCE]
    assert finding["first_position"]["sequence_id"] == SEQUENCE
    assert finding["first_position"]["position"] >= FROM_POSITION
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


def test_replay_with_other_weights_is_bad_input_unless_allowed(run_dir, tiny_model, tmp_path):
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    stale = tmp_path / "stale-model"
    shutil.copytree(tiny_model, stale)
    weights = load_file(stale / "model.safetensors")
    generator = torch.Generator().manual_seed(0)
    for name, tensor in weights.items():
        weights[name] = tensor + 0.02 * tensor.std() * torch.randn(
            tensor.shape, generator=generator
        )
    save_file(weights, stale / "model.safetensors", metadata={"format": "pt"})
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


def test_uniform_drift_without_fingerprints_points_at_weights(run_dir, tiny_model, tmp_path):
    """A wrong weight conversion keeps the file fingerprint: the drift pattern must say it."""
    from pipeline.fixture.io import read_table, write_table

    replay = read_table(run_dir / "replay-float32.parquet")
    rng = __import__("numpy").random.default_rng(0)
    replay.channels["replay"] = (
        replay.channels["replay"] - rng.uniform(0.05, 0.5, replay.num_completion_tokens)
    ).astype("float32")
    path = write_table(replay, tmp_path / "replay.parquet")
    result = run_lpx("compare", run_dir / "fixture.parquet", path, "--out", tmp_path / "cmp")
    assert result.exit_code == 1
    findings = read_report(tmp_path / "cmp")["diagnosis"]
    assert [f["cause"] for f in findings] == ["stale_weights"]
    assert len(findings[0]["sequences"]) == 16
