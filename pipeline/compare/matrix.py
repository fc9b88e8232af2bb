"""Several replays against one rollout: one report with a row per engine pair."""

from __future__ import annotations

import json
import re
from pathlib import Path

from pipeline.compare.outputs import engine_label, write_outputs
from pipeline.compare.run import Comparison
from pipeline.contracts.causes import Cause, Status
from pipeline.contracts.files import REPORT, SUMMARY
from pipeline.contracts.metrics import MATRIX_METRICS
from pipeline.contracts.report import Finding, Report
from pipeline.paths import output_lock, write_text_atomic
from pipeline.text import for_markdown as _md


def pair_label(index: int, report: Report) -> str:
    """A directory-safe name for one pair, e.g. '2-megatron-tp2-float32'."""
    replay = report.metadata["replay"]
    layout = replay.get("layout") or {}
    parts = [str(index), (replay.get("engine") or {}).get("name", "replay")]
    if layout.get("tensor_parallel_size", 1) > 1:
        parts.append(f"tp{layout['tensor_parallel_size']}")
    if layout.get("world_size", 1) > 1:
        parts.append(f"ws{layout['world_size']}")
    parts.append(str(replay.get("dtype", "")))
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", "-".join(p for p in parts if p))


def write_matrix(comparisons: list[Comparison], out_dir: Path) -> dict:
    """Each pair's full outputs in its own directory, plus the matrix report and summary."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / REPORT).unlink(missing_ok=True)  # an earlier matrix verdict never outlives this one
    rows = []
    for index, comparison in enumerate(comparisons):
        report = comparison.report
        label = pair_label(index, report)
        paths = write_outputs(comparison, out_dir / label)
        fixture, replay = report.metadata["fixture"], report.metadata["replay"]
        rows.append(
            {
                "pair": label,
                "rollout": engine_label(fixture),
                "replay": engine_label(replay),
                "layout": replay.get("layout"),
                "verdict": report.verdict,
                "profile": report.policy["profile"],
                **{name: report.metrics.get(name) for name in MATRIX_METRICS},
                "bitwise_mismatches": report.metrics.get("bitwise_mismatches"),
                "findings": [str(f.cause) for f in report.diagnosis],
                "claims": [claim_text(f) for f in report.diagnosis],
                "report": str(paths["report"]),
            }
        )
    matrix = {
        "verdict": "fail" if any(r["verdict"] != "pass" for r in rows) else "pass",
        "exact": any(c.report.policy.get("exact") for c in comparisons),
        "pairs": rows,
        "metadata": {"fixture": comparisons[0].report.metadata["fixture"]["path"]},
    }
    with output_lock(out_dir):
        write_text_atomic(out_dir / SUMMARY, render_matrix(matrix))
        write_text_atomic(out_dir / REPORT, json.dumps(matrix, indent=1, default=str) + "\n")
    return matrix


def render_matrix(matrix: dict) -> str:
    lines = [f"# lpx compare matrix: {matrix['verdict'].upper()}", ""]
    if matrix.get("exact"):
        counts = ", ".join(
            f"{_md(row['pair'])}: {row['bitwise_mismatches']:,}" for row in matrix["pairs"]
        )
        lines += [f"Exact mode (--exact): a pair fails on any bitwise mismatch ({counts}).", ""]
    lines += [
        "| rollout | replay | layout | verdict | max abs d | mean abs d | p99 abs d | k3 | top-1 flips | findings |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in matrix["pairs"]:
        layout = row["layout"] or {}
        where = f"TP{layout.get('tensor_parallel_size', 1)} x{layout.get('world_size', 1)}"
        numbers = " | ".join(_fmt(row[name]) for name in MATRIX_METRICS)
        lines.append(
            f"| {_md(row['rollout'])} | {_md(row['replay'])} | {_md(where)} | "
            f"{row['verdict'].upper()} | {numbers} | {_md(', '.join(row.get('claims') or row['findings'])) or '-'} |"
        )
    return "\n".join(lines) + "\n"


def _fmt(value) -> str:
    return "-" if value is None else f"{value:.3g}"


def claim_text(finding: Finding) -> str:
    """`temperature (verified)`: a cause with its status, so a guess never reads as a fact."""
    if finding.cause == Cause.UNEXPLAINED:
        return str(finding.cause)
    return f"{finding.cause} ({(finding.status or Status.PLAUSIBLE).replace('_', ' ')})"
