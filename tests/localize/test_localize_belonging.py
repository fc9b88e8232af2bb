"""`lpx localize` runs the fixture's own model and picks sequences by the fixture's own
report, and writes only over what lpx wrote (issue 28). The report is a real `lpx compare` of
the shared tiny-model run; the stale model is the tiny model with one layer scaled."""

from __future__ import annotations

import json

import pytest

from pipeline.fingerprint import weights_fingerprint
from support.fuzzing import model_with_other_weights
from support.helpers import inline_report, run_lpx


@pytest.fixture(scope="module")
def compared(run_dir, tmp_path_factory) -> dict:
    """report.json of the fixture against its bf16 replay, as lpx compare wrote it before
    sequences.parquet (rows inline): the layout these tests edit, and an older report still
    opens."""
    out = tmp_path_factory.mktemp("compare")
    result = run_lpx(
        "compare", run_dir / "fixture.parquet", run_dir / "replay-bfloat16.parquet",
        "--out", out, "--no-calibration",
    )  # fmt: skip
    assert result.exit_code in (0, 1), result.output
    return inline_report(out)


@pytest.fixture(scope="module")
def stale_model(tiny_model, tmp_path_factory):
    return model_with_other_weights(tiny_model, tmp_path_factory.mktemp("stale") / "model")


def _localize(run_dir, tiny_model, out, *extra):
    result = run_lpx(
        "localize", run_dir / "fixture.parquet", "--a", "hf", "--b", "hf", "--out", out, *extra
    )
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    return result, errors


def _report(tmp_path, report: dict):
    path = tmp_path / "report.json"
    path.write_text(json.dumps(report))
    return path


def test_the_worst_sequences_of_the_fixtures_report_are_chosen(
    run_dir, tiny_model, compared, tmp_path
):
    report = json.loads(json.dumps(compared))
    ids = [row["sequence_id"] for row in report["sequences"]]
    for rank, row in enumerate(report["sequences"]):
        row["max_abs_diff"] = float(rank)
    report["sequences"][1]["max_abs_diff"] = "nan"  # a broken sequence ranks first
    out = tmp_path / "localize"
    result, _ = _localize(run_dir, tiny_model, out, "--report", _report(tmp_path, report),
                          "--sequences", "3")  # fmt: skip
    assert result.exit_code in (0, 1), result.output
    written = json.loads((out / "localize.json").read_text())
    assert written["sequences"] == [ids[1], ids[-1], ids[-2]]
    assert "allowed_mismatches" not in written and written["lpx_localize"] == 1


def test_another_fixtures_report_is_refused_unless_allowed_and_then_recorded(
    run_dir, tiny_model, compared, tmp_path
):
    report = json.loads(json.dumps(compared))
    report["metadata"]["fixture"]["prompt_set_fingerprint"] = "sha256:" + "0" * 64
    path = _report(tmp_path, report)
    out = tmp_path / "localize"
    result, (error,) = _localize(run_dir, tiny_model, out, "--report", path)
    assert result.exit_code == 2 and not out.exists()
    fixture = run_dir / "fixture.parquet"
    assert error.startswith(
        f"Error: --report {path}: a comparison of {fixture}, not of {fixture} (its prompt set is "
        "sha256:000000000000..., the fixture's sha256:"
    )
    assert error.endswith("or --allow-report-mismatch to pick sequences by it on purpose.")
    result, _ = _localize(run_dir, tiny_model, out, "--report", path, "--allow-report-mismatch",
                          "--sequences", "1")  # fmt: skip
    assert result.exit_code in (0, 1), result.output
    recorded = json.loads((out / "localize.json").read_text())["allowed_mismatches"]
    assert recorded == {
        "report": {
            "fixture": str(fixture),
            "report": str(path),
            "reason": recorded["report"]["reason"],
            "allowed": True,
        }
    }
    assert recorded["report"]["reason"].startswith("its prompt set is sha256:000000000000...")


