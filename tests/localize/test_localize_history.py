"""`lpx record` keeps each pair's localize.json: its verdict and first boundary on the
comparison and one row per boundary, on SQLite and PostgreSQL; a malformed file is refused
naming the field, a self-contradicting one makes the run an error run, and lpx run's
localize stage that failed or was skipped is the pair's note, not an error run.

The localize.json comes from the real `lpx localize` (hf adapter, a seeded stale layer 1, two
sequences of the tiny model); variants are edits of it."""

from __future__ import annotations

import copy
import json
import time
from datetime import datetime, timedelta
from pathlib import Path

import pytest
from pipeline.db.models import Comparison, LocalizeBoundary, MetricValue, Run
from sqlalchemy import select

from pipeline.history.database import open_history, schema_revision
from support.helpers import count, run_lpx
from support.synthetic_runs import pair_report, write_run

START = datetime(2026, 3, 1, 3, 0)
PAIR = "compare/0-hf-bfloat16"


@pytest.fixture(scope="session")
def localize_result(tmp_path_factory, run_dir, tiny_model) -> dict:
    """A real localize.json: layer 1's MLP output seeded stale on side B (verified)."""
    out = tmp_path_factory.mktemp("localize")
    result = run_lpx(
        "localize", run_dir / "fixture.parquet", "--a", "hf", "--b",
        "hf:fault=stale_layer,fault_layer=1", "--sequences", "2", "--model", tiny_model,
        "--out", out,
    )  # fmt: skip
    assert result.exit_code == 1, result.output
    return json.loads((out / "localize.json").read_text())


def localized_run(root: Path, result: dict | None, *, day: int = 0, stage: dict | None = None,
                  rollout_version: str = "0.32.0") -> Path:  # fmt: skip
    """A run whose one failing pair has ``result`` as its localize/localize.json."""
    run = write_run(
        root / f"night-{day}",
        {PAIR: pair_report(verdict="fail", rollout_version=rollout_version)},
        started_at=START + timedelta(days=day),
    )
    if result is not None:
        (run / PAIR / "localize").mkdir()
        (run / PAIR / "localize" / "localize.json").write_text(json.dumps(result))
    if stage is not None:
        manifest = json.loads((run / "lpx-run.json").read_text())
        manifest["stages"].append({"optional": True, "pair": PAIR, "outputs": [], **stage})
        (run / "lpx-run.json").write_text(json.dumps(manifest))
    return run


def stored(url: str):
    history = open_history(url)
    try:
        with history.read() as session:
            comparison = session.scalar(select(Comparison))
            rows = session.scalars(select(LocalizeBoundary).order_by(LocalizeBoundary.id)).all()
            run = session.scalar(select(Run))
            return comparison, rows, run
    finally:
        history.dispose()


def test_record_keeps_the_verdict_first_boundary_and_every_boundary_number(
    history_url, tmp_path, localize_result
):
    run = localized_run(tmp_path, localize_result)
    assert run_lpx("record", run, "--db", history_url).exit_code == 0
    assert schema_revision(open_history(history_url)) == "0010"
    comparison, rows, recorded = stored(history_url)
    first = localize_result["first"]
    assert localize_result["verdict"] == "verified" and first["boundary"] == "layers.1.mlp_out"
    assert recorded.status == "fail" and recorded.errors == []
    assert comparison.localize_verdict == "verified"
    assert comparison.localize_boundary == "layers.1.mlp_out"
    assert comparison.localize["first"]["ratio"] == first["ratio"]
    assert comparison.localize["verification"]["by"] == localize_result["verification"]["by"]
    assert comparison.localize["sides"]["b"]["spec"] == "hf:fault=stale_layer,fault_layer=1"
    expected = localize_result["boundaries"]
    assert len(rows) == len(expected) == 17  # embed, 2 layers x 7, final norm, logits
    for row, want in zip(rows, expected, strict=True):
        assert (row.boundary, row.layer, row.kind) == (
            want["boundary"],
            want["layer"],
            want["kind"],
        )
        assert row.drift_max == want["drift"]["max"] and row.drift_rms == want["drift"]["rms"]
        assert row.floor_max == want["floor"]["max"] and row.floor_rms == want["floor"]["rms"]
        assert row.ratio == want["ratio"] and row.beyond is want["beyond"]
        assert row.series_id == comparison.series_id and row.started_at == START
    assert [r.boundary for r in rows if r.beyond][0] == "layers.1.mlp_out"
    assert rows[0].layer is None and rows[-1].boundary == "logits"
    again = run_lpx("record", run, "--db", history_url)  # idempotent: no second set of rows
    assert again.exit_code == 0 and count(history_url, LocalizeBoundary) == 17


def break_field(path: str, value):
    def edit(result):
        *parents, leaf = path.split(".")
        node = result
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        node[leaf] = value

    return edit


WRONG = {
    "boundaries.3.ratio": "12.5",  # a number as a string
    "boundaries.3.beyond": "yes",
    "boundaries.3.layer": -1,
    "boundaries.3.drift.max": -0.5,
    "boundaries.3.boundary": "x" * 200,  # wider than the column
    "verdict": "suspect",
    "tokens": 2**70,
    "first.ratio": None,
    "sides.a.spec": 7,
}


