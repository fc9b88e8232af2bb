"""sequences.parquet: a comparison's per-sequence rows and each finding's full list of
sequences, beside report.json; and the one reader of them, for either layout.

report.json stays a summary of bounded size at any sequence count: its ``sequence_table``
names the file and its row count, and each finding keeps ``sequence_count`` and the first
``SAMPLE`` ids of its list in ``sequences``, with ``sequences_column`` naming the column
that holds the whole list. The file has one row per compared sequence, in compare's order:
the columns of `SEQUENCE_COLUMNS` (the names and values report.json's ``sequences`` rows
had inline), then one int32 column per finding, ``finding_<i>`` (``i`` its place in
``diagnosis``): a sequence's place in that finding's list, null where the finding does not
name it.

Reports written before this layout carry the rows inline (``sequences``) and each finding's
whole list; every reader goes through `sequence_rows`, `finding_sequences`,
`sequence_count` and `finding_count`, which return the same data from either.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pipeline.contracts.files import SEQUENCES
from pipeline.contracts.report import Finding, Report

SAMPLE = 20  # sequence ids a finding keeps in report.json; the rest are in the parquet
METRIC_COLUMNS = (
    "tokens",
    "max_abs_diff",
    "mean_abs_diff",
    "sum_abs_diff",
    "sum_diff",
    "log_ppl_diff",
    "chi2_seq",
)
SEQUENCE_COLUMNS = ("sequence_id", *METRIC_COLUMNS, "over_tau")


class SequencesUnreadable(OSError):
    """sequences.parquet is missing, unreadable or not the table report.json names; the
    message says which file and what to do."""


def finding_column(index: int) -> str:
    """The column holding the ``index``-th finding's list."""
    return f"finding_{index}"


def sequence_count(report: Report) -> int:
    """How many sequences the comparison has rows for, without reading them."""
    table = report.sequence_table
    if isinstance(table, dict) and isinstance(table.get("rows"), int):
        return table["rows"]
    return len(report.sequences or [])


def finding_count(finding: Finding | dict) -> int:
    """How many sequences a finding names (a report's finding is a dict when held as
    written)."""
    fields = finding if isinstance(finding, dict) else finding.as_dict()
    count = fields.get("sequence_count")
    if isinstance(count, int) and not isinstance(count, bool):
        return count
    named = fields.get("sequences")
    return len(named) if isinstance(named, list) else 0


def sequence_rows(report: Report, report_path: Path, worst: int | None = None) -> list[dict]:
    """Every per-sequence row, as report.json held them inline: dicts in compare's order,
    non-finite numbers as the strings "nan"/"inf"/"-inf". With ``worst``, only that many
    rows, largest max |d| first (a non-finite one first of all: a broken sequence), ties in
    compare's order; a run page keeps 200 of 320,000."""
    if not isinstance(report.sequence_table, dict):
        rows = [row for row in report.sequences or [] if isinstance(row, dict)]
        return rows if worst is None else sorted(rows, key=_drift)[:worst]
    table = _read(report, report_path, SEQUENCE_COLUMNS)
    if worst is not None:
        drift = table.column("max_abs_diff").to_numpy(zero_copy_only=False).astype(np.float64)
        drift[~np.isfinite(drift)] = np.inf
        table = table.take(np.argsort(-drift, kind="stable")[:worst])
    columns = [_json_column(table.column(name).to_numpy(zero_copy_only=False))
               for name in SEQUENCE_COLUMNS]  # fmt: skip
    return [
        dict(zip(SEQUENCE_COLUMNS, values, strict=True)) for values in zip(*columns, strict=True)
    ]


