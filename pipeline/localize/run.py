"""`lpx localize`: capture both sides, measure the floors, name the first boundary beyond them,
verify it by swapping, and write localize.json (and the chart beside it).

The forwards and both rules are judge.py's; `--exact` (exact.py) compares bits and measures no
floor. Only one boundary's rows are in memory at a time besides the forward itself.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline.contracts.files import LOCALIZE as RESULT_FILE
from pipeline.errors import BadInput
from pipeline.localize import exact as bitwise
from pipeline.localize import swap
from pipeline.localize.adapters import open_side
from pipeline.localize.boundaries import in_order
from pipeline.localize.judge import judged_rows
from pipeline.localize.store import CaptureStore
from pipeline.localize.verdict import MARGIN, first_beyond

if TYPE_CHECKING:
    from pipeline.contracts.report import Report

SCHEMA_VERSION = 1
FORMAT_MARKER = "lpx_localize"  # says lpx wrote it: a rerun may replace it (paths.py)
CHART_FILE = "localize.svg"
CAPTURES = "captures"
OUTPUTS = (RESULT_FILE, CHART_FILE, CAPTURES)  # what a run writes or removes in --out
DEFAULT_SEQUENCES = 4


def choose_sequences(table, wanted: list[str], report: Report | None, count: int) -> list[int]:
    """Row indices to localize: the ones asked for; else the worst of a failing comparison's
    report; else `count` spread over the fixture."""
    index = table.index_of()
    if wanted:
        missing = [s for s in wanted if s not in index]
        if missing:
            raise BadInput(
                f"sequence id(s) {', '.join(missing[:5])} are not in the fixture; "
                f"it has {', '.join(table.sequence_ids[:5])}{' ...' if len(index) > 5 else ''}."
            )
        return [index[s] for s in dict.fromkeys(wanted)]
    if report is not None and report.sequences:
        scored = [
            (_drift(row.get("max_abs_diff")), row.get("sequence_id"))
            for row in report.sequences
            if row.get("sequence_id") in index
        ]
        scored.sort(key=lambda pair: -pair[0])
        if scored:
            return [index[s] for _, s in scored[:count]]
    total = table.num_sequences
    step = max(1, total // max(count, 1))
    return list(range(0, total, step))[:count]


def localize(
    table,
    model_dir: Path,
    spec_a: str,
    spec_b: str,
    rows_wanted: list[int],
    out_dir: Path,
    device: str = "cpu",
    model_dir_b: Path | None = None,
    keep_captures: bool = False,
    exact: bool = False,
    floor_cache: bool = True,
) -> dict:
    """Localize where side A and side B part on the table's `rows_wanted`.

    `exact`: the first boundary not bitwise equal (no floors); `floor_cache`: take and keep
    each side's floors in the floor cache (floor_cache.py)."""
    started = time.perf_counter()
    side_a = open_side(spec_a, model_dir, device=device)
    side_b = open_side(spec_b, model_dir_b or model_dir, device=device)
    store = CaptureStore(out_dir / CAPTURES)
    about = {}
    try:
        names = _common_boundaries(side_a, side_b)
        sequences = [(table.sequence_ids[row], _token_ids(table, row)) for row in rows_wanted]
        if exact:
            tallies = bitwise.measure(side_a, side_b, sequences, names, store)
            rows = bitwise.exact_rows(names, tallies)
            first = first_beyond(rows)
            verification = (
                bitwise.verify(side_a, side_b, sequences, names, first, store)
                if first is not None
                else None
            )
        else:
            sides = {"a": side_a, "b": side_b}
            places = {"a": (spec_a, model_dir), "b": (spec_b, model_dir_b or model_dir)}
            rows, about = judged_rows(
                sides, places, device, sequences, names, store, use_cache=floor_cache
            )
            first = first_beyond(rows)
            verification = (
                swap.verify(side_a, side_b, sequences, rows, first, store)
                if first is not None
                else None
            )
    finally:
        side_a.close()
        side_b.close()
        if not keep_captures:
            store.remove()
    verdict = (
        "clean"
        if first is None
        else ("verified" if verification and verification["verified"] else "localized")
    )
    return {
        FORMAT_MARKER: SCHEMA_VERSION,
        "schema_version": SCHEMA_VERSION,
        "verdict": verdict,
        "first": _first_summary(first),
        "verification": verification,
        "mode": "exact" if exact else "floors",
        # exact: any element differing is beyond (a row's ratio is the share that differs)
        "margin": 0.0 if exact else MARGIN,
        **about,
        "sides": {
            "a": {"spec": spec_a, **side_a.layout, "reference_dtype": side_a.reference_dtype},
            "b": {"spec": spec_b, **side_b.layout, "reference_dtype": side_b.reference_dtype},
        },
        "sequences": [sequence_id for sequence_id, _ in sequences],
        "tokens": sum(len(ids) for _, ids in sequences),
        "boundaries": rows,
        "seconds": round(time.perf_counter() - started, 2),
    }


def _drift(value) -> float:
    """A report's per-sequence max |d| for ranking: compare writes a NaN or inf as a string,
    and a sequence whose drift is NaN is as broken as one can be (it ranks first)."""
    try:
        drift = float(value or 0.0)
    except (TypeError, ValueError):
        return 0.0
    return math.inf if math.isnan(drift) else drift


def write(result: dict, out_dir: Path) -> Path:
    """localize.json, checked by the model `lpx record` reads it with (a writer's bug fails
    here, not in tomorrow's record), and its chart."""
    from pipeline.contracts.localize import LocalizeResult
    from pipeline.localize.chart import drift_chart
    from pipeline.paths import write_text_atomic

    LocalizeResult.model_validate(result)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / RESULT_FILE
    write_text_atomic(path, json.dumps(result, indent=1, allow_nan=False) + "\n")
    write_text_atomic(out_dir / CHART_FILE, drift_chart(result))
    return path


def _common_boundaries(side_a, side_b) -> list[str]:
    a, b = set(side_a.boundaries), set(side_b.boundaries)
    common = in_order(a & b)
    if not common:
        raise BadInput(
            f"{side_a.name} and {side_b.name} share no boundary; they do not run the same model."
        )
    return common


def _token_ids(table, row: int) -> list[int]:
    return [int(t) for t in table.prompt_of(row)] + [int(t) for t in table.completion_of(row)]


def _first_summary(first: dict | None) -> dict | None:
    if first is None:
        return None
    summary = {key: first[key] for key in ("boundary", "layer", "kind", "ratio")} | {
        "drift": first["drift"],
        "floor": first["floor"],
    }
    for key in ("beyond_by", "local", "differing", "elements", "first_difference"):
        if key in first:
            summary[key] = first[key]
    return summary
