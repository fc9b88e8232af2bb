"""Outputs replace only what lpx wrote (pipeline/paths.py, issue 28): every kind of file lpx
writes is recognised by its content, and anything else under an output's name is refused."""

from __future__ import annotations

import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.errors import BadInput
from pipeline.paths import (
    check_replaceable,
    check_replaceable_in,
    mark_lpx_directory,
    written_by_lpx,
)
from support.fuzzing import synthetic_calibration


def _lpx_files(root):
    """One file of each kind lpx writes, written the way lpx writes it."""
    from pipeline.fixture.io import write_table
    from pipeline.fixture.table import table_from_sequences
    from pipeline.localize.chart import drift_chart
    from support.synthetic_runs import pair_report

    table = table_from_sequences("fixture", ["a"], [[1]], [[2]], {"rollout": [[-0.5]]})
    write_table(table, root / "fixture.parquet")
    (root / "calibration.json").write_text(json.dumps(synthetic_calibration()))
    (root / "report.json").write_text(json.dumps(pair_report()))
    matrix = {"verdict": "pass", "exact": False, "pairs": [], "metadata": {"fixture": "f"}}
    (root / "matrix.json").write_text(json.dumps(matrix))
    localize = _localize_result()
    (root / "localize.json").write_text(json.dumps(localize))
    older = {k: v for k, v in localize.items() if k != "lpx_localize"}  # before the marker
    (root / "localize-older.json").write_text(json.dumps(older))
    (root / "localize.svg").write_text(drift_chart(localize))
    (root / "summary.md").write_text("# lpx compare: PASS\n\n- rollout: hf\n")
    (root / "matrix.md").write_text("# lpx compare matrix: FAIL\n")
    from pipeline.run_manifest import new_manifest, write_manifest

    write_manifest(root, new_manifest("smoke", "lpx smoke"))
    verdicts = {"float32": {"verdict": "pass", "report": "compare-hf-float32/report.json"}}
    (root / "smoke.json").write_text(json.dumps(verdicts))
    return sorted(p.name for p in root.iterdir())


def _localize_result() -> dict:
    row = {
        "boundary": "layers.0.mlp_out",
        "layer": 0,
        "kind": "mlp_out",
        "drift": {"max": 0.1, "rms": 0.01},
        "floor": {"max": 0.1, "rms": 0.01},
        "ratio": 1.0,
        "beyond": False,
    }
    return {
        "lpx_localize": 1,
        "schema_version": 1,
        "verdict": "clean",
        "first": None,
        "verification": None,
        "margin": 4.0,
        "sides": {"a": {"spec": "hf"}, "b": {"spec": "hf:dtype=bf16"}},
        "sequences": ["s0"],
        "tokens": 3,
        "boundaries": [row],
        "seconds": 0.5,
    }


def test_every_file_lpx_writes_is_recognised_as_lpx_s(tmp_path):
    names = _lpx_files(tmp_path)
    assert len(names) == 11
    for name in names:
        assert written_by_lpx(tmp_path / name), name
        check_replaceable(tmp_path / name, "--out")


@pytest.mark.parametrize(
    "name, content",
    [
        ("calibration.json", b'{"floors": {"bf16": 0.01}}'),  # a user's own calibration
        ("report.json", b'{"verdict": "pass"}'),
        ("notes.json", b"[1, 2]"),
        ("summary.md", b"# My summary\n"),
        ("localize.svg", b'<svg xmlns="http://www.w3.org/2000/svg"></svg>'),
        ("empty.json", b""),
        ("truncated.json", b'{"lpx_calibration": 2, '),
        ("binary.parquet", b"PAR1 but not really"),
    ],
)
def test_anything_else_under_an_outputs_name_is_refused(tmp_path, name, content):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(BadInput) as refused:
        check_replaceable(path, "--out")
    assert refused.value.format_message() == (
        f"--out {path}: exists and lpx did not write it; lpx replaces only its own outputs. "
        "Choose another path, or move that file away first."
    )
    assert path.read_bytes() == content


def test_what_lpx_compare_writes_is_recognised_as_lpx_s(tmp_path):
    from pipeline.fixture.io import write_table
    from support.fuzzing import build_pair
    from support.helpers import run_lpx

    spec = {"sequence_ids": ["a", "b"], "prompts": [[1], [2, 3]], "completions": [[4], [5, 6]],
            "masks": [[True], [True, False]], "rollout": [[-1.0], [-0.5, -2.0]],
            "metadata": {"dtype": "float32"}}  # fmt: skip
    fixture, replay = build_pair(spec, 1e-3, 0)
    write_table(fixture, tmp_path / "f.parquet")
    write_table(replay, tmp_path / "r.parquet")
    out = tmp_path / "cmp"
    for _ in range(2):  # the second run replaces the first's outputs
        result = run_lpx("compare", tmp_path / "f.parquet", tmp_path / "r.parquet", "--out", out)
        assert result.exit_code in (0, 1), result.output
    outputs = sorted(p.name for p in out.iterdir() if not p.name.startswith("."))
    assert outputs == ["report.json", "sequences.parquet", "summary.md", "tokens.parquet"]
    assert all(written_by_lpx(out / name) for name in outputs)


def test_a_parquet_file_another_tool_wrote_is_not_lpx_s(tmp_path):
    pq.write_table(pa.table({"x": [1, 2]}), tmp_path / "theirs.parquet")
    assert not written_by_lpx(tmp_path / "theirs.parquet")


def test_a_fifo_is_refused_without_being_opened(tmp_path):
    os.mkfifo(tmp_path / "fifo")  # opening it for reading would block until a writer came
    with pytest.raises(BadInput, match="exists and lpx did not write it"):
        check_replaceable(tmp_path / "fifo", "--out")
    with pytest.raises(BadInput, match="is a directory; give a file path"):
        check_replaceable(tmp_path, "--out")
    check_replaceable(tmp_path / "absent.json", "--out")


def test_an_output_directory_holding_a_users_file_under_an_outputs_name_is_refused(tmp_path):
    _lpx_files(tmp_path)
    check_replaceable_in(tmp_path, ["report.json", "summary.md", "localize.json", "absent"])
    (tmp_path / "summary.md").write_text("my notes\n")
    with pytest.raises(BadInput) as refused:
        check_replaceable_in(tmp_path, ["report.json", "summary.md"], "--out")
    assert refused.value.format_message() == (
        f"--out {tmp_path}: summary.md there exists and lpx did not write it; lpx replaces only "
        "its own outputs. Choose another directory, or move that one away first."
    )


def test_a_directory_is_lpx_s_when_marked_or_shaped_like_localize_captures(tmp_path):
    marked = tmp_path / "marked"
    mark_lpx_directory(marked)
    (marked / "anything.txt").write_text("x")
    older = tmp_path / "older" / "a" / "0"
    older.mkdir(parents=True)
    np.save(older / "layers.0.mlp_out.npy", np.zeros(2))
    (tmp_path / "empty").mkdir()
    users = tmp_path / "users" / "a" / "0"
    users.mkdir(parents=True)
    np.save(users / "x.npy", np.zeros(2))
    (tmp_path / "users" / "thesis.tex").write_text("months of work")
    assert written_by_lpx(marked) and written_by_lpx(tmp_path / "older")
    assert written_by_lpx(tmp_path / "empty")
    assert not written_by_lpx(tmp_path / "users")
