"""Property-based fuzzing of every input lpx reads (issue 8): fixtures and replays, policies,
JSONL dumps and option values. Each example runs the real CLI and checks the contract in
support/fuzzing.py; generated bad input must exit 2, valid input must be judged, and what a
command accepts must be what the next stage accepts. Profiles: see support/fuzzing.py."""

from __future__ import annotations

import copy
import json
import math
import re
import tempfile
from datetime import datetime
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from hypothesis import assume, event, given, settings
from hypothesis import strategies as st

from pipeline.contracts.causes import KNOWN_CAUSES
from pipeline.contracts.metrics import LIMITED_METRICS
from pipeline.fixture.io import read_table, validate_table, write_table
from support.fuzzing import (
    JSON_VALUES,
    PROFILE,
    VOCAB,
    active_count,
    build_pair,
    calibration_files,
    dumps_line,
    finite_number,
    run_under_contract,
    synthetic_calibration,
    token_tables,
)

START = datetime(2026, 3, 1, 3, 0)

# -- compare on generated fixture/replay pairs ---------------------------------------------


def _active_positions(table):
    return np.flatnonzero(table.completion_mask)


def _set_value(table, channel, value, data):
    where = _active_positions(table)
    table.channels[channel][where[data.draw(st.integers(0, len(where) - 1))]] = value


def _rewrite(path: Path, edit) -> None:
    arrow = pq.read_table(path)
    pq.write_table(edit(arrow), path)


def _retype(name, make):
    """Replace list column ``name``'s elements by ``make(flat numpy values)``."""

    def edit(arrow):
        column = arrow.column(name).combine_chunks()
        values = make(column.flatten().to_numpy(zero_copy_only=False))
        lists = pa.ListArray.from_arrays(column.offsets, values)
        return arrow.set_column(arrow.schema.get_field_index(name), name, lists)

    return edit


def _edit_header(change):
    def edit(arrow):
        header = json.loads(arrow.schema.metadata[b"lpx"])
        change(header)
        return arrow.replace_schema_metadata({b"lpx": json.dumps(header)})

    return edit


