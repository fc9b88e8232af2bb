"""End to end with real engines: two `lpx smoke` runs, then a run with an injected fault,
recorded into one history; the report attributes the regression to the faulted run."""

import os
import subprocess
import sys

import pytest

from pipeline.history import queries
from pipeline.history.database import open_history

pytestmark = pytest.mark.engine


def lpx(*args, cwd):
    result = subprocess.run(
        [sys.executable, "-m", "pipeline", *map(str, args)],
        capture_output=True,
        text=True,
        cwd=cwd,
        env={**os.environ, "CI": "true"},
    )
    return result


def test_two_smokes_then_a_fault_make_two_healthy_points_and_one_attributed_regression(
    tiny_model, tmp_path
):
    db = f"sqlite:///{tmp_path / 'lpx.db'}"
    site = tmp_path / "report"
    for _ in range(2):
        smoke = lpx(
            "smoke",
            "--out",
            tmp_path / "smoke",
            "--model",
            tiny_model,
            "--db",
            db,
            "--report-out",
            site,
            cwd=tmp_path,
        )
        assert smoke.returncode == 0, smoke.stderr
        last = smoke.stdout.strip().splitlines()[-1]
        assert last == f"report: {site / 'index.html'}" and (site / "index.html").is_file()
    fault = tmp_path / "fault"
    injected = lpx(
        "inject",
        tmp_path / "smoke" / "fixture.parquet",
        "--kind",
        "token_shift",
        "--sequence",
        "0-0",
        "--from-position",
        "5",
        "--out",
        fault / "fixture.parquet",
        cwd=tmp_path,
    )
    assert injected.returncode == 0, injected.stderr
    for dtype in ("float32", "bfloat16"):
        compare = lpx(
            "compare",
            fault / "fixture.parquet",
            tmp_path / "smoke" / f"replay-hf-{dtype}.parquet",
            "--out",
            fault / f"compare-hf-{dtype}",
            "--quiet",
            cwd=tmp_path,
        )
        assert compare.returncode == 1  # the fault fails the policy
    recorded = lpx("record", fault, "--kind", "manual", "--db", db, cwd=tmp_path)
    assert recorded.returncode == 0 and "recorded: run 3 (fail, 2 comparisons)" in recorded.stdout
    report = lpx("report", "--db", db, "--out", site, cwd=tmp_path)
    assert report.returncode == 0 and (site / "runs" / "3.html").is_file()

    history = open_history(db)
    with history.read() as session:
        series = queries.series(session)
        points = {s["id"]: queries.series_points(session, s["id"]) for s in series}
        alerts = queries.alerts(session)
    history.dispose()
    assert len(series) == 2  # fp32 and bf16 replays: one series each across the three runs
    for rows in points.values():
        assert [p["run"] for p in rows] == [1, 2, 3]
        assert [p["verdict"] for p in rows] == ["pass", "pass", "fail"]
        assert [p["run_kind"] for p in rows] == ["smoke", "smoke", "manual"]
    assert len(alerts) == 2 and {a["series_id"] for a in alerts} == {s["id"] for s in series}
    for alert in alerts:
        assert alert["kind"] == "policy_violation"
        assert alert["last_good"]["run"] == 2 and alert["first_bad"]["run"] == 3
        assert "token_shift" in alert["rule"]
        assert alert["attribution"] == [] or all(
            c["field"] != "version" for c in alert["attribution"]
        )
    history = open_history(db)
    with history.read() as session:
        from pipeline.db.models import Comparison
        from sqlalchemy import select

        details = session.scalars(select(Comparison.details).order_by(Comparison.id)).all()
    history.dispose()
    for item in details:  # what compare wrote into report.json, decoded with the tiny tokenizer
        assert len(item["heatmap"]["rows"]) == 16 and item["heatmap"]["bin"] == 1
        assert item["decoded"] and all("text" in w and "context" in w for w in item["worst"])
    faulted = details[-1]["heatmap"]["rows"][0]
    assert faulted["sequence_id"] == "0-0"  # the planted fault is the most drifting row
    index = (site / "index.html").read_text()
    assert "token_shift" in index and 'id="count-policy">2<' in index
    gate = lpx("gate", "--db", db, cwd=tmp_path)
    assert gate.returncode == 1 and "policy_violation" in gate.stdout


def test_a_smoke_whose_stage_fails_is_recorded_as_an_error_run(tiny_model, tmp_path):
    db = f"sqlite:///{tmp_path / 'lpx.db'}"
    smoke = lpx(
        "smoke",
        "--out",
        tmp_path / "smoke",
        "--model",
        tiny_model,
        "--rollout",
        "nosuch",
        "--db",
        db,
        "--report-out",
        tmp_path / "report",
        cwd=tmp_path,
    )
    assert smoke.returncode == 2 and "Traceback" not in smoke.stderr
    assert "nosuch" in smoke.stderr and len(smoke.stderr.strip().splitlines()) == 1
    assert f"report: {tmp_path / 'report' / 'index.html'}" in smoke.stdout
    history = open_history(db)
    with history.read() as session:
        (run,) = queries.runs(session)
    history.dispose()
    assert run["status"] == "error" and run["kind"] == "smoke" and run["comparisons"] == 0
    assert run["errors"][0]["stage"] == "smoke" and "nosuch" in run["errors"][0]["message"]
    gate = lpx("gate", "--db", db, cwd=tmp_path)
    assert gate.returncode == 2 and "gate: ERROR" in gate.stdout
    errors = [line for line in gate.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "is an error run" in errors[0] and "nosuch" in errors[0]
