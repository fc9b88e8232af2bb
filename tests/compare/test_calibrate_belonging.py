"""`lpx calibrate` measures the floor of the fixture's own model and writes only where it may
(issue 28): another model is refused unless asked for and then recorded, and an output that
lpx did not write is never replaced."""

from __future__ import annotations

import json

import pytest

from pipeline.fingerprint import weights_fingerprint
from support.fuzzing import model_with_other_weights, synthetic_calibration
from support.helpers import run_lpx


@pytest.fixture(scope="module")
def stale_model(tiny_model, tmp_path_factory):
    return model_with_other_weights(tiny_model, tmp_path_factory.mktemp("stale") / "model")


def _errors(result) -> list[str]:
    return [line for line in result.output.splitlines() if line.startswith("Error:")]


def test_another_model_is_refused_naming_both_weights_and_what_to_pass(
    run_dir, tiny_model, stale_model, tmp_path
):
    out = tmp_path / "calibration.json"
    result = run_lpx("calibrate", run_dir / "fixture.parquet", "--model", stale_model,
                     "--out", out)  # fmt: skip
    assert result.exit_code == 2 and not out.exists()
    (error,) = _errors(result)
    assert error == (
        f"Error: --model {stale_model}: its weights ({weights_fingerprint(stale_model)[:19]}...) "
        f"are not the weights {run_dir / 'fixture.parquet'} was rolled out with "
        f"({weights_fingerprint(tiny_model)[:19]}...); pass the fixture's model "
        f"({tiny_model.resolve()}), or --allow-model-mismatch to re-score with other weights on "
        "purpose (a stale checkpoint)."
    )


def test_a_mismatch_allowed_on_purpose_is_calibrated_and_recorded(
    run_dir, tiny_model, stale_model, tmp_path
):
    out = tmp_path / "calibration.json"
    out.write_text(json.dumps(synthetic_calibration()))  # an earlier lpx calibration: replaced
    result = run_lpx(
        "calibrate", run_dir / "fixture.parquet", "--model", stale_model, "--out", out,
        "--allow-model-mismatch", "--dtype", "float32", "--sequences", "2",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    written = json.loads(out.read_text())
    assert written["key"]["model_fingerprint"] == weights_fingerprint(stale_model)
    assert written["allowed_mismatches"] == {
        "model": {
            "fixture_weights": weights_fingerprint(tiny_model),
            "model_weights": weights_fingerprint(stale_model),
            "model": str(stale_model),
            "allowed": True,
        }
    }
    assert written["sequences"] == 2 and written["tokens"] > 0


@pytest.mark.parametrize("where", ["--out", "beside the fixture"])
def test_a_file_lpx_did_not_write_is_never_replaced(where, run_dir, tmp_path):
    import shutil

    fixture = tmp_path / "fixture.parquet"
    shutil.copy(run_dir / "fixture.parquet", fixture)
    mine = tmp_path / ("mine.json" if where == "--out" else "calibration.json")
    mine.write_text('{"my": "own floors"}\n')
    args = ["--out", mine] if where == "--out" else []
    result = run_lpx("calibrate", fixture, *args)
    assert result.exit_code == 2 and mine.read_text() == '{"my": "own floors"}\n'
    (error,) = _errors(result)
    assert str(mine) in error and "lpx replaces only" in error
