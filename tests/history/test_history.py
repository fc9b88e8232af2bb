"""The run history on SQLite and on a real PostgreSQL 16: record, detect, attribute,
acknowledge, annotate, gate, migrate, and refuse bad input without writing anything."""

import json
import os
import subprocess
import sys
from datetime import datetime, timedelta

import pytest
from pipeline.db.models import Alert, Comparison, MetricValue, Run, Series
from sqlalchemy import create_engine, func, select, text

from pipeline.history import queries
from pipeline.history.attribution import summary
from pipeline.history.collect import collect_run
from pipeline.history.database import (
    _create_engine,
    _upgrade,
    head_revision,
    open_history,
    schema_revision,
)
from pipeline.history.record import record_runs
from support.helpers import count, run_lpx
from support.synthetic_runs import BASE_METRICS, nightly_history, pair_report, write_run

START = datetime(2026, 1, 1, 3, 0)


def record(url, *dirs):
    history = open_history(url)
    try:
        return record_runs(history, [collect_run(d) for d in dirs])
    finally:
        history.dispose()


def statuses_of(url, metric):
    """One metric's point statuses, oldest first."""
    history = open_history(url)
    try:
        with history.read() as session:
            return session.scalars(
                select(MetricValue.status)
                .where(MetricValue.name == metric)
                .order_by(MetricValue.started_at)
            ).all()
    finally:
        history.dispose()


def alerts(url, statuses=("active",)):
    history = open_history(url)
    try:
        with history.read() as session:
            return queries.alerts(session, statuses)
    finally:
        history.dispose()


def test_a_fresh_database_is_migrated_to_head_on_first_use(history_url):
    history = open_history(history_url)
    assert schema_revision(history) == head_revision() == "0010"
    history.dispose()
    assert count(history_url, Run) == 0


def test_record_is_idempotent_and_keeps_every_number(history_url, tmp_path):
    runs = nightly_history(tmp_path, 3)
    first = record(history_url, *runs)
    assert [r.new for r in first] == [True, True, True]
    again = record(history_url, *runs)
    assert [r.new for r in again] == [False, False, False]
    assert [r.run_id for r in again] == [r.run_id for r in first]
    assert count(history_url, Run) == 3 and count(history_url, Comparison) == 3
    assert count(history_url, Series) == 1  # one series spans the three nights
    report = json.loads((runs[1] / "vllm-hf-bf16" / "report.json").read_text())
    history = open_history(history_url)
    with history.read() as session:
        stored = session.scalar(
            select(MetricValue.value)
            .join(Comparison, Comparison.id == MetricValue.comparison_id)
            .where(Comparison.run_id == first[1].run_id, MetricValue.name == "k3")
        )
    history.dispose()
    assert stored == report["metrics"]["k3"]  # exact, not rounded
    assert count(history_url, MetricValue, MetricValue.name == "max_abs_diff") == 3


def test_step_regression_is_attributed_to_the_engine_upgrade(history_url, tmp_path):
    """vLLM 0.31 -> 0.32 at night 12 and the drift triples from then on."""
    runs = nightly_history(tmp_path, 16, step_at=12, upgrade_at=12)
    record(history_url, *runs)
    found = [a for a in alerts(history_url) if a["metric"] == "mean_abs_diff"]
    assert len(found) == 1
    alert = found[0]
    assert alert["kind"] == "regression"
    assert alert["first_bad"]["run"] == 12 + 1 and alert["last_good"]["run"] == 11 + 1
    assert alert["value_after"] / alert["value_before"] == pytest.approx(3.0, rel=0.15)
    assert alert["attribution"][0] == {
        "side": "rollout",
        "engine": "vllm",
        "field": "version",
        "before": "0.31.0, torch 2.13.0+cpu",  # an engine's build names the torch under it
        "after": "0.32.0, torch 2.13.0+cpu",
    }
    assert summary(alert["attribution"]) == (
        "rollout vllm: vllm 0.31.0 -> 0.32.0 (torch 2.13.0+cpu)"
    )
    # every later night keeps the series in regression against the old baseline
    statuses = statuses_of(history_url, "mean_abs_diff")
    assert statuses[:5] == ["insufficient_data"] * 5
    assert set(statuses[5:12]) == {"ok"}
    assert statuses[12:] == ["suspicious", "regression", "regression", "regression"]
    assert run_lpx("gate", "--db", history_url).exit_code == 1