def finding_sequences(report: Report, report_path: Path) -> list[list[str]]:
    """Each finding's whole list of sequence ids, in its own order (the diagnosis's order)."""
    findings = [f if isinstance(f, dict) else f.as_dict() for f in report.diagnosis or []]
    columns = {
        index: fields["sequences_column"]
        for index, fields in enumerate(findings)
        if isinstance(fields.get("sequences_column"), str)
    }
    lists = [[str(s) for s in fields.get("sequences") or []] for fields in findings]
    if not columns:
        return lists
    table = _read(report, report_path, ("sequence_id", *columns.values()))
    ids = table.column("sequence_id").to_numpy(zero_copy_only=False)
    for index, name in columns.items():
        places = table.column(name).to_numpy(zero_copy_only=False)  # nulls as NaN
        named = np.flatnonzero(~np.isnan(places))
        lists[index] = ids[named[np.argsort(places[named], kind="stable")]].tolist()
        if len(lists[index]) != finding_count(findings[index]):
            raise SequencesUnreadable(
                f"{_path(report_path, report.sequence_table)}: column {name} names {len(lists[index])} sequences but "
                f"report.json counts {finding_count(findings[index])}; rerun `lpx compare`."
            )
    return lists


def with_sequences(report: Report, report_path: Path) -> Report:
    """The report as the inline layout has it: every per-sequence row in ``sequences`` and
    each finding's whole list, for a reader that walks them (localize --report)."""
    if not isinstance(report.sequence_table, dict):
        return report
    lists = finding_sequences(report, report_path)
    diagnosis = [
        {**f, "sequences": named} if isinstance(f, dict) else f.but(sequences=named)
        for f, named in zip(report.diagnosis or [], lists, strict=True)
    ]
    return report.model_copy(
        update={"sequences": sequence_rows(report, report_path), "diagnosis": diagnosis}
    )


def _drift(row: dict) -> float:
    value = row.get("max_abs_diff")
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    return -value if number and np.isfinite(value) else -np.inf


def _read(report: Report, report_path: Path, names):
    """The named columns of the sequences.parquet beside ``report_path``, checked against
    what report.json says of it."""
    import pyarrow.parquet as pq

    path = _path(report_path, report.sequence_table)
    try:
        table = pq.read_table(path, columns=list(dict.fromkeys(names)))
    except FileNotFoundError:
        raise SequencesUnreadable(
            f"{path}: missing; report.json beside it keeps its per-sequence rows there. Copy "
            "it with the report, or rerun `lpx compare`."
        ) from None
    except (OSError, ValueError, KeyError) as error:  # arrow's errors are ValueErrors
        reason = " ".join(str(error).split())[:160]
        raise SequencesUnreadable(
            f"{path}: not the per-sequence table report.json names ({reason}); rerun `lpx compare`."
        ) from None
    kinds = _kinds()
    wrong = [
        f"{field.name} is {field.type}"
        for field in table.schema
        if not kinds.get(field.name, _is_place)(field.type)
    ]
    if wrong:
        raise SequencesUnreadable(
            f"{path}: {', '.join(wrong[:3])}, not what compare writes there; rerun `lpx compare`."
        )
    rows = report.sequence_table.get("rows")
    if table.num_rows != rows:
        raise SequencesUnreadable(
            f"{path}: {table.num_rows} rows where report.json says {rows}; the two are from "
            "different comparisons: rerun `lpx compare`."
        )
    return table


def _is_place(kind) -> bool:
    import pyarrow.types as types

    return types.is_integer(kind)


def _kinds() -> dict:
    """Each column's arrow type check: what compare writes, any width."""
    import pyarrow.types as types

    def number(kind):
        return types.is_integer(kind) or types.is_floating(kind)

    def text(kind):
        return (
            types.is_string(kind)
            or types.is_large_string(kind)
            or (types.is_dictionary(kind) and types.is_string(kind.value_type))
        )

    return {"sequence_id": text, "tokens": types.is_integer, "over_tau": types.is_boolean,
            **{name: number for name in METRIC_COLUMNS[1:]}}  # fmt: skip


def _path(report_path: Path, table: dict | None = None) -> Path:
    """The file report.json names (by name only: it is always beside the report)."""
    name = (table or {}).get("file") if isinstance(table, dict) else None
    return Path(report_path).with_name(Path(name).name if isinstance(name, str) else SEQUENCES)


def _json_column(values) -> list:
    """A column as report.json held it inline: JSON has no NaN or inf, so those entries are
    the strings a reader recognises."""
    column = values.tolist()
    if values.dtype.kind == "f":
        for index in np.flatnonzero(~np.isfinite(values)):
            column[index] = str(column[index])
    return column