# Each defect: (applies to a table before writing | edits the written file, needs).
# "needs" says what the table must have for the defect to exist at all.
TABLE_DEFECTS = {
    "nan": ("active", lambda t, c, d: _set_value(t, c, np.nan, d)),
    "minus_inf": ("active", lambda t, c, d: _set_value(t, c, -np.inf, d)),
    "plus_inf": ("active", lambda t, c, d: _set_value(t, c, np.inf, d)),
    "positive": ("active", lambda t, c, d: _set_value(t, c, 0.5, d)),
    "token_outside_vocab": ("any", lambda t, c, d: t.prompt_ids.__setitem__(0, VOCAB + 3)),
    "empty_prompt": ("any", None),
    "duplicate_id": ("two", lambda t, c, d: t.sequence_ids.__setitem__(1, t.sequence_ids[0])),
}
FILE_DEFECTS = {
    "float_token_ids": _retype("completion_ids", lambda v: pa.array(v.astype(np.float64) + 0.5)),
    "int64_token_ids": _retype("prompt_ids", lambda v: pa.array(v.astype(np.int64) + 2**32)),
    "string_mask": _retype("completion_mask", lambda v: pa.array(["x"] * len(v))),
    "vocab_size_text": _edit_header(lambda h: h["metadata"]["model"].update(vocab_size="32")),
    "metadata_list": _edit_header(lambda h: h.update(metadata=[1])),
    "kind_unknown": _edit_header(lambda h: h.update(kind="rollout")),
    "schema_version_2": _edit_header(lambda h: h.update(schema_version=2)),
    "no_lpx_header": lambda arrow: arrow.replace_schema_metadata({}),
    "missing_column": lambda arrow: arrow.drop_columns(["completion_mask"]),
}
BYTE_DEFECTS = {
    "truncated": lambda data: data[: len(data) // 2],
    "garbage": lambda data: bytes(range(256)) * 3,
    "empty_file": lambda data: b"",
}
DEFECTS = sorted(TABLE_DEFECTS) + sorted(FILE_DEFECTS) + sorted(BYTE_DEFECTS)


def _applicable(defect: str, table) -> bool:
    needs = TABLE_DEFECTS.get(defect, ("any",))[0]
    if needs == "active":
        return bool(table.completion_mask.any())
    if needs == "two":
        return table.num_sequences >= 2
    if defect in ("float_token_ids",):
        return table.num_completion_tokens > 0
    if defect in ("string_mask", "token_outside_vocab", "empty_prompt", "int64_token_ids"):
        return table.num_sequences > 0
    return True


def _damage(table, path: Path, defect: str, channel: str, data) -> None:
    """Write ``table`` to ``path`` with ``defect`` in it."""
    if defect == "empty_prompt":  # the first sequence loses its whole prompt
        first = int(table.prompt_offsets[1])
        table.prompt_ids = table.prompt_ids[first:]
        table.prompt_offsets = np.concatenate([[0], table.prompt_offsets[1:] - first])
    elif defect in TABLE_DEFECTS:
        TABLE_DEFECTS[defect][1](table, channel, data)
    write_table(table, path)
    if defect in FILE_DEFECTS:
        _rewrite(path, FILE_DEFECTS[defect])
    elif defect in BYTE_DEFECTS:
        path.write_bytes(BYTE_DEFECTS[defect](path.read_bytes()))


@given(
    spec=token_tables(),
    drift=st.sampled_from([0.0, 1e-7, 1e-3, 0.3, 5.0]),
    seed=st.integers(0, 2**16),
    defect=st.one_of(st.just("none"), st.sampled_from(DEFECTS)),
    side=st.sampled_from(["fixture", "replay"]),
    data=st.data(),
)
def test_compare_keeps_the_contract_on_generated_pairs(spec, drift, seed, defect, side, data):
    fixture, replay = build_pair(spec, drift, seed)
    target = fixture if side == "fixture" else replay
    assume(_applicable(defect, target))
    event(f"defect: {defect}")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        paths = {"fixture": root / "fixture.parquet", "replay": root / "replay.parquet"}
        for name, table in (("fixture", fixture), ("replay", replay)):
            if name == side and defect != "none":
                channel = "rollout" if name == "fixture" else "replay"
                _damage(table, paths[name], defect, channel, data)
            else:
                write_table(table, paths[name])
        out = root / "cmp"
        bad = defect != "none" or active_count(spec) == 0
        result = run_under_contract(
            root,
            ["compare", paths["fixture"], paths["replay"], "--out", out],
            [out],
            expect="bad" if bad else "good",
        )
        if bad:
            assert not (out / "report.json").exists()
            return
        report = json.loads((out / "report.json").read_text())
        # A pass means every limit held on the measured numbers, never a lost NaN.
        assert (result.exit_code == 0) == (report["verdict"] == "pass")
        assert report["metrics"]["tokens"] == active_count(spec)
        expected_max = float(
            np.max(
                np.abs(replay.channels["replay"] - fixture.channels["rollout"])[
                    fixture.completion_mask
                ]
            )
        )
        assert math.isclose(report["metrics"]["max_abs_diff"], expected_max, abs_tol=1e-6)
        for line in (out / "summary.md").read_text().splitlines():
            # a sequence id never starts a markdown block of its own or an HTML tag
            assert not line.startswith("#") or line.lstrip("# ") in SUMMARY_HEADINGS, line
            assert not re.search(r"(?<!\\)<", line) and "\x1b" not in line, line


SUMMARY_HEADINGS = (
    "lpx compare: PASS",
    "lpx compare: FAIL",
    "Violations",
    "Correction",
    "Diagnosis",
    "Worst tokens",
)


# -- policies ------------------------------------------------------------------------------

GOOD_NUMBERS = st.one_of(st.floats(1e-6, 10.0), st.integers(1, 3))
BAD_NUMBERS = st.one_of(
    st.sampled_from([0, -1, -1e-9, float("nan"), float("inf"), -float("inf"), True, False]),
    st.text(max_size=3),
    st.none(),
    st.lists(st.integers(), max_size=1),
)
BAD_KEYS = st.sampled_from(["limts", "Tau", "fail_on_finding", "profile", "max_abs", "K3", ""])
BAD_CAUSES = st.sampled_from(["stale_weight", "", "*", "Temperature"])


@st.composite
def policies(draw):
    """A well-formed policy, or one with exactly one mistake of the kinds people make: a
    typo'd key, a metric or cause that does not exist, a threshold that is not a finite
    number >= 0 (tau > 0), the wrong version."""
    names = draw(st.lists(st.sampled_from(["bfloat16", "x"]), max_size=2, unique=True))
    if draw(st.integers(0, 5)) > 0:  # the profile the compared float32 files need
        names.insert(0, "float32")
    profiles = {}
    for name in names:
        profile = {"tau": draw(GOOD_NUMBERS)}
        if draw(st.booleans()):
            metrics = st.sampled_from(LIMITED_METRICS)
            profile["limits"] = draw(st.dictionaries(metrics, GOOD_NUMBERS, max_size=3))
        profiles[name] = profile
    policy = {"version": 1, "profiles": profiles}
    if draw(st.booleans()):
        policy["fail_on_findings"] = draw(
            st.lists(st.sampled_from([c.value for c in KNOWN_CAUSES]), max_size=3)
        )
    mistake = draw(st.sampled_from(["none"] * 5 + ["key", "number", "cause", "version"]))
    profile = profiles[draw(st.sampled_from(names))] if names else policy
    if mistake == "key":
        draw(st.sampled_from([policy, profile]))[draw(BAD_KEYS)] = {}
    elif mistake == "number":
        if names and draw(st.booleans()):
            profile["tau"] = draw(BAD_NUMBERS)
        elif names:
            profile.setdefault("limits", {})[draw(st.sampled_from(LIMITED_METRICS))] = draw(
                BAD_NUMBERS
            )
    elif mistake == "cause":
        policy.setdefault("fail_on_findings", []).append(draw(BAD_CAUSES))
    elif mistake == "version":
        policy["version"] = draw(st.sampled_from([2, "1", True, 1.0, None]))
    return policy


def _threshold(value, strictly_positive=False) -> bool:
    return finite_number(value) and (value > 0 if strictly_positive else value >= 0)


def policy_is_valid(policy: dict) -> bool:
    """The documented rules (docs/policy.md), written independently of lpx's schema."""
    if set(policy) - {"version", "profiles", "fail_on_findings"}:
        return False
    if type(policy["version"]) is not int or policy["version"] != 1 or not policy["profiles"]:
        return False
    for profile in policy["profiles"].values():
        if set(profile) - {"tau", "limits"} or not _threshold(profile["tau"], True):
            return False
        for metric, limit in profile.get("limits", {}).items():
            if metric not in LIMITED_METRICS or not _threshold(limit):
                return False
    return all(cause in KNOWN_CAUSES for cause in policy.get("fail_on_findings", []))


@given(policy=policies(), drift=st.sampled_from([0.0, 1e-3, 0.5]), data=st.data())
def test_a_policy_is_applied_exactly_or_refused(policy, drift, data):
    spec = data.draw(token_tables(scored=True))
    spec["metadata"]["dtype"] = "float32"
    fixture, replay = build_pair(spec, drift, 0)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        write_table(fixture, root / "f.parquet")
        write_table(replay, root / "r.parquet")
        (root / "policy.yaml").write_text(yaml.safe_dump(policy))
        out = root / "cmp"
        usable = policy_is_valid(policy) and "float32" in policy["profiles"]
        args = ["compare", root / "f.parquet", root / "r.parquet", "--policy", root / "policy.yaml"]
        result = run_under_contract(
            root, [*args, "--out", out], [out], expect="good" if usable else "bad"
        )
        if not usable:
            return
        report = json.loads((out / "report.json").read_text())
        limits = policy["profiles"]["float32"].get("limits", {})
        measured = {m: limit for m, limit in limits.items() if m in report["metrics"]}
        assert sorted(set(limits) - set(measured)) == sorted(report["policy"]["not_measured"])
        held = all(report["metrics"][m] <= limit for m, limit in measured.items())
        failing = [
            f
            for f in report["diagnosis"]
            if f["cause"] in policy.get("fail_on_findings", []) and f["severity"] == "fault"
        ]
        assert (result.exit_code == 0) == (held and not failing), (limits, report["metrics"])


def test_a_policy_that_is_not_yaml_or_not_utf8_is_refused():
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        spec = {
            "sequence_ids": ["a"],
            "prompts": [[1]],
            "completions": [[2]],
            "masks": [[True]],
            "rollout": [[-1.0]],
            "metadata": {"dtype": "float32"},
        }
        fixture, replay = build_pair(spec, 0.0, 0)
        write_table(fixture, root / "f.parquet")
        write_table(replay, root / "r.parquet")
        for text in (b"\xff\xfe\x00", b"profiles: [", b"- 1\n- 2\n", b""):
            (root / "p.yaml").write_bytes(text)
            args = ["compare", root / "f.parquet", root / "r.parquet", "--policy", root / "p.yaml"]
            run_under_contract(root, [*args, "--out", root / "c"], [root / "c"], expect="bad")


# -- JSONL dumps ---------------------------------------------------------------------------


@st.composite
def dump_records(draw):
    """A valid generic-preset record with a loss mask."""
    prompt = draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=4))
    response = draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=5))
    return {
        "prompt_ids": prompt,
        "response_ids": response,
        "rollout_log_probs": [draw(st.floats(-15.0, 0.0)) for _ in response],
        "loss_mask": [draw(st.sampled_from([1, 1, 0, True])) for _ in response],
    }