def test_noise_and_an_upgrade_without_drift_raise_nothing(history_url, tmp_path):
    record(history_url, *nightly_history(tmp_path, 30, upgrade_at=15, noise=0.08, seed=3))
    assert alerts(history_url) == []
    assert run_lpx("gate", "--db", history_url, "--fail-on", "suspicious").exit_code == 0


def test_one_spike_is_suspicious_then_resolves(history_url, tmp_path):
    runs = nightly_history(tmp_path, 10)
    spike = pair_report(metrics={"mean_abs_diff": 0.05})
    runs.append(
        write_run(
            tmp_path / "spike", {"vllm-hf-bf16": spike}, started_at=START + timedelta(days=10)
        )
    )
    record(history_url, *runs)
    active = [a for a in alerts(history_url) if a["metric"] == "mean_abs_diff"]
    assert [a["kind"] for a in active] == ["suspicious"]
    gate = run_lpx("gate", "--db", history_url, "--fail-on", "suspicious")
    assert gate.exit_code == 1 and "suspicious" in gate.output
    assert run_lpx("gate", "--db", history_url, "--fail-on", "regression").exit_code == 0
    calm = write_run(
        tmp_path / "calm", {"vllm-hf-bf16": pair_report()}, started_at=START + timedelta(days=11)
    )
    record(history_url, calm)
    assert [a for a in alerts(history_url) if a["metric"] == "mean_abs_diff"] == []
    resolved = [a for a in alerts(history_url, ("resolved",)) if a["metric"] == "mean_abs_diff"]
    assert [a["kind"] for a in resolved] == ["suspicious"]


def test_an_acknowledged_alert_stays_quiet_and_resets_the_baseline(history_url, tmp_path):
    record(history_url, *nightly_history(tmp_path, 14, step_at=10, upgrade_at=10))
    alert = next(a for a in alerts(history_url) if a["metric"] == "mean_abs_diff")
    result = run_lpx(
        "ack", str(alert["id"]), "--note", "new vLLM bf16 path, accepted", "--db", history_url
    )
    assert result.exit_code == 0, result.output
    assert "acknowledged" in result.output
    # one event, one acknowledgement: the other metrics that stepped at the same run too
    assert alerts(history_url) == []
    # the new level is the baseline now: later nights at that level raise nothing
    later = nightly_history(
        tmp_path / "later", 12, start=START + timedelta(days=14), step_at=0, upgrade_at=0, seed=9
    )
    record(history_url, *later)
    assert [a for a in alerts(history_url) if a["metric"] == "mean_abs_diff"] == []
    acked = [a for a in alerts(history_url, ("acknowledged",)) if a["id"] == alert["id"]]
    assert acked[0]["note"] == "new vLLM bf16 path, accepted"
    assert run_lpx("gate", "--db", history_url).exit_code == 0


def test_annotations_exclude_a_point_or_start_a_new_distribution(history_url, tmp_path):
    runs = nightly_history(tmp_path, 12)
    bad = pair_report(metrics={"mean_abs_diff": 0.2})
    runs.append(
        write_run(tmp_path / "bad", {"vllm-hf-bf16": bad}, started_at=START + timedelta(days=12))
    )
    record(history_url, *runs)
    assert [a["kind"] for a in alerts(history_url) if a["metric"] == "mean_abs_diff"] == [
        "suspicious"
    ]
    result = run_lpx(
        "annotate", "1", "--exclude", "13", "--reason", "broken runner", "--db", history_url
    )
    assert result.exit_code == 0, result.output
    assert alerts(history_url) == []
    assert count(history_url, MetricValue, MetricValue.status == "excluded") == len(BASE_METRICS)
    result = run_lpx(
        "annotate", "1", "--change", "5", "--reason", "new kernel", "--db", history_url
    )
    assert result.exit_code == 0
    statuses = statuses_of(history_url, "max_abs_diff")
    assert statuses[4:9] == ["insufficient_data"] * 5  # a new baseline from run 5 on
    bad_run = run_lpx("annotate", "1", "--change", "999", "--reason", "x", "--db", history_url)
    assert bad_run.exit_code == 2 and "no run '999'" in bad_run.output


