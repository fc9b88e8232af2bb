"""Issue 22's contract on the history commands and the inputs around them: reports are inputs
too (types, ranges, contradictions), other people's text never reaches the terminal raw, an
error run says so on stderr, and a rerun never leaves an earlier verdict standing."""

from __future__ import annotations

import json
import math
from datetime import datetime
from pathlib import Path

import pytest
from click.testing import CliRunner

from pipeline.cli import cli
from pipeline.compare.outputs import report_json
from pipeline.contracts.report import Report, contradictions
from support.synthetic_runs import nightly_history, pair_report, write_run

START = datetime(2026, 3, 1, 3, 0)


def lpx(*args):
    """The CLI in-process with stdout and stderr apart (the contract puts errors on stderr)."""
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)


def one_error_line(result) -> str:
    assert result.exit_code == 2, result.output
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, result.stderr
    assert "Traceback" not in result.output and "engine or library failed" not in result.output
    return errors[0]


def a_run(root: Path, edit=None, name="night") -> Path:
    report = pair_report()
    if edit:
        edit(report)
    return write_run(root / name, {"compare": report}, started_at=START)


def runs_in(db: Path) -> list[dict]:
    result = lpx("history", "runs", "--json", "--db", db)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


# -- reports are inputs too ----------------------------------------------------------------


def _set(path: str, value):
    def edit(report):
        *parents, leaf = path.split(".")
        node = report
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        node[leaf] = value

    return edit


WRONG_TYPES = {
    "metrics.max_abs_diff": "0.1",  # a number written as a string would go unjudged
    "metrics.tokens": 2**70,  # past int64: overflowed SQLite's INTEGER
    "metrics.k3": -0.5,  # a squared quantity below zero
    "metrics.k2": [],  # a known metric as a list went unjudged (found by the long fuzz)
    "metrics.ess": 1.5,  # a fraction past 1
    "metrics.token_mult_prob_error": 0.5,  # a mean of exp(|d|) is never below 1
    "metrics.some_future_metric": "fast",  # a metric lpx does not know still has to be a number
    "verdict": "PASS",
    "policy.limits.max_abs_diff": "1",
    "policy.violations": "none",
    "metadata.replay.engine": "vllm",  # keys.py reads engine.name: a string crashed it
    "metadata.fixture.sampling.seed": 2**64 + 1,
    "metadata.replay.engine.versions.torch": [],  # reached SQLite as a list (long fuzz)
    "sequences": {"0-0": {}},
}


@pytest.mark.parametrize("field", sorted(WRONG_TYPES), ids=str)
def test_record_refuses_a_report_field_of_the_wrong_type_or_range(tmp_path, field):
    run = a_run(tmp_path, _set(field, WRONG_TYPES[field]))
    db = tmp_path / "h.db"
    error = one_error_line(lpx("record", run, "--db", db))
    assert str(run / "compare" / "report.json") in error and f"`{field}" in error, error
    assert "nothing was recorded" in error
    assert not db.exists() or runs_in(db) == []


def test_a_token_id_past_int32_in_the_worst_tokens_is_refused(tmp_path):
    def edit(report):
        report["worst"] = [{"sequence_id": "0-0", "position": 3, "token_id": 2**70}]

    run = a_run(tmp_path, edit)
    error = one_error_line(lpx("record", run, "--db", tmp_path / "h.db"))
    assert "`worst[0].token_id`: Input should be a valid integer (got 1.18" in error


def test_a_manifest_of_the_wrong_shape_is_refused(tmp_path):
    run = a_run(tmp_path)
    manifest = json.loads((run / "lpx-run.json").read_text())
    manifest["testbed"]["gpu_count"] = "eight"
    manifest["stages"][0]["name"] = ["compare"]
    (run / "lpx-run.json").write_text(json.dumps(manifest))
    error = one_error_line(lpx("record", run, "--db", tmp_path / "h.db"))
    assert "lpx-run.json" in error and "`stages[0].name`" in error
    assert "`testbed.gpu_count`" in error


def test_unknown_future_fields_are_kept_and_recorded(tmp_path):
    def edit(report):
        report["a_section_from_lpx_2"] = {"anything": [1, "x"]}
        report["metrics"]["frac_over_2tau"] = 0.25
        report["metadata"]["replay"]["engine"]["build_flags"] = ["-O3"]

    db = tmp_path / "h.db"
    assert lpx("record", a_run(tmp_path, edit), "--db", db).exit_code == 0
    series = json.loads(lpx("history", "series", "1", "--json", "--db", db).stdout)
    assert series[-1]["metrics"]["frac_over_2tau"]["value"] == 0.25