@given(
    records=st.lists(dump_records(), min_size=1, max_size=4),
    mutation=st.one_of(
        st.none(),
        st.tuples(
            st.integers(0, 3),
            st.sampled_from(["prompt_ids", "response_ids", "rollout_log_probs", "loss_mask"]),
            JSON_VALUES,
        ),
    ),
    garbage=st.one_of(st.none(), st.sampled_from(["{", "null", "[]", "1e999", '"x"', "\x00"])),
)
def test_ingest_accepts_only_what_compare_accepts(records, mutation, garbage):
    records = copy.deepcopy(records)
    if mutation is not None:
        index, field, value = mutation
        records[index % len(records)][field] = value
    lines = [dumps_line(r) for r in records] + ([garbage] if garbage else [])
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "d.jsonl").write_text("\n".join(lines) + "\n")
        out = root / "f.parquet"
        args = ["ingest", root / "d.jsonl", "--field", "mask=loss_mask", "--out", out]
        result = run_under_contract(
            root, args, [out], expect="bad" if garbage else "any" if mutation else "good"
        )
        if result.exit_code == 0:
            # What ingest wrote, the next stage reads and accepts.
            table = read_table(out, expect_kind="fixture")
            validate_table(table, out)
            assert table.num_sequences == len(records)
        else:
            assert not out.exists()


# -- reports and run manifests (lpx record, then lpx gate) ---------------------------------


def _leaves(value, path=()):
    """Every (path, value) in a JSON document, containers included."""
    yield path, value
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _leaves(item, (*path, key))
    elif isinstance(value, list):
        for index, item in enumerate(value[:3]):
            yield from _leaves(item, (*path, index))


def _replace(document, path, value):
    node = document
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value


def _number(value) -> float | None:
    if finite_number(value):
        return float(value)
    return None


def an_honest_pass(report) -> bool:
    """The oracle, written apart from lpx's schema: a gate may pass a report only when it
    says pass, its mean and max |d| are finite numbers, and every limited metric it measured
    is a finite number within its limit."""
    if not isinstance(report, dict) or report.get("verdict") != "pass":
        return False
    metrics, policy = report.get("metrics"), report.get("policy")
    if not isinstance(metrics, dict) or not isinstance(policy, dict):
        return False
    if any(_number(metrics.get(m)) is None for m in ("max_abs_diff", "mean_abs_diff")):
        return False
    if policy.get("violations") or policy.get("verdict") == "fail":
        return False
    for metric, limit in (policy.get("limits") or {}).items():
        if metric in metrics and not (
            _number(metrics[metric]) is not None
            and _number(limit) is not None
            and metrics[metric] <= limit
        ):
            return False
    return True


@st.composite
def damaged_documents(draw, document: dict):
    """``document`` with one field (anywhere, containers too) replaced by any JSON value,
    or deleted, or left alone."""
    document = copy.deepcopy(document)
    paths = [path for path, _ in _leaves(document) if path]
    action = draw(st.sampled_from(["replace"] * 6 + ["delete", "none"]))
    if action == "none":
        return document
    path = draw(st.sampled_from(paths))
    if action == "delete":
        parent = document
        for key in path[:-1]:
            parent = parent[key]
        parent.pop(path[-1]) if isinstance(parent, dict) else parent.pop(path[-1])
    else:
        _replace(document, path, draw(JSON_VALUES))
    event(f"{action} {'.'.join(map(str, path[:2]))}")
    return document


def _gate_after_record(root: Path, run: Path, db: Path):
    recorded = run_under_contract(root, ["record", run, "--db", db], [db])
    if recorded.exit_code != 0:
        # refused: nothing of it reached the history
        assert (
            not db.exists()
            or "no runs" in run_under_contract(root, ["gate", "--db", db], [db]).output
        )
        return recorded, None
    return recorded, run_under_contract(root, ["gate", "--db", db], [db])


@given(data=st.data())
def test_a_damaged_report_is_refused_or_never_passes_the_gate(data):
    from support.synthetic_runs import pair_report, write_run

    honest = pair_report(metrics={"max_abs_diff": 0.02})
    honest["policy"]["limits"] = {"max_abs_diff": 1.0, "k3": 0.001}
    report = data.draw(damaged_documents(honest))
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        run = write_run(root / "night", {"compare": {"verdict": "pass"}}, started_at=START)
        (run / "compare" / "report.json").write_text(dumps_line(report))
        recorded, gate = _gate_after_record(root, run, root / "h.db")
        if gate is not None and gate.exit_code == 0:
            assert an_honest_pass(report), (report, gate.output)


@given(data=st.data())
def test_a_damaged_run_manifest_is_refused_or_recorded_as_it_says(data):
    from support.synthetic_runs import pair_report, write_run

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        run = write_run(root / "night", {"compare": pair_report()}, started_at=START)
        manifest = json.loads((run / "lpx-run.json").read_text())
        damaged = data.draw(damaged_documents(manifest))
        (run / "lpx-run.json").write_text(dumps_line(damaged))
        recorded, gate = _gate_after_record(root, run, root / "h.db")
        if gate is not None and any(
            isinstance(s, dict) and s.get("status") == "error" for s in damaged.get("stages", [])
        ):
            assert gate.exit_code == 2, gate.output  # a failed stage is never a pass


