"""What the long fuzz profile found (issue 28; LPX_FUZZ=long, support/fuzzing.py), each kept
as the example that found it."""

from __future__ import annotations

import json
from datetime import datetime

from support.helpers import run_lpx
from support.synthetic_runs import pair_report, write_run


def test_a_pass_without_its_mean_or_max_drift_is_an_error_run_never_a_pass(tmp_path):
    """A report whose verdict is pass but whose metrics lack max_abs_diff (deleted by hand):
    the gate passed it, as nothing judged the limit on it."""
    report = pair_report(metrics={"max_abs_diff": 0.02})
    report["policy"]["limits"] = {"max_abs_diff": 1.0}
    del report["metrics"]["max_abs_diff"]
    run = write_run(tmp_path / "night", {"compare": report}, started_at=datetime(2026, 3, 1))
    db = tmp_path / "h.db"
    assert run_lpx("record", run, "--db", db).exit_code == 0
    runs = json.loads(run_lpx("history", "runs", "--json", "--db", db).output)
    assert [r["status"] for r in runs] == ["error"]
    gate = run_lpx("gate", "--db", db)
    assert gate.exit_code == 2 and "metrics.max_abs_diff is missing" in gate.output


def test_smoke_never_replaces_a_users_file_in_its_out_directory(tmp_path):
    """`lpx smoke --out DIR` replaced a user's lpx-run.json there with its manifest."""
    out = tmp_path / "mine"
    out.mkdir()
    (out / "lpx-run.json").write_text("my notes\n")
    result = run_lpx("smoke", "--out", out, "--no-history")
    assert result.exit_code == 2
    assert (out / "lpx-run.json").read_text() == "my notes\n"
    (error,) = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert error == (
        f"Error: --out {out}: lpx-run.json there exists and lpx did not write it; lpx replaces "
        "only its own outputs. Choose another directory, or move that one away first."
    )
