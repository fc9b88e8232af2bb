"""Read the history as plain rows (dicts): what `lpx history` prints and the report renders.

Every query the report makes is here too (pipeline/report/data.py reads through this module
only), so the two share their joins and their rows, and neither drifts from the other.
"""

from __future__ import annotations

from collections.abc import Mapping

from sqlalchemy import Result, Select, func, select
from sqlalchemy.orm import Session, undefer

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


def runs_oldest_first(session: Session) -> list[dict]:
    """Every run, oldest first: the order the report steps through its run pages in."""
    return [run_row(run) for run in session.scalars(select(Run).order_by(Run.started_at, Run.id))]


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


def builds_by_id(session: Session) -> dict[int, dict]:
    """Every engine build by id: a point names its two builds by id, and the builds are few,
    so they are read whole rather than joined to each point."""
    return {b.id: build_as_dict(b) for b in session.scalars(select(EngineBuild))}


def series(session: Session) -> list[dict]:
    """Every series with its case, testbed and latest point."""
    latest = (
        select(Comparison.series_id, func.max(Comparison.id).label("comparison_id"))
        .group_by(Comparison.series_id)
        .subquery()
    )
    rows = session.execute(
        _series_with_case_and_testbed(Comparison)
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


def series_cases_and_testbeds(session: Session) -> list[tuple[Series, Case, Testbed]]:
    """Every series with its case and testbed, by id, a series with no point yet included:
    the report describes each one (model, knobs, layout) on its own page."""
    return session.execute(_series_with_case_and_testbed().order_by(Series.id)).all()


def _series_with_case_and_testbed(*columns) -> Select:
    """Series joined to its case and testbed (each series has exactly one of each)."""
    return (
        select(Series, Case, Testbed, *columns)
        .join(Case, Case.id == Series.case_id)
        .join(Testbed, Testbed.id == Series.testbed_id)
        .options(
            undefer(Case.rollout_numerics), undefer(Case.replay_numerics), undefer(Case.agent_loop)
        )
    )


def comparison_points(session: Session) -> Result:
    """Every comparison as a point of its series: the few columns the report charts and
    lists, not its details (worst tokens, heatmap: read per run page), oldest first, as bare
    rows streamed from one query."""
    return session.execute(
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
            Comparison.workload,
        ).order_by(Comparison.started_at, Comparison.id)
    )


def boundary_ratios(session: Session, boundaries: set[str]) -> Result:
    """(comparison_id, series_id, boundary, ratio, beyond) at every comparison, for the
    named boundaries only: each series' tracked one, in one query for the whole history
    rather than one per series."""
    return session.execute(
        select(
            LocalizeBoundary.comparison_id,
            LocalizeBoundary.series_id,
            LocalizeBoundary.boundary,
            LocalizeBoundary.ratio,
            LocalizeBoundary.beyond,
        ).where(LocalizeBoundary.boundary.in_(boundaries))
    )


def metric_values(session: Session) -> Result:
    """Every metric value as a bare row (comparison_id, name, value, status, lower, upper,
    baseline), in no order: a year is ~400k values, too many for ORM objects; the report
    groups them per point itself."""
    return session.execute(
        select(
            MetricValue.comparison_id,
            MetricValue.name,
            MetricValue.value,
            MetricValue.status,
            MetricValue.lower,
            MetricValue.upper,
            MetricValue.baseline,
        )
    )


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
    return [alert_row(alert, label, points) for alert, label in found]


def every_alert(session: Session) -> list[Alert]:
    """Every alert, whatever its status, oldest first: the report lists the acknowledged and
    silenced ones beside the active ones."""
    return list(session.scalars(select(Alert).order_by(Alert.id)))


def alert_row(alert: Alert, series_label: str, points: Mapping[int, object]) -> dict:
    """An alert as `lpx history alerts` and the report show it. Its last good, first bad and
    latest points are looked up by comparison id in ``points``, whatever each caller made of
    them (the terminal's small dicts, the report's chart points); None where there is none."""
    return {
        "id": alert.id,
        "series_id": alert.series_id,
        "series": series_label,
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


def annotations(session: Session) -> list[dict]:
    """Every annotation (a person's note on a series at a run), oldest first."""
    return [
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
    builds = builds_by_id(session)
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


def run_comparisons(session: Session, run_id: int) -> list[Comparison]:
    """One run's comparisons with their details (worst tokens, heatmap), by pair: read per
    run page, never for the whole history at once."""
    return list(
        session.scalars(
            select(Comparison).where(Comparison.run_id == run_id).order_by(Comparison.pair)
        )
    )


def run_localize_rows(session: Session, comparisons: list[Comparison]) -> dict[int, list[dict]]:
    """The boundary rows of a run's localized comparisons, in network order (as recorded).
    Only the comparisons whose localize ran to a verdict have rows, so only they are asked."""
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


def findings_of(stored) -> list[dict]:
    """A comparison's stored findings as claims: cause, status, severity and the claim in
    words (pipeline/history/claims.py), so no output shows a cause without its status."""
    return [claim.as_dict() for claim in claims_of(stored)]