HOSTILE_TEXT = st.text(
    alphabet=st.sampled_from(list("ab #*<>&`|\n\r\t\x1b\x07\x9b[]();") + ["\u202e", "\x00"]),
    min_size=1,
    max_size=12,
)


@settings(max_examples={"fast": 6, "long": 200}[PROFILE])  # six commands an example
@given(note=HOSTILE_TEXT, reason=HOSTILE_TEXT)
def test_notes_and_reasons_are_inert_wherever_they_are_shown(history_with_alerts, note, reason):
    import shutil

    from pipeline.text import for_terminal

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        db = root / "h.db"
        shutil.copy(history_with_alerts, db)
        listed = run_under_contract(root, ["history", "alerts", "--json", "--db", db], [db])
        alert = json.loads(listed.output)[0]
        acked = run_under_contract(root, ["ack", alert["id"], "--note", note, "--db", db], [db])
        annotate = ["annotate", "1", "--exclude", "2", "--reason", reason, "--db", db]
        shown = acked.output + run_under_contract(root, annotate, [db]).output
        for view in (["runs"], ["series"], ["series", "1"], ["alerts", "--all"]):
            shown += run_under_contract(root, ["history", *view, "--db", db], [db]).output
        # no control or format character reaches the terminal (newlines end lines)
        assert not re.search("[\\x00-\\x09\\x0b-\\x1f\\x7f-\\x9f\\u202a-\\u202e]", shown), shown
        if acked.exit_code == 0:  # (a blank note is refused: it must say why)
            assert for_terminal(note.strip()) in shown


@pytest.fixture(scope="module")
def stale_model(tiny_model, tmp_path_factory) -> Path:
    """The tiny model with one layer scaled: another checkpoint, other weights."""
    from support.fuzzing import model_with_other_weights

    return model_with_other_weights(tiny_model, tmp_path_factory.mktemp("stale") / "model")


@pytest.fixture(scope="module")
def own_files(run_dir, tmp_path_factory) -> Path:
    """report.json of the shared run's fixture (lpx compare) and an lpx calibration of its
    weights, for the workspace of the random-arguments test."""
    from pipeline.fixture.io import read_table

    root = tmp_path_factory.mktemp("own")
    compared = run_under_contract(
        root, ["compare", run_dir / "fixture.parquet", run_dir / "replay-float32.parquet",
               "--out", root, "--no-calibration", "--no-verify"], [root],
    )  # fmt: skip
    assert compared.exit_code in (0, 1), compared.output
    weights = read_table(run_dir / "fixture.parquet").metadata["model"]["weights_fingerprint"]
    calibration = synthetic_calibration(precisions=("bfloat16", "float32"), fingerprint=weights)
    (root / "calibration.json").write_text(dumps_line(calibration))
    return root


@pytest.fixture(scope="module")
def history_with_alerts(tmp_path_factory) -> Path:
    from support.synthetic_runs import nightly_history

    root = tmp_path_factory.mktemp("alerts")
    db = root / "h.db"
    runs = nightly_history(root / "runs", 14, step_at=10, upgrade_at=10)
    assert run_under_contract(root, ["record", *runs, "--db", db], [db]).exit_code == 0
    return db


# -- option values -------------------------------------------------------------------------

OPTION_VALUES = st.one_of(
    st.integers(-2, 3).map(str),
    st.sampled_from(["0", "0.5", "1.0", "nan", "inf", "-inf", "1e400", "-0.0", "x", ""]),
)


def _rollout_option_ok(name: str, text: str) -> bool:
    try:
        value = float(text)
    except ValueError:
        return False
    whole = value.is_integer() and "." not in text and "e" not in text
    return {
        "--max-tokens": whole and value >= 1,
        "-n": whole and value >= 1,
        "--top-k": whole and value >= 0,
        "--temperature": math.isfinite(value) and value >= 0,
        "--top-p": math.isfinite(value) and 0 < value <= 1,
    }[name]


@given(
    options=st.dictionaries(
        st.sampled_from(["--max-tokens", "-n", "--top-k", "--temperature", "--top-p"]),
        OPTION_VALUES,
        min_size=1,
        max_size=3,
    )
)
def test_rollout_option_values_run_or_are_refused_before_any_work(options, tiny_model):
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "prompts.txt").write_text("hello there\n")
        out = root / "f.parquet"
        args = ["rollout", "--model", tiny_model, "--prompts", root / "prompts.txt", "--out", out]
        args += [part for pair in options.items() for part in pair]
        if "--max-tokens" not in options:
            args += ["--max-tokens", "3"]
        good = all(_rollout_option_ok(k, v) for k, v in options.items())
        result = run_under_contract(root, args, [out], expect="good" if good else "bad")
        assert out.exists() == (result.exit_code == 0)


# -- every command, random arguments -------------------------------------------------------

INPUT_PATHS = [
    "fixture.parquet",
    "replay.parquet",
    "dump.jsonl",
    "prompts.txt",
    "policy.yaml",
    "missing.parquet",
    "indir",
    "",
    "../outside",
    "garbage.bin",
    "night",  # a run directory with a report and lpx-run.json
    "history.db",  # a history with runs and alerts
    "plan.yaml",
    "plan-escape.yaml",
    "plan-no-model.yaml",
    "calibration.json",  # an lpx calibration of the workspace's fixture
    "mine.json",  # a user's own JSON file
]
OUTPUT_PATHS = [
    "out",
    "out/x.parquet",
    "fixture.parquet",
    "../outside",
    "indir",
    "",
    "fifo",
    "history.db",
    "typo.db",
    "calibration.json",  # lpx's: may be replaced
    "mine.json",  # a user's: never replaced
    "userdir",  # a user's report.json, summary.md, localize.json...: never replaced
]
# A report for --report: the fixture's own, another run's (another prompt set), a user's file.
REPORT_PATHS = ["own-report.json", "night/compare/report.json", "mine.json", "missing.json"]
# What a user keeps in USERDIR under the names lpx writes into an output directory.
USER_FILES = ("report.json", "summary.md", "tokens.parquet", "localize.json", "localize.svg",
              "index.html", "lpx-run.json")  # fmt: skip
