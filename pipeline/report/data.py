"""Load the whole history once, in a few bulk queries, into plain structures the pages use.

A year of nightlies is ~400k metric values: they are read as tuples in one query and
grouped per series here, rather than queried page by page.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sqlalchemy import select
from sqlalchemy.orm import Session

from pipeline.db.models import (
    Alert,
    Annotation,
    Case,
    Comparison,
    EngineBuild,
    LocalizeBoundary,
    MetricValue,
    Run,
    Series,
    Testbed,
)
from pipeline.history.bisects import bisects_by_series
from pipeline.history.claims import Claim, claims_of
from pipeline.history.evaluate import build_as_dict
from pipeline.history.queries import run_row


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


def load_history(session: Session) -> HistoryData:
    runs = {}
    for run in session.scalars(select(Run).order_by(Run.started_at, Run.id)):
        runs[run.id] = run_row(run)
    builds = {b.id: build_as_dict(b) for b in session.scalars(select(EngineBuild))}
    series = {}
    for s, case, testbed in session.execute(
        select(Series, Case, Testbed)
        .join(Case, Case.id == Series.case_id)
        .join(Testbed, Testbed.id == Series.testbed_id)
        .order_by(Series.id)
    ):
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
            },
            case_key=case.key,
        )
    points, point_index = {}, {}
    for row in session.execute(
        select(
            Comparison.id,
            Comparison.series_id,
            Comparison.run_id,
            Comparison.started_at,
            Comparison.verdict,
            Comparison.profile,
            Comparison.pair,
            Comparison.rollout_build_id,
            Comparison.replay_build_id,
            Comparison.findings,
            Comparison.localize_verdict,
            Comparison.localize_boundary,
            Comparison.localize,
        ).order_by(Comparison.started_at, Comparison.id)
    ):
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
        )
        points[row.id] = point
        target = series[row.series_id]
        point_index[row.id] = (target, point)
        target.points.append(point)
        target.profile = row.profile or target.profile
        if row.localize_boundary:
            target.localize_boundary = row.localize_boundary
    _load_tracked_boundaries(session, series, points)
    names = set()
    for row in session.execute(
        select(
            MetricValue.comparison_id,
            MetricValue.name,
            MetricValue.value,
            MetricValue.status,
            MetricValue.lower,
            MetricValue.upper,
            MetricValue.baseline,
        )
    ):
        points[row[0]].metrics[row[1]] = row[2:]
        names.add(row[1])
    alerts = []
    for alert in session.scalars(select(Alert).order_by(Alert.id)):
        alerts.append(
            {
                "id": alert.id,
                "series_id": alert.series_id,
                "metric": alert.metric,
                "kind": alert.kind,
                "status": alert.status,
                "first_bad": points.get(alert.first_bad_id),
                "last_good": points.get(alert.last_good_id),
                "latest": points.get(alert.latest_id),
                "value_before": alert.value_before,
                "value_after": alert.value_after,
                "rule": alert.rule,
                "attribution": alert.attribution or [],
                "note": alert.note,
                "updated_at": alert.updated_at.isoformat(timespec="seconds"),
            }
        )
    annotations = [
        {
            "id": a.id,
            "series_id": a.series_id,
            "run": a.run_id,
            "kind": a.kind,
            "reason": a.reason,
            "created_at": a.created_at.isoformat(timespec="seconds"),
        }
        for a in session.scalars(select(Annotation).order_by(Annotation.id))
    ]
    return HistoryData(
        runs,
        list(runs),
        series,
        builds,
        alerts,
        annotations,
        sorted(names, key=_metric_order),
        point_index,
        bisects_by_series(session),
    )


def run_comparisons(session: Session, run_id: int) -> list[Comparison]:
    """One run's comparisons with their details (worst tokens, heatmap): per run page."""
    return list(
        session.scalars(
            select(Comparison).where(Comparison.run_id == run_id).order_by(Comparison.pair)
        )
    )


def run_localize_rows(session: Session, comparisons: list[Comparison]) -> dict[int, list[dict]]:
    """The boundary rows of a run's localized comparisons, in network order (as recorded)."""
    ids = [c.id for c in comparisons if c.localize_verdict in ("clean", "localized", "verified")]
    rows: dict[int, list[dict]] = {}
    if not ids:
        return rows
    for row in session.scalars(
        select(LocalizeBoundary)
        .where(LocalizeBoundary.comparison_id.in_(ids))
        .order_by(LocalizeBoundary.id)
    ):
        rows.setdefault(row.comparison_id, []).append(
            {
                "boundary": row.boundary,
                "layer": row.layer,
                "kind": row.kind,
                "drift_max": row.drift_max,
                "drift_rms": row.drift_rms,
                "floor_max": row.floor_max,
                "floor_rms": row.floor_rms,
                "ratio": row.ratio,
                "beyond": row.beyond,
            }
        )
    return rows


def _load_tracked_boundaries(session: Session, series: dict, points: dict) -> None:
    """Each series' tracked boundary (the one its latest localized point names), at every
    point that localized: one query for the whole history, for those boundaries only."""
    tracked = {s.id: s.localize_boundary for s in series.values() if s.localize_boundary}
    if not tracked:
        return
    for row in session.execute(
        select(
            LocalizeBoundary.comparison_id,
            LocalizeBoundary.series_id,
            LocalizeBoundary.boundary,
            LocalizeBoundary.ratio,
            LocalizeBoundary.beyond,
        ).where(LocalizeBoundary.boundary.in_(set(tracked.values())))
    ):
        if tracked.get(row.series_id) == row.boundary and row.comparison_id in points:
            points[row.comparison_id].localize_tracked = (row.ratio, row.beyond)


def _metric_order(name: str):
    from pipeline.history.detection import CATALOG

    order = list(CATALOG)
    base = name.split(".")[-1]
    return (name.count("."), order.index(base) if base in order else len(order), name)