@pytest.mark.parametrize(
    "edit, named",
    [
        (_set("metrics.max_abs_diff", "nan"), "metrics.max_abs_diff is nan"),
        (_set("metrics.mean_abs_diff", "inf"), "metrics.mean_abs_diff is inf"),
        (_set("metrics.k3", 0.5), "metrics.k3 = 0.5 is over its limit"),
        (
            _set("policy.violations", [{"metric": "k3", "value": 0.5, "limit": 0.001}]),
            "policy.violations lists 1",
        ),
        (_set("policy.verdict", "fail"), "policy.verdict is fail"),
    ],
    ids=["nan-max", "inf-mean", "over-limit", "violations", "policy-fail"],
)
def test_a_pass_that_contradicts_itself_is_an_error_run_and_fails_the_gate(tmp_path, edit, named):
    def with_limits(report):
        report["policy"]["limits"] = {"max_abs_diff": 1.0, "k3": 0.001}
        edit(report)

    db = tmp_path / "h.db"
    result = lpx("record", a_run(tmp_path, with_limits), "--db", db)
    assert result.exit_code == 0 and "(error, 1 comparisons)" in result.stdout, result.output
    [run] = runs_in(db)
    assert run["status"] == "error" and named in run["errors"][0]["message"]
    gate = lpx("gate", "--db", db)
    error = one_error_line(gate)
    assert "is an error run" in error and named in error
    assert "gate: ERROR" in gate.stdout and "PASS" not in gate.stdout


def test_what_compare_writes_is_valid_and_consistent(run_dir, tmp_path):
    """The schema describes compare's own reports: every real one passes it, bf16 and fp32."""
    for dtype in ("float32", "bfloat16"):
        out = tmp_path / dtype
        lpx("compare", run_dir / "fixture.parquet", run_dir / f"replay-{dtype}.parquet",
            "--out", out, "--quiet")  # fmt: skip
        text = (out / "report.json").read_text()
        report = Report.model_validate_json(text)  # raises, naming the field, if not
        assert contradictions(report) == []
        # read and written by one model: the round trip gives the same JSON back
        assert json.loads(report_json(report)) == json.loads(text)


def test_every_synthetic_nightly_report_is_valid(tmp_path):
    """The year bench and the history tests record these: the schema must not refuse them."""
    for run in nightly_history(tmp_path, 3, step_at=1):
        for path in run.rglob("report.json"):
            Report.model_validate_json(path.read_text())  # raises, naming the field, if not


# -- other people's text in the terminal ---------------------------------------------------

OSC_TITLE = "\x1b]0;owned\x07"


def test_notes_and_reasons_never_reach_the_terminal_raw(tmp_path):
    db = tmp_path / "h.db"
    runs = nightly_history(tmp_path, 14, step_at=10, upgrade_at=10)
    assert lpx("record", *runs, "--db", db).exit_code == 0
    alerts = json.loads(lpx("history", "alerts", "--json", "--db", db).stdout)
    acked = lpx("ack", alerts[0]["id"], "--note", f"bell\x07 {OSC_TITLE}", "--db", db)
    noted = lpx("annotate", "1", "--exclude", "3", "--reason", f"why{OSC_TITLE}", "--db", db)
    assert acked.exit_code == 0 and noted.exit_code == 0, acked.output + noted.output
    shown = "".join(
        lpx("history", *view, "--all" if view == ("alerts",) else "--limit=30", "--db", db).output
        for view in (("runs",), ("series",), ("series", "1"), ("alerts",))
    )
    for output in (acked.output, noted.output, shown):
        assert "\x1b" not in output and "\x07" not in output
    assert "bell\\x07 \\x1b]0;owned\\x07" in acked.output + shown


# -- gate, rollout, compare, weights --------------------------------------------------------


def test_a_gate_on_an_error_run_says_why_on_stderr(tmp_path):
    db = tmp_path / "h.db"
    run = write_run(
        tmp_path / "n", {"compare": pair_report()}, started_at=START, stage_errors=["OOM"]
    )
    assert lpx("record", run, "--db", db).exit_code == 0
    error = one_error_line(lpx("gate", "--db", db))
    assert "replay-0: OOM" in error and "--resume" in error