# Commands whose --out DIR may replace USERDIR's files (none: every one checks them).
OUT_DIR_UNCHECKED: set[str] = set()
WORDS = ["", "x", "a=b", "=", "../x", "\x1b[2J", "hf", "vllm", "float32", "bf16", "1", "-1", "nan"]
NUMERIC = ("IntRange", "IntParamType", "FiniteFloat", "FloatParamType", "FloatRange")
OUTPUT_NAMES = ("out", "out_dir", "out_path", "report_dir", "db")
# Commands that load a model when their arguments are valid: fewer examples in `fast`.
ENGINE_COMMANDS = {"rollout", "replay", "sweep", "smoke", "make-model", "inject", "run",
                   "calibrate", "localize"}  # fmt: skip
# Commands that only read the history: their --db is never created or changed.
READS_HISTORY = {"gate", "history", "report"}
PLAN = """version: 1
name: {name}
{model}prompts: bundled
sampling: {{max_tokens: 4, seed: 0}}
rollout: {{engine: hf, dtype: fp32}}
replays: [{{name: hf-fp32, engine: hf, dtype: fp32}}]
"""


def _leaf_commands():
    import click

    from pipeline.cli import cli

    def walk(group, prefix):
        for name, command in sorted(group.commands.items()):
            if isinstance(command, click.Group):
                yield from walk(command, [*prefix, name])
            else:
                yield [*prefix, name], command

    # `lpx serve` runs until stopped when its arguments are valid; its argument errors are
    # tested in tests/serve/test_serve.py.
    return [(path, command) for path, command in walk(cli, []) if path != ["serve"]]


def _value(draw, param, model: str, stale: str) -> str:
    kind = type(param.type).__name__
    if param.name in OUTPUT_NAMES:
        return draw(st.sampled_from(OUTPUT_PATHS))
    if param.name in ("model_dir", "model_dir_b"):
        # the fixture's model, another checkpoint of it (other weights), not a model at all
        return draw(st.sampled_from([model, model, stale, "indir", "missing-model"]))
    if param.name == "report_path":
        return draw(st.sampled_from(REPORT_PATHS))
    if kind == "Path":
        return draw(st.sampled_from(INPUT_PATHS))
    if kind == "Choice":
        return draw(st.sampled_from([*param.type.choices, "bogus"]))
    if kind in NUMERIC:
        return draw(st.sampled_from(["0", "1", "2", "-1", "nan", "inf", "1e400", "x", ""]))
    return draw(st.sampled_from(WORDS))


@st.composite
def command_lines(draw, params, model, stale):
    import click

    argv = []
    for param in params:
        if isinstance(param, click.Argument):
            argv.append(_value(draw, param, model, stale))
        elif getattr(param, "is_flag", False):
            if draw(st.booleans()):
                argv.append(param.opts[0])
        elif param.required or draw(st.integers(0, 2)) == 0:
            for _ in range(draw(st.integers(1, 2)) if param.multiple else 1):
                argv += [param.opts[0], _value(draw, param, model, stale)]
    return argv


def _workspace(root: Path, run_dir: Path, history: Path, own_files: Path) -> Path:
    """Inputs of every kind in ROOT/work (the cwd), a FIFO where an output might go."""
    import os
    import shutil

    work = root / "work"
    (work / "indir").mkdir(parents=True)
    shutil.copy(run_dir / "fixture.parquet", work / "fixture.parquet")
    shutil.copy(run_dir / "replay-float32.parquet", work / "replay.parquet")
    (work / "dump.jsonl").write_text(
        '{"prompt_ids": [1, 5], "response_ids": [7, 8], "rollout_log_probs": [-1.5, -0.2]}\n'
    )
    (work / "prompts.txt").write_text("hello there\n")
    (work / "policy.yaml").write_text("version: 1\nprofiles: {float32: {tau: 1.0e-4}}\n")
    (work / "garbage.bin").write_bytes(bytes(range(256)))
    os.mkfifo(work / "fifo")
    from support.synthetic_runs import pair_report, write_run

    write_run(work / "night", {"compare": pair_report()}, started_at=START)
    shutil.copy(history, work / "history.db")
    (work / "plan.yaml").write_text(PLAN.format(name="fuzz", model="model: tiny\n"))
    (work / "plan-escape.yaml").write_text(PLAN.format(name="../../X", model="model: tiny\n"))
    (work / "plan-no-model.yaml").write_text(PLAN.format(name="fuzz", model=""))
    shutil.copy(own_files / "calibration.json", work / "calibration.json")
    shutil.copy(own_files / "report.json", work / "own-report.json")
    (work / "mine.json").write_text('{"mine": true}\n')
    (work / "userdir").mkdir()
    for name in USER_FILES:
        (work / "userdir" / name).write_text(f"the user's own {name}\n")
    return work


@pytest.mark.parametrize(
    "path, command", _leaf_commands(), ids=lambda v: " ".join(v) if isinstance(v, list) else ""
)
def test_every_command_keeps_the_contract_on_random_arguments(
    path, command, run_dir, tiny_model, history_with_alerts, stale_model, own_files
):
    import contextlib
    import os

    from pipeline.paths import written_by_lpx

    engine = path[0] in ENGINE_COMMANDS
    examples = {"fast": 4 if engine else 25, "long": 60 if engine else 400}[PROFILE]

    @settings(max_examples=examples)
    @given(argv=command_lines(command.params, str(tiny_model), str(stale_model)))
    def check(argv):
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp)
            work = _workspace(root, run_dir, history_with_alerts, own_files)
            inputs = {
                p.name: p.read_bytes() for p in work.iterdir() if p.is_file() and p.name != "fifo"
            }
            users = {p.name: p.read_bytes() for p in (work / "userdir").iterdir()}
            # files lpx did not write: never replaced, even when named as an output (a history
            # database is lpx's by its tables, not its bytes: --db is left to its own tests)
            foreign = {name for name in inputs if not written_by_lpx(work / name)}
            # The contract: writes only at paths named on the command line, the default
            # history and report under ./runs, and lpx's own cache.
            allowed = [*(work / a for a in argv if a), work / "runs", root / "cache"]
            db = dict(zip(argv, argv[1:], strict=False)).get("--db")
            if path[0] in READS_HISTORY and db:  # read-only: --db is not an output
                allowed = [a for a in allowed if a != work / db]
            saved = os.environ.get("LPX_CACHE")
            os.environ["LPX_CACHE"] = str(root / "cache")
            try:
                with contextlib.chdir(work):
                    run_under_contract(root, [*path, *argv], allowed)
            finally:
                os.environ.pop("LPX_CACHE")
                if saved is not None:
                    os.environ["LPX_CACHE"] = saved
            # Only a file named as an output may change (and only an lpx file: OutputPath).
            named_outputs = {
                value
                for option, value in zip(argv, argv[1:], strict=False)
                if option in ("--out", "--report-out", "--db")
                and not (option == "--db" and path[0] in READS_HISTORY)
            }
            databases = {v for o, v in zip(argv, argv[1:], strict=False) if o == "--db"}
            for name, data in inputs.items():
                if name in named_outputs and (name not in foreign or name in databases):
                    continue
                if (work / name).exists() and (work / name).is_file():
                    assert (work / name).read_bytes() == data, f"{name} was changed"
                else:
                    assert name not in foreign, f"{name}, not lpx's, was removed"
            if path[0] not in OUT_DIR_UNCHECKED:
                for name, data in users.items():
                    kept = work / "userdir" / name
                    assert kept.is_file() and kept.read_bytes() == data, f"userdir/{name} lost"
            assert (work / "fifo").exists() and not (work / "fifo").is_file()

    check()