def test_an_error_run_is_recorded_never_a_regression_and_fails_the_gate_with_2(
    history_url, tmp_path
):
    runs = nightly_history(tmp_path, 10)
    broken = pair_report(metrics={"mean_abs_diff": 5.0, "max_abs_diff": 9.0}, verdict="fail")
    runs.append(
        write_run(
            tmp_path / "broken",
            {"vllm-hf-bf16": broken},
            started_at=START + timedelta(days=10),
            stage_errors=["megatron replay: NCCL timeout after 600 s"],
        )
    )
    results = record(history_url, *runs)
    assert results[-1].status == "error" and results[-1].comparisons == 1  # what finished is kept
    assert alerts(history_url) == []
    assert count(history_url, MetricValue, MetricValue.status == "error_run") == len(BASE_METRICS)
    gate = run_lpx("gate", "--db", history_url)
    assert gate.exit_code == 2 and "NCCL timeout" in gate.output


def test_a_run_whose_compare_never_finished_is_an_error_run(history_url, tmp_path):
    run = tmp_path / "half"
    (run / "compare").mkdir(parents=True)
    (run / "compare" / "summary.md").write_text("# partial")
    (run / "ok").mkdir()
    (run / "ok" / "report.json").write_text(json.dumps(pair_report()))
    (result,) = record(history_url, run)
    assert result.status == "error" and result.comparisons == 1
    runs = queries_runs(history_url)
    assert "compare did not finish" in runs[0]["errors"][0]["message"]


def queries_runs(url):
    history = open_history(url)
    with history.read() as session:
        rows = queries.runs(session)
    history.dispose()
    return rows


def test_record_stores_the_reports_parts_as_written(history_url, tmp_path):
    """The run page shows a side's sampling and the findings as report.json wrote them: not
    in the contract's key order, and without the defaults its validation fills in."""
    finding = {"severity": "fault", "cause": "stale_weights", "evidence": "other weights"}
    report = pair_report(verdict="fail", findings=[finding])
    sampling = {"top_p": 0.9, "temperature": 0.7, "seed": 3}
    report["metadata"]["fixture"]["sampling"] = sampling
    run = write_run(tmp_path / "run", {"vllm-hf": report}, started_at=START)
    record(history_url, run)
    history = open_history(history_url)
    with history.read() as session:
        comparison = session.scalar(select(Comparison))
        manifest = session.scalar(select(Run.manifest))
    history.dispose()
    assert comparison.findings == [finding]
    assert list(comparison.findings[0]) == ["severity", "cause", "evidence"]
    shown = comparison.details["reproduce"]["fixture"]["sampling"]
    assert list(shown.items()) == list(sampling.items())
    assert list(manifest)[:2] == ["lpx_run", "run_id"]


def test_matrix_outputs_record_each_pair_once(history_url, tmp_path):
    run = tmp_path / "matrix"
    for i, (engine, tp) in enumerate((("hf", 1), ("megatron", 2))):
        out = run / f"{i}-{engine}"
        out.mkdir(parents=True)
        (out / "report.json").write_text(json.dumps(pair_report(replay=engine, tp=tp)))
    (run / "report.json").write_text(
        json.dumps({"verdict": "pass", "pairs": [{"pair": "0-hf"}, {"pair": "1-megatron"}]})
    )
    (result,) = record(history_url, run)
    assert result.comparisons == 2
    assert count(history_url, Series) == 2


def test_record_writes_nothing_when_any_run_is_bad(history_url, tmp_path):
    good = nightly_history(tmp_path, 2)
    corrupt = tmp_path / "corrupt" / "compare"
    corrupt.mkdir(parents=True)
    (corrupt / "report.json").write_text('{"verdict": "pass", "metrics": ')
    result = run_lpx("record", *good, corrupt.parent, "--db", history_url)
    assert result.exit_code == 2
    assert "corrupt report" in result.output and str(corrupt / "report.json") in result.output
    assert "Traceback" not in result.output
    assert count(history_url, Run) == 0