def test_a_prompt_id_outside_the_vocabulary_names_its_line(tmp_path, tiny_model):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt_ids": [1, 2]}\n{"prompt_ids": [1, 99999]}\n')
    out = tmp_path / "f.parquet"
    result = lpx("rollout", "--model", tiny_model, "--prompts", prompts, "--out", out)
    error = one_error_line(result)
    assert f"{prompts} line 2" in error and "99999" in error and "[0, 512)" in error
    assert not out.exists()


def test_a_failed_compare_rerun_leaves_no_earlier_pass_behind(run_dir, tmp_path):
    out = tmp_path / "cmp"
    fixture, replay = run_dir / "fixture.parquet", run_dir / "replay-float32.parquet"
    assert lpx("compare", fixture, replay, "--out", out, "--quiet").exit_code == 0
    assert (out / "report.json").exists()
    one_error_line(lpx("compare", fixture, tmp_path / "missing.parquet", "--out", out))
    assert not (out / "report.json").exists() and not (out / "summary.md").exists()
    recorded = lpx("record", out, "--db", tmp_path / "h.db")
    assert "(error, 0 comparisons)" in recorded.stdout, recorded.output


def test_a_damaged_version_is_named_in_json_listings_too(tmp_path, tiny_model):
    store = tmp_path / "store"
    for _ in range(3):
        assert lpx("weights", "publish", tiny_model, "--to", store).exit_code == 0
    manifest = store / "versions" / "2" / "manifest.json"
    manifest.write_text(manifest.read_text()[:40])
    result = lpx("weights", "ls", store, "--json")
    assert result.exit_code == 0
    assert [v["name"] for v in json.loads(result.stdout)] == ["1", "3"]
    assert "warning: versions/2 is not listed" in result.stderr


def test_a_contradiction_needs_a_number_to_contradict():
    """No limit, no metric: nothing to contradict (compare lists it as not measured)."""
    report = pair_report()
    report["policy"]["limits"] = {"topk_kl_forward_mean": 0.1}
    assert contradictions(Report.model_validate(report)) == []
    report["metrics"]["topk_kl_forward_mean"] = math.inf
    assert contradictions(Report.model_validate(report)) == [
        "metrics.topk_kl_forward_mean = inf is over its limit 0.1"
    ]


@pytest.mark.parametrize("command", [["gate"], ["history", "runs"], ["record", "RUN"]])
def test_a_db_path_that_is_a_fifo_is_refused_not_waited_on(tmp_path, command):
    """Found by the fuzz: opening a FIFO to read its header blocked `lpx gate` forever."""
    import os

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    argv = [a.replace("RUN", str(a_run(tmp_path))) for a in command]
    error = one_error_line(lpx(*argv, "--db", fifo))
    assert f"{fifo} is not a regular file" in error


def test_notes_and_reasons_are_inert_in_the_report_site(tmp_path):
    db, site = tmp_path / "h.db", tmp_path / "site"
    assert lpx("record", *nightly_history(tmp_path, 14, step_at=10), "--db", db).exit_code == 0
    note = "<script>alert(1)</script> **bold** | `code`"
    assert lpx("ack", "1", "--note", note, "--db", db).exit_code == 0
    reason = "<img src=x onerror=alert(2)>"
    assert lpx("annotate", "1", "--exclude", "3", "--reason", reason, "--db", db).exit_code == 0
    assert lpx("report", "--db", db, "--out", site).exit_code == 0
    pages = {p: p.read_text() for p in site.rglob("*.html")}
    for page, html in pages.items():
        assert "<script>alert(1)" not in html and "<img src=x" not in html, page
    shown = "".join(pages.values())
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in shown
    assert "&lt;img src=x onerror=alert(2)&gt;" in shown


def test_every_metric_a_stage_names_is_in_the_one_list():
    """Policy, summary, matrix, per-version rows, the history's detection and compare's own
    batch metrics all name metrics from pipeline/contracts/metrics.py: a name added in one
    place and not the list would go unchecked on record."""
    import numpy as np

    from pipeline.compare.metrics import batch_metrics
    from pipeline.contracts import metrics as contract
    from pipeline.history.detection import CATALOG, KEY_METRICS

    named = {
        *contract.LIMITED_METRICS,
        *contract.SUMMARY_METRICS,
        *contract.PER_VERSION_METRICS,
        *contract.MATRIX_METRICS,
        *contract.VERDICT_METRICS,
        *CATALOG,
        *KEY_METRICS,
        *batch_metrics(np.zeros(4, np.float32), np.full(4, -0.1, np.float32), 0.5),
    }
    assert named - set(contract.METRIC_NAMES) == set()
    assert len(contract.METRIC_NAMES) == len(contract.METRICS)  # each name once


