"""Load the whole history once, in a few bulk queries, into plain structures the pages use.

A year of nightlies is ~400k metric values: they are read as tuples in one query and
grouped per series here, rather than queried page by page. The queries themselves are in
pipeline/history/queries.py (the terminal's views read the same rows); this module only
shapes what they return.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeline.history import queries
from pipeline.history.bisects import bisects_by_series
from pipeline.history.claims import Claim, claims_of

# site.py reads each run page's rows through this module, as it reads the whole history.


@dataclass
class Point:
    comparison_id: int
    run_id: int
    at: str
    verdict: str
    profile: str
    pair: str
    rollout_build: int
    replay_build: int
    findings: list[Claim]  # each finding's cause with its status (never a bare cause)
    metrics: dict[str, tuple] = field(default_factory=dict)  # name -> (value, status, lo, up, base)
    localize: str | None = None  # the pair's localize verdict, when one ran
    localize_boundary: str | None = None  # its first boundary beyond the floor
    # the token digest and the agreement with the previous night (history/workload.py)
    workload: dict | None = None
    localize_first_ratio: float | None = None
    localize_margin: float | None = None  # beyond = ratio past it
    # (ratio, beyond) at the boundary its series tracks (the latest localized one)
    localize_tracked: tuple[float, bool] | None = None


@dataclass
class SeriesData:
    id: int
    key: str
    label: str
    rollout_engine: str
    replay_engine: str
    rollout_dtype: str
    replay_dtype: str
    profile: str
    model: str
    testbed: str
    case: dict
    points: list[Point] = field(default_factory=list)
    localize_boundary: str | None = None  # the boundary its latest localized point names
    case_key: str = ""  # its bisects are found by it (pipeline/history/bisects.py)


@dataclass
class HistoryData:
    runs: dict[int, dict]
    run_order: list[int]  # oldest first
    series: dict[int, SeriesData]
    builds: dict[int, dict]
    alerts: list[dict]
    annotations: list[dict]
    metric_names: list[str]
    point_index: dict[int, tuple[SeriesData, Point]] = field(default_factory=dict)
    # (case key, rollout engine, replay engine) -> that pair's bisects, newest first
    bisects: dict[tuple, list[dict]] = field(default_factory=dict)


def load_history(session) -> HistoryData:
    """The whole history from one read session (site.py's snapshot), in bulk queries. The
    session goes unannotated: naming its type would import the database layer here."""
    runs = {run["id"]: run for run in queries.runs_oldest_first(session)}
    builds = queries.builds_by_id(session)
    series = _load_series(session)
    points, point_index = _load_points(session, series)
    _load_tracked_boundaries(session, series, points)
    names = _load_metrics(session, points)
    alerts = [
        queries.alert_row(alert, series[alert.series_id].label, points)
        for alert in queries.every_alert(session)
    ]
    return HistoryData(
        runs,
        list(runs),
        series,
        builds,
        alerts,
        queries.annotations(session),
        sorted(names, key=_metric_order),
        point_index,
        bisects_by_series(session),
    )


def _load_series(session) -> dict[int, SeriesData]:
    """Every series, by id, with no points yet (_load_points adds them)."""
    series = {}
    for s, case, testbed in queries.series_cases_and_testbeds(session):
        series[s.id] = SeriesData(
            s.id,
            s.key[:12],
            s.label,
            s.rollout_engine,
            s.replay_engine,
            case.rollout_dtype,
            case.replay_dtype,
            "",
            case.label,
            testbed.name,
            {
                "model": case.model,
                "weights_fingerprint": case.weights_fingerprint,
                "tokenizer_fingerprint": case.tokenizer_fingerprint,
                "prompt_set": case.prompt_set,
                "channel": case.channel,
                "knobs": case.knobs,
                "layout": case.layout,
                "rollout_numerics": case.rollout_numerics,
                "replay_numerics": case.replay_numerics,
            },
            case_key=case.key,
        )
    return series


def _load_points(session, series: dict[int, SeriesData]) -> tuple[dict, dict]:
    """Every comparison as a point, appended to its series oldest first: (points by
    comparison id, comparison id -> (series, point)). A series takes the profile and the
    localize boundary of its latest point that has one."""
    points, point_index = {}, {}
    for row in queries.comparison_points(session):
        point = Point(
            row.id,
            row.run_id,
            row.started_at.isoformat(timespec="seconds"),
            row.verdict,
            row.profile,
            row.pair,
            row.rollout_build_id,
            row.replay_build_id,
            claims_of(row.findings),
            localize=row.localize_verdict,
            localize_boundary=row.localize_boundary,
            localize_first_ratio=((row.localize or {}).get("first") or {}).get("ratio"),
            localize_margin=(row.localize or {}).get("margin"),
            workload=row.workload,
        )
        points[row.id] = point
        target = series[row.series_id]
        point_index[row.id] = (target, point)
        target.points.append(point)
        target.profile = row.profile or target.profile
        if row.localize_boundary:
            target.localize_boundary = row.localize_boundary
    return points, point_index


def _load_tracked_boundaries(session, series: dict, points: dict) -> None:
    """Each series' tracked boundary (the one its latest localized point names), at every
    point that localized: one query for the whole history, for those boundaries only."""
    tracked = {s.id: s.localize_boundary for s in series.values() if s.localize_boundary}
    if not tracked:
        return
    for row in queries.boundary_ratios(session, set(tracked.values())):
        if tracked.get(row.series_id) == row.boundary and row.comparison_id in points:
            points[row.comparison_id].localize_tracked = (row.ratio, row.beyond)


def _load_metrics(session, points: dict) -> set[str]:
    """Each point's metric values, as (value, status, lower, upper, baseline) by name;
    returns every metric name seen."""
    names = set()
    for row in queries.metric_values(session):
        points[row[0]].metrics[row[1]] = row[2:]
        names.add(row[1])
    return names


def _metric_order(name: str):
    from pipeline.history.detection import CATALOG

    order = list(CATALOG)
    base = name.split(".")[-1]
    return (name.count("."), order.index(base) if base in order else len(order), name)