def test_a_damaged_or_matrix_report_is_refused_before_any_capture(
    run_dir, tiny_model, compared, tmp_path
):
    report = json.loads(json.dumps(compared))
    report["sequences"][0]["max_abs_diff"] = "large"
    result, (error,) = _localize(run_dir, tiny_model, tmp_path / "o", "--report",
                                 _report(tmp_path, report))  # fmt: skip
    assert result.exit_code == 2
    assert "`sequences[0].max_abs_diff`: must be a number >= 0" in error
    matrix = {"verdict": "fail", "pairs": [{"pair": "0-hf"}], "metadata": {}}
    result, (error,) = _localize(run_dir, tiny_model, tmp_path / "o", "--report",
                                 _report(tmp_path, matrix))  # fmt: skip
    assert result.exit_code == 2 and "a matrix's report; pass one pair's report.json" in error


def test_another_model_is_refused_unless_allowed_and_then_recorded(
    run_dir, tiny_model, stale_model, tmp_path
):
    out = tmp_path / "localize"
    result, (error,) = _localize(run_dir, tiny_model, out, "--model", stale_model)
    assert result.exit_code == 2 and not out.exists()
    assert error.startswith(f"Error: --model {stale_model}: its weights (")
    assert "--allow-model-mismatch" in error
    result, _ = _localize(run_dir, tiny_model, out, "--model", stale_model,
                          "--allow-model-mismatch", "--sequences", "1")  # fmt: skip
    assert result.exit_code in (0, 1), result.output
    recorded = json.loads((out / "localize.json").read_text())["allowed_mismatches"]
    assert recorded == {
        "model": {
            "fixture_weights": weights_fingerprint(tiny_model),
            "model_weights": weights_fingerprint(stale_model),
            "model": str(stale_model),
            "allowed": True,
        }
    }
    # --model-b holds other weights by design: side B's model is not the fixture's to check
    result, _ = _localize(run_dir, tiny_model, out, "--model-b", stale_model, "--sequences", "1")
    assert result.exit_code in (0, 1), result.output


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--sequence", "x", "--report", "r.json"], "Error: --sequence 'x' and --report r.json "
         "both choose the sequences; pass one (--sequence names them, --report takes its worst)."),
        (["--sequence", "x", "--sequences", "2"], "Error: --sequence 'x' and --sequences 2 both "
         "choose the sequences; pass one (--sequences counts them when none is named)."),
    ],
)  # fmt: skip
def test_options_that_choose_the_sequences_twice_are_refused(
    extra, message, run_dir, tiny_model, tmp_path
):
    result, errors = _localize(run_dir, tiny_model, tmp_path / "o", *extra)
    assert result.exit_code == 2 and errors == [message]


@pytest.mark.parametrize("name", ["localize.json", "localize.svg", "captures"])
def test_an_output_directory_holding_a_users_file_is_refused_and_left_alone(
    name, run_dir, tiny_model, tmp_path
):
    out = tmp_path / "mine"
    out.mkdir()
    if name == "captures":
        (out / name).mkdir()
        (out / name / "notes.txt").write_text("mine")
    else:
        (out / name).write_text("mine")
    result, (error,) = _localize(run_dir, tiny_model, out)
    assert result.exit_code == 2
    assert error == (
        f"Error: --out {out}: {name} there exists and lpx did not write it; lpx replaces only "
        "its own outputs. Choose another directory, or move that one away first."
    )
    kept = out / name / "notes.txt" if name == "captures" else out / name
    assert kept.read_text() == "mine"


def test_a_rerun_replaces_what_an_earlier_localize_wrote(run_dir, tiny_model, tmp_path):
    out = tmp_path / "localize"
    first, _ = _localize(run_dir, tiny_model, out, "--sequences", "1", "--keep-captures")
    assert first.exit_code in (0, 1), first.output
    assert (out / "captures" / ".lpx-output").is_file()
    again, _ = _localize(run_dir, tiny_model, out, "--sequences", "1")
    assert again.exit_code in (0, 1), again.output
    assert not (out / "captures").exists()  # removed: it was lpx's