def test_a_finding_keeps_a_cause_a_newer_lpx_names_and_the_fields_it_adds():
    """Unknown future values and fields are kept on read and written back as they were."""
    report = pair_report()
    report["diagnosis"] = [
        {"cause": "kv_cache_reuse", "sequences": ["0-0"], "evidence": "x", "new_field": [1]}
    ]
    report["lpx_3_section"] = {"a": 1}
    checked = Report.model_validate(report)
    (finding,) = checked.diagnosis
    assert finding.cause == "kv_cache_reuse" and finding.model_extra == {"new_field": [1]}
    assert checked.diagnosis[0].status == "plausible"
    written = json.loads(report_json(checked))
    assert written["lpx_3_section"] == {"a": 1}
    assert written["diagnosis"][0]["new_field"] == [1]
    assert written["metadata"] == json.loads(json.dumps(report["metadata"]))


# -- bisect.json and the manifest's stages -------------------------------------------------


def a_bisect(directory: Path, finished: bool = True):
    """A bisect.json as `lpx bisect` builds it: a pip bisect with an answer, or one still
    running (no result, no finished_at)."""
    from pipeline.contracts import bisect as contract

    runs = [
        contract.ProbeRun(
            build=f"pip:transformers==5.{19 + index}.0", index=index, attempt=0,
            outcome=outcome, seconds=12.34, metrics={"mean_abs_diff": 1e-7, "tokens": 96},
            message="", run_dir=f"probes/{index}/0",
            environment={"installed": {"transformers": f"5.{19 + index}.0"}},
        )
        for index, outcome in enumerate(["good", "bad"])
    ]  # fmt: skip
    state = contract.BisectState(
        lpx_bisect=contract.FORMAT, bisect_id="ab" * 16,
        plan=contract.PlanOfBisect(name="nightly", path=str(directory / "plan.yaml")),
        pair="hf-fp32", side="replay", runner="local",
        good="pip:transformers==5.19.0", bad="5.20.0+gemma",
        options=contract.SearchOptions(runs=1, reconfirm=0, retries=1),
        judged_by=["policy"],
        builds=[
            contract.BuildOfBisect(
                name="pip:transformers==5.19.0", kind="pip",
                requirements=["transformers==5.19.0"],
            ),
            contract.BuildOfBisect(
                name="5.20.0+gemma", kind="pip", requirements=["transformers==5.20.0"],
                patch=str(directory / "gemma.patch"),
            ),
        ],
        started_at="2026-03-01T03:00:00+00:00", runs=runs, result=None,
    )  # fmt: skip
    if finished:
        state.result = contract.BisectResult(
            first_bad="5.20.0+gemma", last_good="pip:transformers==5.19.0",
            maybe_first_bad=[], stopped=None,
            probes=[
                contract.ProbedBuild(build=run.build, verdict=run.outcome, runs=[run.outcome])
                for run in runs
            ],
            builds_probed=2, runs=2, flaky=[], errors=[],
            changed=contract.Changed(
                from_="pip:transformers==5.19.0", to="5.20.0+gemma",
                packages={"transformers": ["5.19.0", "5.20.0"]},
                patch=[None, str(directory / "gemma.patch")],
            ),
        )  # fmt: skip
        state.finished_at = "2026-03-01T03:10:00+00:00"
    return state


def test_a_bisect_json_reads_back_as_it_was_written(tmp_path):
    """Written by `lpx bisect`'s writer, read by `lpx record` and by --resume: the same
    model back, and the same bytes when written again."""
    from pipeline.bisect.run import _previous, _write
    from pipeline.history.bisects import read_bisect

    out = tmp_path / "bisect"
    out.mkdir()
    state = a_bisect(tmp_path)
    _write(out, state)
    text = (out / "bisect.json").read_text()
    assert read_bisect(out).state == state
    assert _previous(out, resume=True) == state
    _write(out, _previous(out, resume=True))
    assert (out / "bisect.json").read_text() == text
    written = json.loads(text)
    assert written["result"]["changed"]["from"] == "pip:transformers==5.19.0"
    assert written["result"]["stopped"] is None  # a null the writer set is kept
    assert "image" not in written["builds"][0]  # a field it never set stays out
    running = a_bisect(tmp_path, finished=False)
    _write(out, running)
    written = json.loads((out / "bisect.json").read_text())
    assert written["result"] is None and "finished_at" not in written
    assert _previous(out, resume=True) == running


