"""compare's per-sequence rows as columns, and sequences.parquet written from them with each
finding's whole list, so report.json keeps only a count and a sample (the layout:
pipeline/contracts/sequences.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pipeline.contracts.files import SEQUENCES
from pipeline.contracts.report import Finding
from pipeline.contracts.sequences import METRIC_COLUMNS, SAMPLE, finding_column
from pipeline.paths import replacing


def sequence_columns(sequence_ids: list[str], per_sequence: dict, tau: float) -> dict:
    """The rows report.json held inline, as columns (compare/metrics.py:sequence_metrics's
    arrays, in the aligned order), with whether each sequence's max |d| is over tau."""
    return {
        "sequence_id": list(sequence_ids),
        **{name: per_sequence[name] for name in METRIC_COLUMNS},
        "over_tau": per_sequence["max_abs_diff"] > tau,
    }


def write_sequence_table(
    columns: dict, findings: list[Finding], path: Path
) -> tuple[dict, list[Finding]]:
    """Write sequences.parquet; returns report.json's ``sequence_table`` and the findings as
    report.json keeps them: the first SAMPLE ids, the count, and the column with the whole
    list. A list the table cannot hold in order (an id twice, or one not compared) stays
    whole in report.json, as a finding of the inline layout does."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    ids = columns["sequence_id"]
    arrays = {
        "sequence_id": pa.array(ids, pa.string()),
        **{name: pa.array(np.asarray(columns[name])) for name in METRIC_COLUMNS},
        "over_tau": pa.array(np.asarray(columns["over_tau"], dtype=np.bool_)),
    }
    row_of = {sequence_id: row for row, sequence_id in enumerate(ids)} if findings else {}
    written = []
    for index, finding in enumerate(findings):
        places = _places(finding.sequences, row_of, len(ids)) if finding.sequences else None
        if places is None:
            written.append(finding.but(sequence_count=len(finding.sequences)))
            continue
        column = finding_column(index)
        arrays[column] = pa.array(places, pa.int32(), mask=places < 0)
        written.append(
            finding.but(
                sequences=list(finding.sequences[:SAMPLE]),
                sequence_count=len(finding.sequences),
                sequences_column=column,
            )
        )
    with replacing(path) as tmp:
        # the finding columns are mostly null or a run of places: no dictionaries for them
        pq.write_table(
            # the "lpx" key marks it as lpx's own: a later compare may replace it (paths.py)
            pa.table(arrays, metadata={"lpx": '{"table": "sequences", "format": 1}'}),
            tmp,
            compression="zstd",
            compression_level=1,
            use_dictionary=["sequence_id"],
        )
    return {"file": SEQUENCES, "rows": len(ids)}, written


def _places(named: list[str], row_of: dict[str, int], rows: int) -> np.ndarray | None:
    """Each row's place in the finding's list, -1 where it is not named; None when the list
    names an id twice or one without a row."""
    found = [row_of.get(sequence_id, -1) for sequence_id in named]
    chosen = np.asarray(found, dtype=np.int64)
    if (chosen < 0).any() or len(np.unique(chosen)) != len(chosen):
        return None
    places = np.full(rows, -1, dtype=np.int32)
    places[chosen] = np.arange(len(chosen), dtype=np.int32)
    return places
