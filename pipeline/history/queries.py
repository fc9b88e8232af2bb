"""Read the history as plain rows (dicts): what `lpx history` prints and the report renders."""

from __future__ import annotations

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from pipeline.db.models import (
    Alert,
    Case,
    Comparison,
    EngineBuild,
    MetricValue,
    Run,
    Series,
    Testbed,
)
from pipeline.history.claims import claims_of
from pipeline.history.evaluate import build_as_dict


def runs(session: Session, limit: int | None = None) -> list[dict]:
    query = select(Run).order_by(Run.started_at.desc(), Run.id.desc())
    if limit:
        query = query.limit(limit)
    counts = dict(
        session.execute(select(Comparison.run_id, func.count()).group_by(Comparison.run_id)).all()
    )
    return [
        {**run_row(run), "comparisons": counts.get(run.id, 0)} for run in session.scalars(query)
    ]


def run_row(run: Run) -> dict:
    """A run as the terminal, the JSON output and the report show it."""
    return {
        "id": run.id,
        "key": run.key[:12],
        "kind": run.kind,
        "status": run.status,
        "started_at": run.started_at.isoformat(timespec="seconds"),
        "ended_at": run.ended_at.isoformat(timespec="seconds") if run.ended_at else None,
        "trigger": run.trigger,
        "lpx_version": run.lpx_version,
        "lpx_revision": run.lpx_revision,
        "command_line": run.command_line,
        "run_dir": run.run_dir,
        "errors": run.errors or [],
        "testbed": (run.manifest or {}).get("testbed") or {},
    }


def series(session: Session) -> list[dict]:
    """Every series with its case, testbed and latest point."""
    latest = (
        select(Comparison.series_id, func.max(Comparison.id).label("comparison_id"))
        .group_by(Comparison.series_id)
        .subquery()
    )
    rows = session.execute(
        select(Series, Case, Testbed, Comparison)
        .join(Case, Case.id == Series.case_id)
        .join(Testbed, Testbed.id == Series.testbed_id)
        .join(latest, latest.c.series_id == Series.id)
        .join(Comparison, Comparison.id == latest.c.comparison_id)
        .order_by(Series.id)
    ).all()
    open_alerts = dict(
        session.execute(
            select(Alert.series_id, func.count())
            .where(Alert.status == "active")
            .group_by(Alert.series_id)
        ).all()
    )
    counts = dict(
        session.execute(
            select(Comparison.series_id, func.count()).group_by(Comparison.series_id)
        ).all()
    )
    return [
        {
            "id": s.id,
            "key": s.key[:12],
            "label": s.label,
            "rollout_engine": s.rollout_engine,
            "replay_engine": s.replay_engine,
            "rollout_dtype": case.rollout_dtype,
            "replay_dtype": case.replay_dtype,
            "model": case.label,
            "testbed": testbed.name,
            "points": counts.get(s.id, 0),
            "latest_run": latest_point.run_id,
            "latest_verdict": latest_point.verdict,
            "latest_findings": findings_of(latest_point.findings),
            "open_alerts": open_alerts.get(s.id, 0),
        }
        for s, case, testbed, latest_point in rows
    ]


def alerts(session: Session, statuses: tuple[str, ...] = ("active",)) -> list[dict]:
    query = (
        select(Alert, Series.label)
        .join(Series, Series.id == Alert.series_id)
        .order_by(Alert.id.desc())
    )
    if statuses:
        query = query.where(Alert.status.in_(statuses))
    points = {}
    found = session.execute(query).all()
    ids = {
        i
        for alert, _ in found
        for i in (alert.first_bad_id, alert.last_good_id, alert.latest_id)
        if i
    }
    if ids:
        for row in session.execute(
            select(Comparison.id, Comparison.run_id, Run.started_at, Comparison.findings)
            .join(Run, Run.id == Comparison.run_id)
            .where(Comparison.id.in_(ids))
        ):
            points[row.id] = {
                "run": row.run_id,
                "at": row.started_at.isoformat(timespec="seconds"),
                "findings": findings_of(row.findings),
            }
    return [
        {
            "id": alert.id,
            "series_id": alert.series_id,
            "series": label,
            "metric": alert.metric,
            "kind": alert.kind,
            "status": alert.status,
            "last_good": points.get(alert.last_good_id),
            "first_bad": points.get(alert.first_bad_id),
            "latest": points.get(alert.latest_id),
            "value_before": alert.value_before,
            "value_after": alert.value_after,
            "rule": alert.rule,
            "attribution": alert.attribution or [],
            "note": alert.note,
            "created_at": alert.created_at.isoformat(timespec="seconds"),
        }
        for alert, label in found
    ]


def series_points(session: Session, series_id: int) -> list[dict]:
    """One series over time: each point's run, builds, verdict and metric values with their
    boundaries (the indexed series_id + started_at query)."""
    comparisons = session.execute(
        select(Comparison, Run.kind, Run.status)
        .join(Run, Run.id == Comparison.run_id)
        .where(Comparison.series_id == series_id)
        .order_by(Comparison.started_at, Comparison.id)
    ).all()
    metrics: dict[int, dict] = {}
    for value in session.scalars(
        select(MetricValue)
        .where(MetricValue.series_id == series_id)
        .order_by(MetricValue.started_at, MetricValue.id)
    ):
        metrics.setdefault(value.comparison_id, {})[value.name] = {
            "value": value.value,
            "status": value.status,
            "baseline": value.baseline,
            "lower": value.lower,
            "upper": value.upper,
            "points": value.baseline_points,
        }
    builds = {b.id: build_as_dict(b) for b in session.scalars(select(EngineBuild))}
    return [
        {
            "comparison_id": c.id,
            "run": c.run_id,
            "run_kind": kind,
            "run_status": status,
            "at": c.started_at.isoformat(timespec="seconds"),
            "verdict": c.verdict,
            "rollout": builds[c.rollout_build_id],
            "replay": builds[c.replay_build_id],
            "metrics": metrics.get(c.id, {}),
            "findings": findings_of(c.findings),
        }
        for c, kind, status in comparisons
    ]


def findings_of(stored) -> list[dict]:
    """A comparison's stored findings as claims: cause, status, severity and the claim in
    words (pipeline/history/claims.py), so no output shows a cause without its status."""
    return [claim.as_dict() for claim in claims_of(stored)]