# -- calibration.json (issue 28) -----------------------------------------------------------


@given(generated=calibration_files())
def test_a_calibration_file_is_read_as_written_or_refused_in_one_line(generated):
    import warnings

    from pipeline.compare.calibration_file import read_calibration
    from pipeline.errors import BadInput

    text, action = generated
    event(f"calibration: {action}")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "calibration.json"
        path.write_text(text)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a RuntimeWarning is a NaN that got through
            if action in ("none", "extra"):
                assert dumps_line(read_calibration(path)) == text  # unknown fields kept
                return
            with pytest.raises(BadInput) as refused:
                read_calibration(path)
    message = refused.value.format_message()
    assert message.startswith(f"{path}: ") and "calibrate" in message, message
    assert "\n" not in message and "\x1b" not in message


@given(
    generated=calibration_files(precisions=("bfloat16", "float32")),
    weights=st.sampled_from(["same", "other", "unrecorded"]),
    allow=st.booleans(),
    data=st.data(),
)
def test_compare_judges_with_a_generated_calibration_or_refuses_it(generated, weights, allow, data):
    import warnings

    text, action = generated
    spec = data.draw(token_tables(scored=True))
    fixture_weights = "sha256:" + "a" * 64
    spec["metadata"]["model"]["weights_fingerprint"] = fixture_weights
    fixture, replay = build_pair(spec, data.draw(st.sampled_from([0.0, 1e-4, 0.5])), 0)
    calibration = json.loads(text) if action in ("none", "extra") else None
    if calibration is not None:
        calibration["key"]["model_fingerprint"] = {
            "same": fixture_weights, "other": "sha256:" + "b" * 64, "unrecorded": None
        }[weights]  # fmt: skip
        text = dumps_line(calibration)
    mismatch = calibration is not None and weights == "other"
    allowed = mismatch and allow
    event(f"calibration: {action}, weights {weights}")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        write_table(fixture, root / "f.parquet")
        write_table(replay, root / "r.parquet")
        (root / "calibration.json").write_text(text)
        out = root / "cmp"
        args = ["compare", root / "f.parquet", root / "r.parquet", "--calibration",
                root / "calibration.json", "--out", out, "--no-verify"]  # fmt: skip
        args += ["--allow-calibration-mismatch"] if allowed else []
        bad = calibration is None or (mismatch and not allowed)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = run_under_contract(root, args, [out], expect="bad" if bad else "good")
        assert not [w for w in caught if issubclass(w.category, RuntimeWarning)], result.output
        if bad:
            assert str(root / "calibration.json") in result.output
            assert not (out / "report.json").exists()
            return
        report = json.loads((out / "report.json").read_text())
        assert (result.exit_code == 0) == (report["verdict"] == "pass")
        assert report["metrics"]["tokens"] == active_count(spec)


# -- localize.json through lpx record (issue 28) -------------------------------------------

BOUNDARY_KINDS = ("embed", "attn_out", "mlp_out", "final_norm", "logits")


@st.composite
def localize_results(draw):
    """A localize.json as `lpx localize` writes it: boundaries in network order with their
    drift, floor and ratio, a first boundary and a verdict that agree with them."""
    margin = 4.0
    rows = []
    for index in range(draw(st.integers(0, 6))):
        kind = draw(st.sampled_from(BOUNDARY_KINDS))
        floor = draw(st.floats(1e-9, 1.0))
        ratio = draw(st.sampled_from([0.0, 0.5, 3.9, 4.0, 4.1, 100.0]))
        rows.append(
            {
                "boundary": f"layers.{index}.{kind}",
                "layer": None if kind in ("embed", "logits") else index,
                "kind": kind,
                "drift": {"max": floor * ratio * 2, "rms": floor * ratio},
                "floor": {"max": floor * 2, "rms": floor},
                "ratio": ratio,
                "beyond": ratio > margin,
            }
        )
    first = next((row for row in rows if row["beyond"]), None)
    verified = first is not None and draw(st.booleans())
    return {
        "lpx_localize": 1,
        "schema_version": 1,
        "verdict": "clean" if first is None else "verified" if verified else "localized",
        "first": None
        if first is None
        else {"boundary": first["boundary"], "ratio": first["ratio"]},
        "verification": None
        if first is None
        else {
            "verified": verified,
            "by": "activation" if verified else None,
            "runner": None,
            "attempts": [{"boundary": first["boundary"]}],
        },  # fmt: skip
        "margin": margin,
        "sides": {
            "a": {"spec": "hf", "engine": "hf", "dtype": "float32", "reference_dtype": "float64"},
            "b": {"spec": "vllm:tp=2", "engine": "vllm", "dtype": "bfloat16", "tp": 2},
        },
        "sequences": draw(st.lists(st.text(max_size=4), max_size=3)),
        "tokens": draw(st.integers(0, 10**6)),
        "boundaries": rows,
        "seconds": draw(st.floats(0.0, 1e4)),
    }


def _is(value, kind) -> bool:
    return isinstance(value, kind) and not isinstance(value, bool)


def _level(value) -> bool:
    return _is(value, (int, float)) and math.isfinite(value) and value >= 0


