"""sequences.parquet (pipeline/contracts/sequences.py, issue 54): report.json stays a summary
of bounded size at any sequence count, the per-sequence rows and each finding's whole list
are in the parquet beside it, and the history, the report and localize read either layout
(reports written before it hold both inline)."""

from __future__ import annotations

import json
import re
import shutil

import numpy as np
import pyarrow.parquet as pq
import pytest

from pipeline.compare.outputs import write_outputs
from pipeline.compare.run import compare_tables
from pipeline.contracts.report import Report
from pipeline.contracts.sequences import (
    SAMPLE,
    finding_count,
    finding_sequences,
    sequence_count,
    sequence_rows,
)
from support.helpers import inline_report, run_lpx
from support.synthetic_runs import drifting_pair

LARGE = 40_000


def _compare(sequences: int, out, seed: int = 0):
    fixture, replay = drifting_pair(sequences, seed)
    comparison = compare_tables(fixture, replay, "fixture.parquet", "replay.parquet")
    write_outputs(comparison, out)
    return comparison


def _listing(comparison) -> tuple[int, list[str]]:
    """The finding naming the most sequences: its place and whole list, as compare made it."""
    index = max(range(len(comparison.report.diagnosis)),
                key=lambda i: len(comparison.report.diagnosis[i].sequences))  # fmt: skip
    return index, comparison.report.diagnosis[index].sequences


@pytest.fixture(scope="module")
def large(tmp_path_factory):
    out = tmp_path_factory.mktemp("large")
    return _compare(LARGE, out), out


def test_report_json_stays_small_however_many_sequences(large, tmp_path):
    comparison, out = large
    small = tmp_path / "small"
    _compare(2_000, small)
    size, small_size = ((d / "report.json").stat().st_size for d in (out, small))
    # the inline layout grew by ~360 bytes a sequence: 14 MB here, 117 MB at 320,000
    assert size < 100_000
    assert size - small_size < 10_000  # 20 times the sequences, a few KB more (bins, text)
    written = json.loads((out / "report.json").read_text())
    assert written["sequences"] is None
    assert written["sequence_table"] == {"file": "sequences.parquet", "rows": LARGE}
    assert pq.read_metadata(out / "sequences.parquet").num_rows == LARGE


def test_a_finding_keeps_a_count_and_a_sample_and_the_parquet_its_whole_list(large):
    comparison, out = large
    index, whole = _listing(comparison)
    assert len(whole) > 3_000  # a tenth of the sequences drift
    written = json.loads((out / "report.json").read_text())["diagnosis"][index]
    assert written["sequences"] == whole[:SAMPLE]
    assert written["sequence_count"] == len(whole) == finding_count(written)
    assert written["sequences_column"] == f"finding_{index}"
    places = pq.read_table(out / "sequences.parquet").column(f"finding_{index}").to_pylist()
    assert sum(place is not None for place in places) == len(whole)
    assert sorted(p for p in places if p is not None) == list(range(len(whole)))
    report = Report.model_validate_json((out / "report.json").read_text())
    assert finding_sequences(report, out / "report.json")[index] == whole  # in its own order
    assert sequence_count(report) == LARGE


def test_the_rows_are_the_ones_report_json_held_inline(tmp_path):
    fixture, replay = drifting_pair(50, seed=1)
    comparison = compare_tables(fixture, replay, "fixture.parquet", "replay.parquet")
    columns = comparison.sequences
    columns["chi2_seq"][3], columns["sum_diff"][4] = np.nan, -np.inf
    write_outputs(comparison, tmp_path)
    path = tmp_path / "report.json"
    rows = sequence_rows(Report.model_validate_json(path.read_text()), path)
    assert [row["sequence_id"] for row in rows] == fixture.sequence_ids
    assert rows[3]["chi2_seq"] == "nan" and rows[4]["sum_diff"] == "-inf"  # JSON's spelling
    assert [row["max_abs_diff"] for row in rows] == columns["max_abs_diff"].tolist()
    assert [row["tokens"] for row in rows] == np.diff(fixture.completion_offsets).tolist()
    assert [row["over_tau"] for row in rows] == columns["over_tau"].tolist()
    assert sum(row["over_tau"] for row in rows) > 0
    assert list(rows[0]) == ["sequence_id", "tokens", "max_abs_diff", "mean_abs_diff",
                             "sum_abs_diff", "sum_diff", "log_ppl_diff", "chi2_seq", "over_tau"]  # fmt: skip


