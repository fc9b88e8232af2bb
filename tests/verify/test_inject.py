"""Every planted fault is caught: compare fails, the worst token sits in the faulted
sequence at or after the fault, and the diagnosis names the cause."""

import numpy as np
import pytest

from pipeline.engines.hf.replay import HFScoringEngine
from pipeline.fixture.io import read_table
from support.helpers import read_report, run_lpx

CAUSE_OF_KIND = {  # kinds with an onset, planted in one sequence from a position
    "token_shift": "token_shift",
    "mask": "mask_padding",
    "position_ids": "position_ids",
    "dtype": "dtype",
}
# The zoo on the shared fixture (sampled at temperature 1, no truncation), every sequence;
# the full matrix over archs, seeds, counts and sampling is bench/diagnosis.py.
ZOO = {
    "pad_attended": {"mask_padding"},
    "packed_no_reset": {"mask_padding"},
    "positions_restart": {"position_ids"},
    "label_shift": {"token_shift"},
    "bos_missing": {"prompt_mismatch"},
    "prompt_truncated": {"prompt_mismatch"},
    "stale_weights": {"stale_weights"},
    "version_change_unrecorded": {"version_change"},
    "version_change": {"version_change"},
    "lm_head_bf16": {"dtype"},
    "fp16": {"dtype"},
    # Gaussian noise of 1e-3 on fp32 sides: beyond the declared precision, and no lower
    # precision re-scored reproduces it, so it is a fault to explain, not precision
    "noise": {"unexplained"},
    "pad_positions": set(),  # a constant position offset is invisible to RoPE
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
    if kind == "dtype":  # a rounded value can land within tau of the exact one
        assert finding["first_position"]["position"] >= from_position
    else:  # positional faults: the first wrong logprob, exactly
        assert finding["first_position"]["position"] == from_position
    assert finding["evidence"]


@pytest.mark.parametrize("kind", sorted(ZOO))
def test_the_zoo_is_named_from_the_whole_batch(run_dir, tmp_path, kind):
    faulted = tmp_path / "faulted.parquet"
    args = ["--sequence", "all", "--from-position", 4, "--out", faulted]
    result = run_lpx("inject", run_dir / "fixture.parquet", "--kind", kind, *args)
    assert result.exit_code == 0, result.output
    result = run_lpx(
        "compare", faulted, run_dir / "replay-float32.parquet", "--out", tmp_path / "cmp"
    )
    report = read_report(tmp_path / "cmp")
    # what the report claims: a cause verification ruled out is listed, not named
    named = {f["cause"] for f in report["diagnosis"] if f.get("status") != "ruled_out"}
    assert named == ZOO[kind], [(f["cause"], f["evidence"][:120]) for f in report["diagnosis"]]
    assert report["verdict"] == ("fail" if ZOO[kind] else "pass")
    for finding in report["diagnosis"]:
        assert 0.0 <= finding["confidence"] <= 1.0
        if finding["cause"] in ("version_change", "position_ids"):
            assert finding["runner_up"]["cause"] and finding["runner_up"]["why_not"]
    if kind.startswith("version_change"):
        (finding,) = report["diagnosis"]
        assert finding["details"]["at"] == 4 and len(finding["sequences"]) == 16


def test_two_faults_in_different_sequences_are_both_named(run_dir, tmp_path):
    """Padding attended in two sequences and positions offset from index 6 in a third, each
    re-scored by the real model: both causes, each with its own sequences."""
    fixture = read_table(run_dir / "fixture.parquet")
    lengths = np.diff(fixture.prompt_offsets) + np.diff(fixture.completion_offsets)
    # the two shortest of the first micro-batch of 8: the ones that get padding
    shortest = [fixture.sequence_ids[i] for i in np.argsort(lengths[:8], kind="stable")[:2]]
    assert "3-0" not in shortest
    padded, both = tmp_path / "padded.parquet", tmp_path / "both.parquet"
    result = run_lpx(
        "inject", run_dir / "fixture.parquet", "--kind", "pad_attended",
        "--sequence", shortest[0], "--sequence", shortest[1], "--out", padded,
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    result = run_lpx(
        "inject", padded, "--kind", "position_ids", "--sequence", "3-0",
        "--from-position", 6, "--out", both,
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    result = run_lpx("compare", both, run_dir / "replay-float32.parquet", "--out", tmp_path / "c")
    assert result.exit_code == 1, result.output
    causes = {f["cause"]: f for f in read_report(tmp_path / "c")["diagnosis"]}
    assert set(causes) == {"mask_padding", "position_ids"}
    assert causes["position_ids"]["sequences"] == ["3-0"]
    assert causes["position_ids"]["first_position"] == {"sequence_id": "3-0", "position": 6}
    assert causes["mask_padding"]["sequences"] == sorted(shortest, key=fixture.sequence_ids.index)


def test_a_truncation_fault_needs_a_fixture_sampled_with_it(run_dir, tmp_path):
    result = run_lpx(
        "inject",
        run_dir / "fixture.parquet",
        "--kind",
        "top_k",
        "--sequence",
        "all",
        "--out",
        tmp_path / "x.parquet",
    )
    assert result.exit_code == 2
    assert "outside the top_k set" in result.output and "--top-k" in result.output


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


def perturbed_model(tiny_model, out_dir, run_dir):
    """The tiny model one AdamW step on, taken on the fixture's own sequences as a trainer
    would (the next policy version)."""
    import shutil

    from pipeline.engines.hf.model import load_model
    from pipeline.faults import optimiser_step
    from pipeline.fixture.io import read_table

    shutil.copytree(tiny_model, out_dir)
    fixture = read_table(run_dir / "fixture.parquet")
    pairs = [
        (fixture.prompt_of(i), fixture.completion_of(i)) for i in range(len(fixture.sequence_ids))
    ]
    optimiser_step(load_model(tiny_model), pairs, 1e-4).save_pretrained(out_dir)
    return out_dir


def test_replay_with_other_weights_is_bad_input_unless_allowed(run_dir, tiny_model, tmp_path):
    stale = perturbed_model(tiny_model, tmp_path / "stale-model", run_dir)
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

    stale = perturbed_model(tiny_model, tmp_path / "stale-model", run_dir)
    fixture = read_table(run_dir / "fixture.parquet")
    replay = HFScoringEngine().score(fixture, stale, {})
    replay.metadata["model"] = fixture.metadata["model"]
    path = write_table(replay, tmp_path / "replay.parquet")
    result = run_lpx("compare", run_dir / "fixture.parquet", path, "--out", tmp_path / "cmp")
    assert result.exit_code == 1
    findings = read_report(tmp_path / "cmp")["diagnosis"]
    # not stale (no update is recorded, so none was missed: ruled out, saying why), but
    # other weights in memory, as the drift's shape says (issue 53)
    assert [(f["cause"], f["status"]) for f in findings] == [
        ("stale_weights", "ruled_out"),
        ("weights_differ", "plausible"),
    ]
    assert "neither records a weight update" in findings[0]["evidence"]
    assert len(findings[1]["sequences"]) >= 12
    assert "no reproducible cause reproduces the drift" in findings[1]["evidence"]