def test_a_failure_mid_transaction_rolls_everything_back(history_url, tmp_path, monkeypatch):
    import pipeline.history.record as record_module

    runs = nightly_history(tmp_path, 3)
    calls = {"n": 0}
    real = record_module.comparison_details

    def breaks_on_the_third(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("disk full")
        return real(*args, **kwargs)

    monkeypatch.setattr(record_module, "comparison_details", breaks_on_the_third)
    with pytest.raises(RuntimeError):
        record(history_url, *runs)
    assert count(history_url, Run) == 0 and count(history_url, Series) == 0


def test_bad_input_is_one_line_and_exit_2(history_url, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    result = run_lpx("record", empty, "--db", history_url)
    assert result.exit_code == 2 and "no compare outputs" in result.output
    missing = run_lpx("record", tmp_path / "nope", "--db", history_url)
    assert missing.exit_code == 2 and "no such run directory" in missing.output
    wrong_shape = tmp_path / "shape" / "c"
    wrong_shape.mkdir(parents=True)
    (wrong_shape / "report.json").write_text(json.dumps({"verdict": "maybe"}))
    shaped = run_lpx("record", wrong_shape.parent, "--db", history_url)
    assert shaped.exit_code == 2 and "not an lpx compare report" in shaped.output
    assert count(history_url, Run) == 0


def test_unreachable_database_is_one_line_exit_2(tmp_path):
    (tmp_path / "a-file").write_text("not a directory")
    (tmp_path / "garbage.db").write_bytes(b"\x00not sqlite" * 200)
    for url in (
        "postgresql+psycopg://lpx@127.0.0.1:1/lpx",
        "mysql+nosuchdriver://x/y",
        "not a url://",
        str(tmp_path / "a-file" / "h.db"),
        str(tmp_path / "garbage.db"),
    ):
        result = subprocess.run(
            [sys.executable, "-m", "pipeline", "history", "--db", url],
            capture_output=True,
            text=True,
            env={**os.environ, "CI": "true"},
        )
        assert result.returncode == 2, (url, result.stderr)
        assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_a_database_newer_than_this_lpx_is_refused(history_url, tmp_path):
    open_history(history_url).dispose()
    engine = create_engine(history_url)
    with engine.begin() as connection:
        connection.execute(text("UPDATE alembic_version SET version_num = '0099'"))
    engine.dispose()
    result = run_lpx("history", "--db", history_url)
    assert result.exit_code == 2
    assert "revision 0099, newer than this lpx" in result.output and "upgrade lpx" in result.output


def test_upgrade_from_the_previous_revision_keeps_data_and_judges_it(history_url, tmp_path):
    """Points recorded by a 0001 lpx survive the upgrade and get their boundaries."""
    engine = _create_engine(history_url)
    _upgrade(engine, "0001")
    now = datetime(2026, 1, 1)
    with engine.begin() as c:
        c.execute(text("INSERT INTO testbeds (id, key, name, gpu_count) VALUES (1, 't', 'cpu', 0)"))
        c.execute(
            text(
                "INSERT INTO engine_builds (id, key, engine, version, versions) VALUES (1, 'b', 'hf', '5.19', '{}')"
            )
        )
        c.execute(
            text(
                "INSERT INTO cases (id, key, label, model, weights_fingerprint, prompt_set, channel, "
                "rollout_dtype, replay_dtype, knobs, layout) VALUES "
                "(1, 'c', 'tiny', '/m', 'w', 'p', 'rollout', 'float32', 'bfloat16', '{}', '{}')"
            )
        )
        c.execute(
            text(
                "INSERT INTO series (id, key, case_id, rollout_engine, replay_engine, testbed_id, label) "
                "VALUES (1, 's', 1, 'hf', 'hf', 1, 'old series')"
            )
        )
        for i in range(8):
            at = now + timedelta(days=i)
            c.execute(
                text(
                    "INSERT INTO runs (id, key, kind, status, started_at, recorded_at, trigger, command_line, "
                    "lpx_version, lpx_revision, run_dir, errors, manifest) VALUES "
                    "(:i, :k, 'nightly', 'pass', :at, :at, 'schedule', '', '0.0.9', 'old', '/r', '[]', '{}')"
                ),
                {"i": i + 1, "k": f"k{i}", "at": at},
            )
            c.execute(
                text(
                    "INSERT INTO comparisons (id, run_id, series_id, started_at, pair, rollout_build_id, "
                    "replay_build_id, verdict, profile, tau, tokens, sequences, findings, violations, details) "
                    "VALUES (:i, :i, 1, :at, 'c', 1, 1, 'pass', 'bfloat16', 0.1, 64, 2, '[]', '[]', '{}')"
                ),
                {"i": i + 1, "at": at},
            )
            value = 0.004 if i < 7 else 0.05
            c.execute(
                text(
                    "INSERT INTO metric_values (comparison_id, series_id, started_at, name, value, unit, better) "
                    "VALUES (:i, 1, :at, 'mean_abs_diff', :v, 'nats', 'lower')"
                ),
                {"i": i + 1, "at": at, "v": value},
            )
    engine.dispose()
    history = open_history(history_url)
    assert schema_revision(history) == "0010"
    with history.read() as session:
        rows = session.execute(
            select(MetricValue.value, MetricValue.status, MetricValue.upper).order_by(
                MetricValue.id
            )
        ).all()
        assert [r.value for r in rows] == [0.004] * 7 + [0.05]  # data kept
        assert [r.status for r in rows] == ["insufficient_data"] * 5 + ["ok", "ok", "suspicious"]
        # 0.05 is far outside; the band came from the floor tau/20 (MAD of a constant is 0)
        assert rows[-1].upper == pytest.approx(0.004 + 0.005)
        assert session.scalar(select(func.count()).select_from(Alert)) == 1
    history.dispose()


def test_history_command_lists_runs_series_and_alerts_as_text_and_json(history_url, tmp_path):
    record(history_url, *nightly_history(tmp_path, 8, step_at=6, upgrade_at=6))
    runs = run_lpx("history", "runs", "--db", history_url)
    assert runs.exit_code == 0 and "runs (8)" in runs.output
    series = json.loads(run_lpx("history", "series", "--json", "--db", history_url).output)
    assert series[0]["points"] == 8 and series[0]["rollout_engine"] == "vllm"
    points = run_lpx("history", "series", "1", "--db", history_url)
    assert "vllm 0.32.0" in points.output and points.output.count("\n") == 9
    listed = json.loads(run_lpx("history", "alerts", "--json", "--db", history_url).output)
    assert {a["kind"] for a in listed} >= {"regression"}
    assert run_lpx("history", "series", "77", "--db", history_url).exit_code == 2


def test_concurrent_records_lose_nothing_and_store_a_run_once(history_url, tmp_path):
    runs = nightly_history(tmp_path, 6)
    open_history(history_url).dispose()  # migrate first: the race is about the records
    env = {**os.environ, "CI": "true"}

    def spawn(*dirs):
        return subprocess.Popen(
            [sys.executable, "-m", "pipeline", "record", *map(str, dirs), "--db", history_url],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )

    # different runs at once, and the same run from two processes at once
    processes = [spawn(*runs[:3]), spawn(*runs[3:5]), spawn(runs[5]), spawn(runs[5])]
    outputs = [p.communicate(timeout=240) for p in processes]
    assert [p.returncode for p in processes] == [0, 0, 0, 0], outputs
    assert count(history_url, Run) == 6
    assert count(history_url, Comparison) == 6
    assert sum("already recorded" in out for out, _ in outputs) == 1


def test_older_reports_get_their_drift_map_and_context_from_tokens_parquet(tmp_path):
    report = pair_report(sequence_ids=["a", "b", "c"])
    del report["drift_map"]
    for row in report["worst"]:
        del row["context_ids"]
    run = write_run(tmp_path / "old", {"c": report}, started_at=START, tokens=True)
    url = f"sqlite:///{tmp_path / 'h.db'}"
    record(url, run)
    history = open_history(url)
    with history.read() as session:
        details = session.scalar(select(Comparison.details))
    history.dispose()
    assert [row["sequence_id"] for row in details["heatmap"]["rows"]] != []
    assert (
        len(details["heatmap"]["rows"]) == 3 and len(details["heatmap"]["rows"][0]["cells"]) == 32
    )


def test_report_replaces_only_a_directory_it_wrote(tmp_path):
    url = f"sqlite:///{tmp_path / 'h.db'}"
    record(url, *nightly_history(tmp_path / "runs", 2))
    mine = tmp_path / "notes"
    mine.mkdir()
    (mine / "todo.txt").write_text("keep me")
    refused = run_lpx("report", "--db", url, "--out", mine)
    assert refused.exit_code == 2 and "not an lpx report" in refused.output
    assert (mine / "todo.txt").read_text() == "keep me" and len(list(mine.iterdir())) == 1
    site = tmp_path / "site"
    assert run_lpx("report", "--db", url, "--out", site).exit_code == 0
    (site / "stale.html").write_text("from an older report")
    assert run_lpx("report", "--db", url, "--out", site).exit_code == 0  # replaced whole
    assert not (site / "stale.html").exists() and (site / "runs" / "2.html").is_file()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no staging left


def test_upgrade_to_0004_keeps_every_metric_row_and_swaps_the_series_index(history_url, tmp_path):
    """A history at 0003 keeps its points through the upgrade; metric values lose only the
    name-keyed series index and their own series foreign key."""
    from alembic import command
    from sqlalchemy import inspect

    from pipeline.history.database import _alembic_config

    runs = nightly_history(tmp_path, 3)
    record(history_url, *runs)
    engine = _create_engine(history_url)
    with engine.begin() as connection:  # the same rows as a 0003 lpx wrote them
        command.downgrade(_alembic_config(connection), "0003")
        before = connection.execute(
            text("SELECT comparison_id, name, value, status FROM metric_values ORDER BY id")
        ).all()
        assert "ix_metric_values_series_name_time" in {
            ix["name"] for ix in inspect(connection).get_indexes("metric_values")
        }
    engine.dispose()
    history = open_history(history_url)
    assert schema_revision(history) == "0010"
    with history.engine.connect() as connection:
        after = connection.execute(
            text("SELECT comparison_id, name, value, status FROM metric_values ORDER BY id")
        ).all()
        inspector = inspect(connection)
        indexes = {ix["name"]: ix["column_names"] for ix in inspector.get_indexes("metric_values")}
        referred = {fk["referred_table"] for fk in inspector.get_foreign_keys("metric_values")}
    history.dispose()
    assert after == before and len(after) == 3 * len(BASE_METRICS)
    assert indexes.get("ix_metric_values_series") == ["series_id"]
    assert "ix_metric_values_series_name_time" not in indexes
    assert referred == {"comparisons"}
    record(history_url, *runs)  # idempotent across the upgrade
    assert count(history_url, MetricValue) == len(after)


def test_a_64_bit_seed_is_stored_whole_and_an_oversized_count_is_refused(history_url, tmp_path):
    """PostgreSQL's binary COPY wraps an integer too large for its column without a word:
    seeds are 64-bit columns, and a token count beyond INTEGER is refused, naming its report."""
    seeded = pair_report()
    seeded["metadata"]["fixture"]["sampling"]["seed"] = 2**40 + 7
    run = write_run(tmp_path / "seeded", {"c": seeded}, started_at=START)
    assert run_lpx("record", run, "--db", history_url).exit_code == 0
    history = open_history(history_url)
    with history.read() as session:
        assert session.scalar(select(Comparison.seed)) == 2**40 + 7
    history.dispose()
    huge = pair_report()
    huge["metrics"]["tokens"] = 2**40
    broken = write_run(tmp_path / "huge", {"c": huge}, started_at=START + timedelta(days=1))
    result = run_lpx("record", broken, "--db", history_url)
    assert result.exit_code == 2 and "metrics.tokens" in result.output
    assert str(broken / "c" / "report.json") in result.output
    assert count(history_url, Run) == 1


@pytest.mark.parametrize("named", [False, True])
def test_a_comparison_the_manifest_names_keeps_its_series_when_a_knob_reads_back_otherwise(
    history_url, tmp_path, named
):
    """lpx-run.json's `cases` (a plan's names for its comparisons): an engine upgrade that
    reads a replay knob back differently starts a new series, unless the comparison is
    named; then the one series goes on, under its name."""
    nights = []
    for night, eager in enumerate((False, True)):
        report = pair_report()
        report["metadata"]["replay"]["knobs"]["enforce_eager"] = eager
        nights.append(
            write_run(
                tmp_path / f"night{night}",
                {"vllm-hf-bf16": report},
                started_at=START + timedelta(days=night),
                cases={"vllm-hf-bf16": "vllm-vs-hf"} if named else None,
            )
        )
    record(history_url, *nights)
    history = open_history(history_url)
    with history.read() as session:
        labels = session.scalars(select(Series.label)).all()
    history.dispose()
    if named:
        assert labels == ["vllm bfloat16 vs hf bfloat16 · vllm-vs-hf · 8x H100"]
    else:
        assert labels == ["vllm bfloat16 vs hf bfloat16 · tiny · 8x H100"] * 2