@pytest.fixture(scope="module")
def both_layouts(tmp_path_factory):
    """One comparison written as compare writes it now and as an older compare did."""
    root = tmp_path_factory.mktemp("layouts")
    comparison = _compare(3_000, root / "new" / "compare")
    (root / "old" / "compare").mkdir(parents=True)
    older = inline_report(root / "new" / "compare")
    (root / "old" / "compare" / "report.json").write_text(json.dumps(older))
    shutil.copy(root / "new" / "compare" / "tokens.parquet", root / "old" / "compare")
    return comparison, root


def test_an_older_report_records_and_renders_as_a_new_one(both_layouts):
    from pipeline.db.models import Comparison

    from pipeline.history.database import open_history

    comparison, root = both_layouts
    index, whole = _listing(comparison)
    stored, pages = {}, {}
    for layout in ("new", "old"):
        db = root / f"{layout}.db"
        result = run_lpx("record", root / layout, "--db", db)
        assert result.exit_code == 0, result.output
        history = open_history(str(db))
        with history.read() as session:
            (row,) = session.query(Comparison).all()
            stored[layout] = (
                row.sequences,
                row.details["sequences"],
                row.details["sequence_count"],
            )
        history.dispose()
        site = root / f"site-{layout}"
        assert run_lpx("report", "--db", db, "--out", site).exit_code == 0
        (page,) = (site / "runs").glob("*.html")
        pages[layout] = re.findall(r"sequences seq-[^<]*? more", page.read_text())
    assert stored["new"] == stored["old"]
    assert stored["new"][0] == stored["new"][2] == 3_000 and len(stored["new"][1]) == 200
    assert stored["new"][1][0]["max_abs_diff"] == max(r["max_abs_diff"] for r in stored["new"][1])
    more = f"and {len(whole) - 12:,} more"  # the run page names 12 (report/pages.py)
    assert pages["new"] == pages["old"] and any(line.endswith(more) for line in pages["new"])


def test_localize_reads_the_rows_and_lists_of_either_layout(both_layouts):
    from pipeline.commands.localize import _read_report

    comparison, root = both_layouts
    index, whole = _listing(comparison)
    new, old = (
        _read_report(root / layout / "compare" / "report.json") for layout in ("new", "old")
    )
    assert new.sequences == old.sequences and len(new.sequences) == 3_000
    assert new.diagnosis[index]["sequences"] == old.diagnosis[index]["sequences"] == whole


def test_a_report_without_its_sequences_parquet_is_refused_in_one_line(both_layouts, tmp_path):
    from pipeline.commands.localize import _read_report
    from pipeline.errors import BadInput

    _, root = both_layouts
    run = tmp_path / "run"
    shutil.copytree(root / "new", run)
    (run / "compare" / "sequences.parquet").unlink()
    result = run_lpx("record", run, "--db", tmp_path / "h.db")
    assert result.exit_code == 2
    (error,) = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert f"{run / 'compare' / 'sequences.parquet'}: missing" in error
    assert "nothing was recorded" in error
    with pytest.raises(BadInput, match=r"sequences\.parquet: missing; report\.json beside it"):
        _read_report(run / "compare" / "report.json")
    # a table of another comparison: the row counts disagree
    pq.write_table(pq.read_table(root / "new" / "compare" / "sequences.parquet").slice(0, 10),
                   run / "compare" / "sequences.parquet")  # fmt: skip
    with pytest.raises(BadInput, match="10 rows where report.json says 3000"):
        _read_report(run / "compare" / "report.json")