@pytest.mark.parametrize("field", sorted(WRONG), ids=str)
def test_a_wrong_type_or_range_is_refused_naming_the_file_and_field(
    field, tmp_path, localize_result
):
    result = copy.deepcopy(localize_result)
    break_field(field, WRONG[field])(result)
    run = localized_run(tmp_path, result)
    db = tmp_path / "h.db"
    refused = run_lpx("record", run, "--db", db)
    assert refused.exit_code == 2, refused.output
    errors = [line for line in refused.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "Traceback" not in refused.output, refused.output
    path = run / PAIR / "localize" / "localize.json"
    leaf = field.split(".")[-1]
    assert str(path) in errors[0] and f"{leaf}`" in errors[0], errors[0]
    assert "nothing was recorded" in errors[0]
    assert not db.exists() or count(f"sqlite:///{db}", Run) == 0


def test_corrupt_json_is_refused_naming_the_file(tmp_path):
    run = localized_run(tmp_path, None)
    (run / PAIR / "localize").mkdir()
    (run / PAIR / "localize" / "localize.json").write_text('{"verdict": "clean", ')
    refused = run_lpx("record", run, "--db", tmp_path / "h.db")
    assert refused.exit_code == 2 and "corrupt localize result" in refused.stderr


def test_a_self_contradicting_result_makes_an_error_run_and_is_not_stored(
    tmp_path, localize_result
):
    result = copy.deepcopy(localize_result)
    result["verdict"], result["first"], result["verification"] = "clean", None, None
    run = localized_run(tmp_path, result)
    url = f"sqlite:///{tmp_path / 'h.db'}"
    assert run_lpx("record", run, "--db", url).exit_code == 0
    comparison, rows, recorded = stored(url)
    assert recorded.status == "error" and rows == []
    assert comparison.localize_verdict is None and comparison.verdict == "fail"
    (error,) = recorded.errors
    assert error["stage"] == "localize"
    assert "the verdict is clean but layers.1.mlp_out is beyond the floor" in error["message"]


@pytest.mark.parametrize(
    "stage, verdict",
    [
        (
            {"name": "localize-bf16", "status": "error", "message": "exit 2: Error: bad knob"},
            "error",
        ),
        (
            {
                "name": "localize-bf16",
                "status": "ok",
                "skipped": True,
                "message": "skipped: the rollout engine http has no capture adapter",
            },
            "skipped",
        ),  # fmt: skip
    ],
)
def test_a_localize_stage_that_failed_or_was_skipped_keeps_the_pair_judged(
    stage, verdict, tmp_path
):
    run = localized_run(tmp_path, None, stage=stage)
    url = f"sqlite:///{tmp_path / 'h.db'}"
    assert run_lpx("record", run, "--db", url).exit_code == 0
    comparison, rows, recorded = stored(url)
    assert recorded.status == "fail" and recorded.errors == []  # not an error run
    assert comparison.localize_verdict == verdict and rows == []
    assert comparison.localize == {"message": stage["message"]}


def test_upgrade_from_0004_adds_the_table_and_keeps_the_comparisons(history_url, tmp_path):
    from alembic import command
    from sqlalchemy import inspect

    from pipeline.history.database import _alembic_config, _create_engine

    run = localized_run(tmp_path, None)
    assert run_lpx("record", run, "--db", history_url).exit_code == 0
    metrics = count(history_url, MetricValue)
    assert metrics == 20
    engine = _create_engine(history_url)
    with engine.begin() as connection:
        command.downgrade(_alembic_config(connection), "0004")
        assert "localize_boundaries" not in inspect(connection).get_table_names()
    engine.dispose()
    history = open_history(history_url)
    assert schema_revision(history) == "0010"
    history.dispose()
    comparison, rows, _ = stored(history_url)
    assert comparison.verdict == "fail" and comparison.localize_verdict is None and rows == []
    # neither direction rebuilds `comparisons` (on SQLite that cascades to its metric values)
    assert count(history_url, MetricValue) == metrics


def test_record_overhead_of_a_localized_pair_is_small(tmp_path, localize_result):
    """Recording 20 runs whose pair carries a localize.json costs at most a few ms a pair
    more than without one (17 boundary rows each on the tiny model)."""
    plain = [localized_run(tmp_path / "plain", None, day=d) for d in range(20)]
    localized = [localized_run(tmp_path / "loc", localize_result, day=d) for d in range(20)]

    def timed(runs, name):
        start = time.perf_counter()
        assert run_lpx("record", *runs, "--db", tmp_path / f"{name}.db").exit_code == 0
        return time.perf_counter() - start

    timed(plain[:1], "warm")
    extra = (timed(localized, "loc") - timed(plain, "plain")) / len(plain)
    assert count(f"sqlite:///{tmp_path / 'loc.db'}", LocalizeBoundary) == 20 * 17
    assert extra < 0.05, f"{extra * 1e3:.1f} ms a pair"