@pytest.mark.parametrize(
    "path, value, named",
    [
        ("runs.0.outcome", "maybe", "`runs[0].outcome`"),
        ("result.runs", "2", "`result.runs`"),
        ("result.changed.packages.transformers", ["5.19.0"], "`result.changed.packages"),
        ("side", "left", "`side`"),
    ],
    ids=["outcome", "count-as-string", "half-a-change", "side"],
)
def test_a_malformed_bisect_json_is_refused_naming_the_file_and_field(tmp_path, path, value, named):
    from pipeline.bisect.run import _write

    out = tmp_path / "bisect"
    out.mkdir()
    _write(out, a_bisect(tmp_path))
    state = json.loads((out / "bisect.json").read_text())
    *parents, leaf = path.split(".")
    node = state
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node[key]
    node[leaf] = value
    (out / "bisect.json").write_text(json.dumps(state))
    error = one_error_line(lpx("record", out, "--db", tmp_path / "h.db"))
    assert str(out / "bisect.json") in error and named in error
    assert "not a bisect.json as lpx writes it" in error
    assert not (tmp_path / "h.db").exists() or runs_in(tmp_path / "h.db") == []


def test_the_contracts_name_the_values_their_writers_write():
    """bisect.json's outcomes, verdicts and build kinds and lpx-run.json's stage statuses are
    listed in the contracts and where they are made: the two lists must agree."""
    from pipeline.bisect import builds, search
    from pipeline.contracts import bisect, manifest
    from pipeline.run_manifest import STAGE_STATUSES

    assert set(bisect.OUTCOMES) == {search.GOOD, search.BAD, search.ERROR}
    assert set(bisect.VERDICTS) == {search.GOOD, search.BAD, search.ERROR, search.FLAKY}
    assert bisect.KINDS == builds.KINDS
    assert manifest.STAGE_STATUSES == STAGE_STATUSES


def test_a_stage_has_a_status_from_the_list():
    from pydantic import ValidationError

    from pipeline.contracts.manifest import RunManifest

    stage = {"name": "compare", "status": "ok", "message": ""}
    assert RunManifest.model_validate({"run_id": "r", "stages": [stage]}).stages == [stage]
    for wrong in ({"name": "compare"}, {**stage, "status": "passed"}):
        with pytest.raises(ValidationError, match="stages.0.status"):
            RunManifest.model_validate({"run_id": "r", "stages": [wrong]})


def test_a_calibration_json_reads_back_as_it_was_written(tmp_path):
    """Written by `lpx calibrate`'s writer (the model dumped), read back by compare's reader:
    the same model back, and the same bytes as the writer's dict gave before it was a model
    (field order, whole position edges, unknown fields after the known, no default added)."""
    from pipeline.compare.calibration_file import as_calibration, load_calibration
    from pipeline.contracts.calibration import Calibration, calibration_text
    from support.fuzzing import synthetic_calibration

    written = synthetic_calibration(precisions=("bfloat16", "float16", "float32"))
    written["allowed_mismatches"] = {"model": {"allowed": True}}  # unknown to the model
    del written["timing_s"]  # a default the writer was not given stays out
    calibration = Calibration.model_validate(written)
    path = tmp_path / "calibration.json"
    path.write_text(calibration_text(calibration))
    assert path.read_text() == json.dumps(written, indent=1) + "\n"
    assert load_calibration(path) == calibration
    assert calibration_text(load_calibration(path)) == path.read_text()
    assert as_calibration(json.loads(path.read_text()), path) == calibration
    floor = load_calibration(path).pairs["bfloat16|float32"]
    assert floor.position_edges[:2] == [0, 16] and type(floor.position_edges[1]) is int
    unkeyed = Calibration.model_validate({**written, "key": {}})  # verification's, keyed=False
    assert json.loads(calibration_text(unkeyed))["key"] == {}