def _whole(value, high) -> bool:
    return _is(value, int) and 0 <= value <= high


def _absent_or(document: dict, key: str, check) -> bool:
    return document.get(key) is None or check(document[key])


def localize_is_valid(doc) -> bool:
    """The documented rules of localize.json (docs/localize.md), written apart from lpx's
    model: what `lpx record` must take, and all it may take."""
    int32, int64 = 2**31 - 1, 2**63 - 1

    def name(value, width):
        return isinstance(value, str) and 0 < len(value) <= width

    def level_pair(value):
        return isinstance(value, dict) and all(_level(value.get(k)) for k in ("max", "rms"))

    def side(value):
        return (
            isinstance(value, dict)
            and isinstance(value.get("spec"), str)
            and all(_absent_or(value, k, lambda v: isinstance(v, str))
                    for k in ("engine", "dtype", "reference_dtype"))
            and all(_absent_or(value, k, lambda v: _whole(v, int32)) for k in ("tp", "world_size"))
        )  # fmt: skip

    def boundary(row):
        return (
            isinstance(row, dict)
            and name(row.get("boundary"), 128)
            and _absent_or(row, "layer", lambda v: _whole(v, int32))
            and name(row.get("kind"), 32)
            and level_pair(row.get("drift"))
            and level_pair(row.get("floor"))
            and _level(row.get("ratio"))
            and isinstance(row.get("beyond"), bool)
        )

    def first(value):
        return (
            isinstance(value, dict)
            and name(value.get("boundary"), 128)
            and _level(value.get("ratio"))
        )

    def verification(value):
        return (
            isinstance(value, dict)
            and isinstance(value.get("verified"), bool)
            and all(_absent_or(value, k, lambda v: isinstance(v, str)) for k in ("by", "runner"))
            and _absent_or(
                value, "attempts", lambda v: isinstance(v, list) and all(
                    isinstance(a, dict) for a in v)
            )
        )  # fmt: skip

    if not isinstance(doc, dict):
        return False
    sides = doc.get("sides")
    return (
        _absent_or(doc, "lpx_localize", lambda v: _is(v, int) and v == 1)
        and _is(doc.get("schema_version"), int)
        and doc.get("schema_version") == 1
        and doc.get("verdict") in ("clean", "localized", "verified")
        and _absent_or(doc, "first", first)
        and _absent_or(doc, "verification", verification)
        and _level(doc.get("margin"))
        and isinstance(sides, dict)
        and side(sides.get("a"))
        and side(sides.get("b"))
        and isinstance(doc.get("sequences"), list)
        and all(isinstance(s, str) for s in doc["sequences"])
        and _whole(doc.get("tokens"), int64)
        and isinstance(doc.get("boundaries"), list)
        and all(boundary(row) for row in doc["boundaries"])
        and _absent_or(doc, "seconds", _level)
    )


@given(data=st.data())
def test_a_localize_result_is_recorded_as_written_or_refused(data):
    from pipeline.db.models import LocalizeBoundary, Run

    from support.helpers import count
    from support.synthetic_runs import pair_report, write_run

    honest = data.draw(localize_results())
    result = data.draw(damaged_documents(honest))
    valid = localize_is_valid(result)
    event(f"localize.json: {'valid' if valid else 'invalid'}")
    pair = "compare/0-hf"
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        run = write_run(root / "night", {pair: pair_report(verdict="fail")}, started_at=START)
        (run / pair / "localize").mkdir()
        (run / pair / "localize" / "localize.json").write_text(dumps_line(result))
        db = root / "h.db"
        recorded = run_under_contract(
            root, ["record", run, "--db", db], [db], expect="good" if valid else "bad"
        )
        url = f"sqlite:///{db}"
        if not valid:
            assert "localize.json" in recorded.output
            assert not db.exists() or count(url, Run) == 0
            return
        assert recorded.exit_code == 0, recorded.output
        rows = count(url, LocalizeBoundary)
        errors = count(url, Run, Run.status == "error")
        # stored whole, or (a result that contradicts itself) not at all, in an error run
        assert (rows, errors) in ((len(result["boundaries"]), 0), (0, 1)), recorded.output
        if result == honest:
            assert errors == 0  # what localize writes is never taken for a contradiction
        gate = run_under_contract(root, ["gate", "--db", db], [db])
        assert gate.exit_code != 0  # the pair failed: no localize.json makes it pass


# -- what belongs to the fixture, and options said twice (issue 28) ------------------------


@settings(max_examples={"fast": 12, "long": 80}[PROFILE])
@given(
    model=st.sampled_from(["own", "stale"]),
    allow_model=st.booleans(),
    report=st.sampled_from(["none", "own", "other"]),
    allow_report=st.booleans(),
    choose=st.sampled_from(["count", "count", "sequence", "both"]),
    out_state=st.sampled_from(["absent", "absent", "lpx", "user"]),
)
def test_localize_runs_what_belongs_to_the_fixture_or_what_is_allowed(
    model, allow_model, report, allow_report, choose, out_state,
    run_dir, tiny_model, stale_model, own_files,
):  # fmt: skip
    from pipeline.fixture.io import read_table

    fixture = run_dir / "fixture.parquet"
    first_id = read_table(fixture).sequence_ids[0]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        out = root / "loc"
        if out_state != "absent":
            out.mkdir()
            text = '{"mine": 1}' if out_state == "user" else None
            if text is None:  # an earlier localize's result, as lpx wrote it
                text = dumps_line({"lpx_localize": 1, "schema_version": 1, "verdict": "clean",
                                   "boundaries": [], "sides": {}})  # fmt: skip
            (out / "localize.json").write_text(text)
        reports = {"own": own_files / "report.json", "other": _another_runs_report(root)}
        argv = ["localize", fixture, "--a", "hf", "--b", "hf", "--out", out]
        argv += ["--model", tiny_model if model == "own" else stale_model]
        argv += ["--allow-model-mismatch"] if allow_model else []
        argv += ["--report", reports[report]] if report != "none" else []
        argv += ["--allow-report-mismatch"] if allow_report else []
        argv += {"count": ["--sequences", "1"], "sequence": ["--sequence", first_id],
                 "both": ["--sequence", first_id, "--sequences", "1"]}[choose]  # fmt: skip
        problems = {
            "lpx did not write it": out_state == "user",
            "both choose the sequences": choose == "both" or (choose == "sequence" and report != "none"),
            "--allow-model-mismatch": model == "stale" and not allow_model,
            "--allow-report-mismatch": report == "other" and not allow_report,
        }  # fmt: skip
        expected = [marker for marker, found in problems.items() if found]
        event(f"localize: {', '.join(expected) or 'runs'}")
        result = run_under_contract(root, argv, [out], expect="bad" if expected else "good")
        if expected:
            (error,) = [line for line in result.output.splitlines() if line.startswith("Error:")]
            assert any(marker in error for marker in expected), error
            if out_state == "user":
                assert (out / "localize.json").read_text() == '{"mine": 1}'
            return
        written = json.loads((out / "localize.json").read_text())
        allowed = written.get("allowed_mismatches", {})
        assert sorted(allowed) == sorted(
            [k for k, v in (("model", model == "stale"), ("report", report == "other")) if v]
        )
        assert all(record["allowed"] is True for record in allowed.values())


