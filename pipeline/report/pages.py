"""What each page of the report says, as plain dicts for the templates.

The index: status banner, open regressions with attribution, pass->fail changes since the
previous run, the engine x version matrix per key metric, every series with a sparkline.
A series page: a trend chart per metric with its band, change points and version changes.
A run page: each comparison's worst tokens, diagnosis, heatmap and how to reproduce it.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict

from pipeline.contracts.sequences import finding_count
from pipeline.history.attribution import stack_difference, summary
from pipeline.history.changepoints import change_points
from pipeline.history.claims import claim_of
from pipeline.history.detection import KEY_METRICS, factor, metric_spec
from pipeline.history.keys import numerics_label
from pipeline.report.data import HistoryData, SeriesData
from pipeline.report.localized import run_localize, series_localize

SPARK_POINTS = 90
SPARK_WIDTH, SPARK_HEIGHT = 160, 28
RECENT_RUNS = 30
FINDING_SEQUENCES = 12  # sequence ids named per finding on a run page; the rest are counted


def index_page(data: HistoryData) -> dict:
    latest_run = data.runs[data.run_order[-1]] if data.run_order else None
    active = [a for a in data.alerts if a.get("status") == "active"]
    # One step moves several metrics at once: the banner counts events (series + first bad
    # point), the tables list every metric's alert.
    events = defaultdict(set)
    for alert in active:
        events[alert["kind"]].add((alert["series_id"], alert["first_bad"].comparison_id))
    counts = {kind: len(found) for kind, found in events.items()}
    counts = defaultdict(int, counts)
    recent = [data.runs[i] for i in data.run_order[-RECENT_RUNS:]][::-1]
    return {
        "title": "lpx history",
        "latest_run": latest_run,
        "banner": {
            "regressions": counts["regression"],
            "policy_violations": counts["policy_violation"],
            "suspicious": counts["suspicious"],
            "errors": sum(1 for run in recent if run["status"] == "error"),
            "recent_runs": len(recent),
        },
        "regressions": [
            _alert_row(data, a) for a in active if a["kind"] in ("regression", "policy_violation")
        ],
        "suspicious": [_alert_row(data, a) for a in active if a["kind"] == "suspicious"],
        "decided": [
            _alert_row(data, a)
            for a in data.alerts
            if a.get("status") in ("acknowledged", "silenced")
        ][::-1],
        "changes": status_changes(data),
        "matrices": version_matrices(data),
        "series": [_series_row(data, s) for s in data.series.values() if s.points],
        "runs": recent,
        "engines": sorted(
            {e for s in data.series.values() for e in (s.rollout_engine, s.replay_engine)}
        ),
        "dtypes": sorted(
            {d for s in data.series.values() for d in (s.rollout_dtype, s.replay_dtype)}
        ),
        "key_metrics": [m for m in KEY_METRICS if m in data.metric_names],
    }


def series_page(data: HistoryData, series: SeriesData) -> dict:
    """A trend chart per metric: values, band, statuses, change points, version changes."""
    points = series.points
    runs = [
        {
            "run": p.run_id,
            "at": p.at,
            "verdict": p.verdict,
            "rollout": _build_name(data.builds[p.rollout_build]),
            "replay": _build_name(data.builds[p.replay_build]),
        }
        for p in points
    ]
    charts = {}
    for name in data.metric_names:
        rows = [p.metrics.get(name) for p in points]
        if not any(rows):
            continue
        values = [_short(r[0]) if r else None for r in rows]
        lower = [_short(r[2]) if r else None for r in rows]
        if metric_spec(name).better == "lower" and all(v is None or v >= 0 for v in values):
            # only the upper edge judges a lower-is-better metric: draw the band from 0
            lower = [None if v is None else max(v, 0.0) for v in lower]
        charts[name] = {
            "unit": metric_spec(name).unit,
            "better": metric_spec(name).better,
            "values": values,
            "status": [r[1] if r else None for r in rows],
            "lower": lower,
            "upper": [_short(r[3]) if r else None for r in rows],
            "changepoints": change_points(values) if metric_spec(name).detect else [],
        }
    version_changes = [
        {
            "index": i,
            "text": build_change(data, points[i - 1], points[i])
            + (f"; tokens: {workload_line(points[i].workload)}" if points[i].workload else ""),
        }
        for i in range(1, len(points))
        if (points[i].rollout_build, points[i].replay_build)
        != (points[i - 1].rollout_build, points[i - 1].replay_build)
        and (runs[i]["rollout"], runs[i]["replay"])
        != (runs[i - 1]["rollout"], runs[i - 1]["replay"])
    ]
    localize, localize_chart = series_localize(series, runs)
    if localize_chart is not None:
        charts_with_localize = {**charts, localize["chart"]: localize_chart}
    else:
        charts_with_localize = charts
    return {
        "title": series.label,
        "series": series,
        "localize": localize,
        "alerts": [_alert_row(data, a) for a in data.alerts if a["series_id"] == series.id][::-1],
        "annotations": [a for a in data.annotations if a["series_id"] == series.id],
        "bisects": data.bisects.get(
            (series.case_key, series.rollout_engine, series.replay_engine), []
        ),
        "chart_data": {
            "runs": runs,
            "charts": charts_with_localize,
            "version_changes": version_changes,
            "annotations": [
                {"index": i, "kind": a["kind"], "reason": a["reason"]}
                for a in data.annotations
                if a["series_id"] == series.id
                for i, p in enumerate(points)
                if p.run_id == a["run"]
            ],
        },
        "metric_names": list(charts),
        "key_metrics": [m for m in KEY_METRICS if m in charts],
        "recent": [
            {
                **runs[i],
                "metrics": points[i].metrics,
                "findings": points[i].findings,
                "workload": workload_line(points[i].workload),
            }
            for i in range(len(points) - 1, max(-1, len(points) - 31), -1)
        ],
    }


def workload_line(workload: dict | None) -> str:
    """A point's tokens against the series' previous night, in one line."""
    agreement = (workload or {}).get("agreement")
    if not agreement:
        return "–"
    if agreement.get("same_tokens"):
        return "same tokens"
    if "why" in agreement:
        return agreement["why"]
    text = (
        f"{agreement['fraction_in_common']:.0%} of tokens in common, "
        f"{agreement['sequences_identical']}/{agreement['sequences']} sequences identical"
    )
    first = agreement.get("first_divergence")
    if first:
        text += f", first divergence {first['sequence_id']} @ {first['position']}"
    shared = agreement.get("shared")
    if shared:
        before, after = shared["previous"], shared["current"]
        text += (
            f"; shared tokens mean |d| {before['mean_abs_diff']:.3g} -> "
            f"{after['mean_abs_diff']:.3g}"
        )
        new = agreement.get("new_tokens")
        if new:
            text += f", new tokens {new['mean_abs_diff']:.3g}"
    return text


def run_page(
    data: HistoryData, run_id: int, comparisons: list, localize_rows: dict | None = None
) -> dict:
    run = data.runs[run_id]
    position = data.run_order.index(run_id)
    rows = []
    for comparison in comparisons:
        series, point = data.point_index.get(comparison.id, (None, None))
        details = comparison.details or {}
        rows.append(
            {
                "id": comparison.id,
                "pair": comparison.pair,
                "series": series,
                "verdict": comparison.verdict,
                "profile": comparison.profile,
                "tau": comparison.tau,
                "tokens": comparison.tokens,
                "rollout": data.builds[comparison.rollout_build_id],
                "replay": data.builds[comparison.replay_build_id],
                "metrics": point.metrics if point else {},
                "violations": comparison.violations or [],
                "details": details,
                "findings": finding_rows(details.get("diagnosis")),
                "verification": verification_line(details.get("verification")),
                "routing": details.get("routing"),
                "correction": details.get("correction"),
                "onset": details.get("onset"),
                "numerics": details.get("numerics") or {},
                "localize": run_localize(comparison, (localize_rows or {}).get(comparison.id, [])),
            }
        )
    return {
        "title": f"run {run_id}",
        "run": run,
        # what lpx.js draws per comparison: the metric table, worst tokens, heatmap, reproduce
        "details": {
            f"c{row['id']}": {
                "metrics": [
                    [name, *values[:2], *values[2:4]] for name, values in row["metrics"].items()
                ],
                "worst": row["details"].get("worst", []),
                "decoded": row["details"].get("decoded", False),
                "heatmap": row["details"].get("heatmap"),
                "reproduce": row["details"].get("reproduce", {}),
            }
            for row in rows
        },
        "previous": data.run_order[position - 1] if position > 0 else None,
        "next": data.run_order[position + 1] if position + 1 < len(data.run_order) else None,
        "comparisons": rows,
        "alerts": [
            _alert_row(data, a)
            for a in data.alerts
            if a.get("latest") is not None and a["latest"].run_id == run_id
        ],
    }


def finding_rows(diagnosis) -> list[dict]:
    """A run page's diagnosis: each finding's claim (its status, worded as sure as it is),
    where it starts, its residuals when it was re-scored, and its evidence."""
    rows = []
    for finding in diagnosis or []:
        if not isinstance(finding, dict):
            continue
        where = []
        sequences = finding.get("sequences")
        # report.json's schema checks a finding's cause only: the rest is shown as it can be
        sequences = [str(s) for s in sequences] if isinstance(sequences, list) else []
        if sequences:
            shown = ", ".join(sequences[:FINDING_SEQUENCES])
            more = finding_count(finding) - FINDING_SEQUENCES
            where.append(f"sequences {shown}" + (f" and {more:,} more" if more > 0 else ""))
        first = finding.get("first_position")
        if isinstance(first, dict) and first.get("position") is not None:
            where.append(f"from position {first['position']} of {first.get('sequence_id', '?')}")
        rows.append(
            {
                "claim": claim_of(finding),
                "where": " · ".join(where),
                "residuals": _residuals(finding),
                "evidence": str(finding.get("evidence") or ""),
            }
        )
    return rows


def verification_line(note) -> str:
    """Whether compare re-scored the findings (report.json's `verification`), in words."""
    if not isinstance(note, dict) or not note:
        return ""
    if note.get("ran"):
        return f"findings re-scored with {note.get('model') or 'the model'}"
    reason = note.get("reason") or "no reason recorded"
    return f"not run ({reason}): findings that were not re-scored stay plausible"


def _residuals(finding: dict) -> str:
    """`mean |d| 0.21 -> 0.004 (floor 0.003)` for a finding that was re-scored."""
    before, after, floor = (finding.get(k) for k in ("residual_before", "residual_after", "floor"))
    if not all(isinstance(v, int | float) for v in (before, after)):
        return ""
    text = f"re-scored: mean |d| {before:.3g} -> {after:.3g}"
    return text + (f" (floor {floor:.3g})" if isinstance(floor, int | float) else "")


def status_changes(data: HistoryData) -> list[dict]:
    """Series whose verdict changed at the latest run, against their previous point."""
    if not data.run_order:
        return []
    latest = data.run_order[-1]
    changes = []
    for series in data.series.values():
        if len(series.points) < 2 or series.points[-1].run_id != latest:
            continue
        before, after = series.points[-2], series.points[-1]
        if before.verdict != after.verdict:
            changes.append(
                {
                    "series": series,
                    "from": before.verdict,
                    "to": after.verdict,
                    "previous_run": before.run_id,
                    "run": after.run_id,
                    "findings": after.findings,
                }
            )
    return sorted(changes, key=lambda c: c["to"] == "pass")


def version_matrices(data: HistoryData) -> list[dict]:
    """Per key metric and dtype profile: engine (and role, and the reduced-precision
    numerics it declares: an FP8 rollout is a row of its own) x version -> the worst pair.

    A cell is the largest per-series median of the metric among the series that ran that
    engine build: one drifting pair shows even when other pairs on the same build are flat.
    It is flagged when any of its points failed the policy or left its band."""
    cells = defaultdict(lambda: defaultdict(list))  # (metric, profile, role, engine, version)
    flagged = set()
    for series in data.series.values():
        for p in series.points:
            for role, build_id in (("rollout", p.rollout_build), ("replay", p.replay_build)):
                build = data.builds[build_id]
                numerics = numerics_label(series.case.get(f"{role}_numerics"))
                for metric in KEY_METRICS:
                    value, status = (p.metrics.get(metric) or (None, None))[:2]
                    if value is None:
                        continue
                    key = (metric, p.profile, role, build["engine"], numerics, build["version"])
                    cells[key][series.id].append(value)
                    if p.verdict != "pass" or status in ("suspicious", "regression"):
                        flagged.add(key)
    matrices = defaultdict(lambda: defaultdict(dict))
    for key, by_series in cells.items():
        metric, profile, role, engine, numerics, version = key
        worst_series, worst = max(
            ((sid, statistics.median(values)) for sid, values in by_series.items()),
            key=lambda item: item[1],
        )
        matrices[(metric, profile)][(role, engine, numerics)][version] = {
            "median": worst,
            "series": data.series[worst_series],
            "n": sum(len(values) for values in by_series.values()),
            "pairs": len(by_series),
            "fail": key in flagged,
        }
    return [
        {
            "metric": metric,
            "profile": profile,
            "rows": [
                {
                    "role": role,
                    "engine": engine,
                    "numerics": numerics,
                    "versions": list(versions.items()),
                }
                for (role, engine, numerics), versions in sorted(rows.items())
            ],
        }
        for (metric, profile), rows in sorted(matrices.items())
    ]


def sparkline(values: list) -> str:
    """SVG polyline points for the last SPARK_POINTS finite values (log scale for drifts)."""
    finite = [v for v in values if v is not None and math.isfinite(v)][-SPARK_POINTS:]
    if len(finite) < 2:
        return ""
    scaled = [math.log10(max(v, 1e-12)) if min(finite) > 0 else v for v in finite]
    low, high = min(scaled), max(scaled)
    span = (high - low) or 1.0
    step = SPARK_WIDTH / (len(scaled) - 1)
    return " ".join(
        f"{i * step:.1f},{SPARK_HEIGHT - 2 - (v - low) / span * (SPARK_HEIGHT - 4):.1f}"
        for i, v in enumerate(scaled)
    )


def _series_row(data: HistoryData, series: SeriesData) -> dict:
    latest = series.points[-1]
    return {
        "series": series,
        "latest": latest,
        "latest_run": data.runs.get(latest.run_id),
        "open_alerts": sum(
            1 for a in data.alerts if a["series_id"] == series.id and a["status"] == "active"
        ),
        "sparks": {
            metric: {
                "points": sparkline([(p.metrics.get(metric) or (None,))[0] for p in series.points]),
                "latest": (latest.metrics.get(metric) or (None,))[0],
                "status": (latest.metrics.get(metric) or (None, None))[1],
            }
            for metric in KEY_METRICS
        },
    }


def _alert_row(data: HistoryData, alert: dict) -> dict:
    series = data.series[alert["series_id"]]
    last_good, first_bad = alert["last_good"], alert["first_bad"]
    return {
        **alert,
        "series": series,
        "last_good_build": _pair_builds(data, last_good),
        "first_bad_build": _pair_builds(data, first_bad),
        "factor": factor(alert["value_before"], alert["value_after"]),
        "change_summary": summary(alert["attribution"]) if last_good else "no healthy point before",
        "causes": first_bad.findings if first_bad else [],
    }


def _pair_builds(data: HistoryData, point) -> str:
    if point is None:
        return ""
    return f"{_build_name(data.builds[point.rollout_build])} / {_build_name(data.builds[point.replay_build])}"


def _build_name(build: dict) -> str:
    return f"{build['engine']} {build['version']}"


def build_change(data: HistoryData, before, after) -> str:
    """What changed between two points' builds, each side that changed once, the stack parts
    both builds share in brackets: 'rollout hf 5.20.0 -> 5.21.0 (torch 2.13.0+cpu)'."""
    parts = []
    for side, old, new in (
        ("rollout", before.rollout_build, after.rollout_build),
        ("replay", before.replay_build, after.replay_build),
    ):
        old, new = data.builds[old], data.builds[new]
        if (old["engine"], old["version"]) == (new["engine"], new["version"]):
            continue
        was, now, shared = stack_difference(old["version"], new["version"])
        engine = (
            new["engine"]
            if old["engine"] == new["engine"]
            else f"{old['engine']} -> {new['engine']}"
        )
        parts.append(f"{side} {engine} {was} -> {now}" + (f" ({shared})" if shared else ""))
    return "; ".join(parts) or "build (image, CUDA or driver) changed"


def _short(value):
    """4 significant digits: what a chart shows, at a third of the bytes of repr()."""
    if value is None or not math.isfinite(value):
        return None
    return float(f"{value:.4g}")