def _another_runs_report(root: Path) -> Path:
    """A report.json of another run (another prompt set and weights): support/synthetic_runs."""
    from support.synthetic_runs import pair_report

    path = root / "another-report.json"
    path.write_text(dumps_line(pair_report(verdict="fail")))
    return path


@settings(max_examples={"fast": 4, "long": 30}[PROFILE])
@given(
    model=st.sampled_from(["own", "stale"]),
    allow=st.booleans(),
    out_state=st.sampled_from(["absent", "lpx", "user"]),
)
def test_calibrate_measures_the_fixtures_model_or_what_is_allowed(
    model, allow, out_state, run_dir, tiny_model, stale_model
):
    from pipeline.fingerprint import weights_fingerprint

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        out = root / "calibration.json"
        if out_state != "absent":
            out.write_text('{"mine": 1}' if out_state == "user" else dumps_line(
                synthetic_calibration()))  # fmt: skip
        before = out.read_bytes() if out.exists() else None
        used = tiny_model if model == "own" else stale_model
        argv = ["calibrate", run_dir / "fixture.parquet", "--model", used, "--out", out,
                "--dtype", "float32", "--sequences", "1"]  # fmt: skip
        argv += ["--allow-model-mismatch"] if allow else []
        problems = {
            "not an lpx file": out_state == "user",
            "--allow-model-mismatch": model == "stale" and not allow,
        }
        expected = [marker for marker, found in problems.items() if found]
        event(f"calibrate: {', '.join(expected) or 'runs'}")
        result = run_under_contract(root, argv, [out], expect="bad" if expected else "good")
        if expected:
            (error,) = [line for line in result.output.splitlines() if line.startswith("Error:")]
            assert any(marker in error for marker in expected), error
            assert (out.read_bytes() if out.exists() else None) == before
            return
        written = json.loads(out.read_text())
        assert written["key"]["model_fingerprint"] == weights_fingerprint(used)
        assert ("allowed_mismatches" in written) == (model == "stale")


KNOBS = st.lists(
    st.tuples(st.sampled_from(["a", "b", "mask"]), st.sampled_from(["1", "2", "loss_mask"])),
    min_size=1,
    max_size=4,
)


@settings(max_examples={"fast": 25, "long": 400}[PROFILE])
@given(pairs=KNOBS, where=st.sampled_from(["--set", "--field", "spec", "--setting", "plan"]))
def test_a_setting_said_twice_is_refused_naming_both(pairs, where, run_dir):
    """Each parser of KEY=VALUE lists: a key twice is refused naming both pairs; otherwise
    the list is judged on its own merits (here always refused for another reason, so that
    no example runs a model)."""
    keys = [key for key, _ in pairs]
    twice = next(
        (key for i, key in enumerate(keys) if key in keys[:i]), None
    )  # the first seen again
    event(f"{where}: {'twice' if twice else 'once'}")
    texts = [f"{key}={value}" for key, value in pairs]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        if where == "plan":
            _check_plan_knobs(root, pairs, twice)
            return
        (root / "d.jsonl").write_text('{"prompt_ids": [1], "response_ids": [2], '
                                      '"rollout_log_probs": [-0.5]}\n')  # fmt: skip
        (root / "p.txt").write_text("hello\n")
        out = root / "out"
        argv = {
            "--set": ["replay", run_dir / "fixture.parquet", "--out", out,
                      *(part for text in texts for part in ("--set", text))],
            "--field": ["ingest", root / "d.jsonl", "--out", out,
                        *(part for text in texts for part in ("--field", text))],
            "spec": ["localize", run_dir / "fixture.parquet", "--a", "hf:" + ",".join(texts),
                     "--b", "hf", "--model", root / "missing-model", "--out", out],
            "--setting": ["sweep", "--engine", "hf", "--model", root / "missing-model",
                          "--prompts", root / "p.txt", "--setting", "base:",
                          "--setting", "s:" + ",".join(texts), "--out", out],
        }[where]  # fmt: skip
        if where == "--field" and not twice:
            return  # a valid --field list ingests: covered by the ingest fuzz above
        result = run_under_contract(root, argv, [out], expect="bad")
        (error,) = [line for line in result.output.splitlines() if line.startswith("Error:")]
        if twice:
            first, second = [t for t in texts if t.startswith(f"{twice}=")][:2]
            assert repr(first) in error and repr(second) in error, error
        else:
            assert "twice" not in error and "both set" not in error, error


def _check_plan_knobs(root: Path, pairs, twice) -> None:
    """A plan's replay knobs as YAML with each pair on its own line (a mapping may say a key
    twice): refused naming both values, or taken as written."""
    from pipeline.errors import BadInput
    from pipeline.orchestrator.plan import load_plan

    knobs = "".join(f"      {key}: '{value}'\n" for key, value in pairs)
    plan = root / "plan.yaml"
    plan.write_text("version: 1\nname: t\nmodel: tiny\nrollout: {engine: hf}\nreplays:\n"
                    f"  - name: r\n    engine: hf\n    knobs:\n{knobs}")  # fmt: skip
    if twice:
        with pytest.raises(BadInput) as refused:
            load_plan(plan)
        values = [value for key, value in pairs if key == twice][:2]
        assert f"'{twice}' is given twice in one mapping ({values[0]!r} and {values[1]!r})" in (
            refused.value.format_message()
        )
    else:
        assert load_plan(plan).replays[0].knobs == dict(pairs)
