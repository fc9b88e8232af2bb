"""Judge stored series points and keep the alerts in step: the database side of detection.

``judge_point`` runs the pure rules of detection.py on one new point, from the state the
series stored after its previous point, and opens, updates or resolves alerts. An alert
is one episode: (series, metric, first violating point). ``reevaluate_series`` replays a
whole series through the same function after an annotation or acknowledgement changed its
past, so both paths give the same statuses and boundaries.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from pipeline.db.models import Alert, Annotation, Comparison, EngineBuild, MetricValue, Run, Series
from pipeline.history import keys
from pipeline.history.attribution import changes, point_description
from pipeline.history.claims import failing_claims
from pipeline.history.detection import (
    HEALTHY,
    OK,
    REGRESSION,
    VIOLATING,
    DetectionConfig,
    PointResult,
    enter_build,
    judged_window,
    metric_spec,
    new_state,
    policy_step,
    robust_boundaries,
    step,
)
from pipeline.history.keys import segment_of
from pipeline.history.workload import same_token_values

POLICY = "policy"  # the metric name of policy-violation alerts
POLICY_VIOLATION = "policy_violation"
RESET_ALL = "*"
CHANGE, EXCLUDE = "distribution_change", "excluded"
ALERT_OPEN = ("active",)
ALERT_KEPT = ("acknowledged", "silenced")  # a person's decision: detection never undoes it
OPENED_ALERTS = "lpx_opened_alerts"  # session.info key


@dataclass
class Point:
    """One comparison as detection sees it."""

    comparison_id: int
    run_id: int
    verdict: str
    tau: float
    error_run: bool
    values: dict[str, float | None]
    violations: list[dict] = field(default_factory=list)
    # the causes the policy failed on, each with its status: `stale_weights (plausible)`
    failing_findings: list[str] = field(default_factory=list)
    # both sides' engine builds (keys.segment_of): a change starts a new baseline segment
    build: str | None = None
    # {metric: (last night, tonight)} on the tokens both nights share, where they changed
    same_tokens: dict[str, tuple[float, float]] = field(default_factory=dict)


def utc_now() -> datetime:
    return datetime.now(UTC).replace(tzinfo=None)


def judge_point(
    session: Session,
    series: Series,
    point: Point,
    config: DetectionConfig,
    reset: frozenset[str] = frozenset(),
    excluded: bool = False,
    boundaries: dict | None = None,
) -> dict[str, PointResult]:
    """Step every metric of ``point`` and the policy rule; update the series' state and its
    alerts. ``reset`` names metrics (or RESET_ALL) whose baseline starts again here.
    ``boundaries`` may bring the point's boundaries from ``point_boundaries`` (a run's points
    are bounded in one batch); they are computed here otherwise."""
    # The few reads judging needs (alerts, attribution) must not flush every series state
    # touched so far; alerts opened here are found through session.info instead.
    with session.no_autoflush:
        return _judge_point(session, series, point, config, reset, excluded, boundaries)


def point_boundaries(
    points: list[tuple[Series, Point]],
    config: DetectionConfig,
    reset: frozenset[str] = frozenset(),
    excluded: bool = False,
) -> list[dict]:
    """The baseline boundary of every judged metric of many points (each of another series),
    in one numpy batch: {metric: Boundary | None} per point."""
    windows, minimums, specs, taus, owners = [], [], [], [], []
    for index, (series, point) in enumerate(points):
        state = series.detection_state or {}
        for name in _judged(point, reset, excluded):
            metric_state = enter_build(state.get(name) or new_state(), point.build, config)
            window, needed = judged_window(metric_state, config)
            windows.append(window)
            minimums.append(needed)
            specs.append(metric_spec(name))
            taus.append(point.tau)
            owners.append((index, name))
    out = [{} for _ in points]
    for (index, name), boundary in zip(
        owners, robust_boundaries(windows, specs, taus, config, minimums), strict=True
    ):
        out[index][name] = boundary
    return out


def _judged(point: Point, reset: frozenset[str], excluded: bool) -> list[str]:
    if excluded or point.error_run:
        return []
    return [
        name
        for name in point.values
        if RESET_ALL not in reset and name not in reset and metric_spec(name).detect
    ]


def _judge_point(
    session, series, point, config, reset, excluded, boundaries
) -> dict[str, PointResult]:
    if boundaries is None:
        boundaries = point_boundaries([(series, point)], config, reset, excluded)[0]
    state = dict(series.detection_state or {})
    results = {}
    resets = {name: RESET_ALL in reset or name in reset for name in point.values}
    for name, value in point.values.items():
        before = state.get(name) or new_state()
        after, result = step(
            before,
            point.comparison_id,
            value,
            metric_spec(name),
            point.tau,
            config,
            reset=resets[name],
            excluded=excluded,
            error_run=point.error_run,
            boundary=boundaries.get(name, False),
            build=point.build,
            same_tokens=point.same_tokens.get(name),
        )
        state[name] = after
        results[name] = result
        quiet = result.status in HEALTHY and not before.get("streak")  # the usual night
        if not quiet and metric_spec(name).detect:
            _follow_alert(session, series, name, before, result, point, value)
    before = state.get(POLICY) or new_state()
    state[POLICY], policy = policy_step(
        before, point.comparison_id, point.verdict, excluded=excluded, error_run=point.error_run
    )
    _follow_alert(session, series, POLICY, before, policy, point, None)
    series.detection_state = state  # a new dict: the JSON column sees the change
    return results


def reevaluate_series(session: Session, series: Series, config: DetectionConfig) -> None:
    """Recompute every point's boundaries and status, and the series' alerts, from scratch."""
    points = session.execute(
        select(
            Comparison.id,
            Comparison.run_id,
            Comparison.verdict,
            Comparison.tau,
            Comparison.violations,
            Comparison.details,
            Comparison.rollout_build_id,
            Comparison.replay_build_id,
            Comparison.workload,
            Run.status,
        )
        .join(Run, Run.id == Comparison.run_id)
        .where(Comparison.series_id == series.id)
        .order_by(Comparison.started_at, Comparison.id)
    ).all()
    rows = session.execute(
        select(MetricValue.id, MetricValue.comparison_id, MetricValue.name, MetricValue.value)
        .where(MetricValue.series_id == series.id)
        .order_by(MetricValue.id)
    ).all()
    by_point: dict[int, list] = {}
    for row in rows:
        by_point.setdefault(row.comparison_id, []).append(row)
    annotations = session.execute(
        select(Annotation.run_id, Annotation.kind).where(Annotation.series_id == series.id)
    ).all()
    changed_runs = {a.run_id for a in annotations if a.kind == CHANGE}
    excluded_runs = {a.run_id for a in annotations if a.kind == EXCLUDE}
    acknowledged = session.execute(
        select(Alert.metric, Alert.first_bad_id).where(
            Alert.series_id == series.id, Alert.status == "acknowledged"
        )
    ).all()
    # Episodes are re-found by the replay; whatever it no longer finds ends resolved.
    session.execute(
        update(Alert)
        .where(Alert.series_id == series.id, Alert.status.in_(ALERT_OPEN))
        .values(status="resolved", updated_at=utc_now())
    )
    series.detection_state = {}
    builds = {
        b.id: build_as_dict(b)
        for b in session.scalars(
            select(EngineBuild).where(
                EngineBuild.id.in_(
                    {p.rollout_build_id for p in points} | {p.replay_build_id for p in points}
                )
            )
        )
    }
    updates = []
    for p in points:
        reset = {metric for metric, first_bad in acknowledged if first_bad == p.id}
        if p.run_id in changed_runs:
            reset.add(RESET_ALL)
        point = Point(
            p.id,
            p.run_id,
            p.verdict,
            p.tau,
            p.status == "error",
            {row.name: row.value for row in by_point.get(p.id, [])},
            p.violations or [],
            failing_claims(
                (p.details or {}).get("policy", {}).get("failing_findings", []),
                (p.details or {}).get("diagnosis"),
            ),
            segment_of(builds[p.rollout_build_id], builds[p.replay_build_id]),
            same_token_values(p.workload),
        )
        results = judge_point(
            session, series, point, config, frozenset(reset), excluded=p.run_id in excluded_runs
        )
        updates += [
            {"id": row.id, **metric_fields(results[row.name])} for row in by_point.get(p.id, [])
        ]
    if updates:
        session.execute(update(MetricValue), updates)


def reevaluate_all(session: Session, config: DetectionConfig | None = None) -> int:
    config = config or DetectionConfig()
    series_rows = session.scalars(select(Series).order_by(Series.id)).all()
    for series in series_rows:
        reevaluate_series(session, series, config)
    return len(series_rows)


BOUNDARY_COLUMNS = ("status", "baseline", "band", "lower", "upper", "baseline_points")


def boundary_values(result: PointResult) -> tuple:
    """A judged point's stored fields, in BOUNDARY_COLUMNS order."""
    b = result.boundary
    if b is None:
        return (result.status, None, None, None, None, 0)
    return (result.status, b.baseline, b.band, b.lower, b.upper, b.points)


def metric_fields(result: PointResult) -> dict:
    return dict(zip(BOUNDARY_COLUMNS, boundary_values(result), strict=True))


def _follow_alert(
    session: Session,
    series: Series,
    metric: str,
    before: dict,
    result: PointResult,
    point: Point,
    value: float | None,
) -> None:
    violating = result.status in VIOLATING or result.status == POLICY_VIOLATION
    if violating:
        alert = _find_alert(session, series.id, metric, result.first_bad)
        if alert is None:
            _open_alert(session, series, metric, result, point, value)
        else:
            _continue_alert(alert, result, point, value)
    elif result.status in HEALTHY or result.status == OK:
        if before.get("streak"):  # an episode just ended
            alert = _find_alert(session, series.id, metric, before["streak"][0])
            if alert is not None and alert.status in ALERT_OPEN:
                alert.status = "resolved"
                alert.updated_at = utc_now()


def _find_alert(session: Session, series_id: int, metric: str, first_bad: int | None):
    # Alerts opened in this transaction are found in session.info, so a lookup never has
    # to flush (which would re-encode every series' detection state it touched).
    opened = session.info.get(OPENED_ALERTS, {}).get((series_id, metric, first_bad))
    if opened is not None:
        return opened
    with session.no_autoflush:
        return session.scalar(
            select(Alert).where(
                Alert.series_id == series_id,
                Alert.metric == metric,
                Alert.first_bad_id == first_bad,
            )
        )


def _open_alert(session, series, metric, result, point, value) -> None:
    now = utc_now()
    if metric == POLICY:
        before_value, after_value = _policy_values(session, result.last_good, point)
    else:
        before_value, after_value = result.boundary.baseline, value
    first_bad = result.first_bad
    attribution = []
    if result.last_good is not None:
        attribution = changes(
            describe_point(session, result.last_good), describe_point(session, first_bad)
        )
    alert = Alert(
        series_id=series.id,
        metric=metric,
        kind=POLICY_VIOLATION if metric == POLICY else result.status,
        status="active",
        first_bad_id=first_bad,
        last_good_id=result.last_good,
        latest_id=point.comparison_id,
        value_before=before_value,
        value_after=after_value,
        rule=_rule(metric, result, point, value),
        attribution=attribution,
        created_at=now,
        updated_at=now,
    )
    session.add(alert)
    session.info.setdefault(OPENED_ALERTS, {})[(series.id, metric, first_bad)] = alert


def _continue_alert(alert: Alert, result: PointResult, point: Point, value) -> None:
    if metric_is_history(alert.metric) and result.status == REGRESSION:
        alert.kind = REGRESSION  # suspicious confirmed by the next point
    if alert.status == "resolved":  # a replay found the episode still going
        alert.status = "active"
    alert.latest_id = point.comparison_id
    if metric_is_history(alert.metric):
        alert.value_after = value
    alert.rule = _rule(alert.metric, result, point, value)
    alert.updated_at = utc_now()


def metric_is_history(metric: str) -> bool:
    return metric != POLICY


def _rule(metric: str, result: PointResult, point: Point, value) -> str:
    if metric == POLICY:
        parts = [
            f"{v.get('metric')} {_fmt(v.get('value'))} > {_fmt(v.get('limit'))}"
            for v in point.violations
        ]
        if point.failing_findings:
            parts.append("findings: " + ", ".join(point.failing_findings))
        return "policy: " + ("; ".join(parts) or "verdict fail")
    b = result.boundary
    if value is None:
        where = "is not finite"
    elif value > b.upper:
        where = f"> upper bound {_fmt(b.upper)}"
    else:
        where = f"< lower bound {_fmt(b.lower)}"
    text = (
        f"history: {metric} {_fmt(value)} {where} (median {_fmt(b.baseline)} of {b.points} "
        f"healthy points +- band {_fmt(b.band)})"
    )
    if result.status == REGRESSION:
        text += "; 2+ violating points in a row"
    return text


def _policy_values(session, last_good: int | None, point: Point):
    """The first violated metric's value at the last good point and now."""
    metric = (point.violations[0].get("metric") if point.violations else None) or "max_abs_diff"
    after = point.values.get(metric)
    before = None
    if last_good is not None:
        before = session.scalar(
            select(MetricValue.value).where(
                MetricValue.comparison_id == last_good, MetricValue.name == metric
            )
        )
    return before, after


def describe_point(session: Session, comparison_id: int) -> dict:
    """Both engine builds, the knobs, host and lpx version of one point (for attribution).
    The knobs leave out what differs from run to run (a seed, an id, an output path, a
    server's address: ``keys.case_knobs``): they change every night, so they never tell a
    good night from a bad one, and listed first they would hide the knob that did."""
    comparison = session.get(Comparison, comparison_id)
    run = session.get(Run, comparison.run_id)
    rollout = session.get(EngineBuild, comparison.rollout_build_id)
    replay = session.get(EngineBuild, comparison.replay_build_id)
    reproduce = (comparison.details or {}).get("reproduce", {})
    knobs = {
        side: keys.case_knobs((reproduce.get(part) or {}).get("knobs") or {}, str(run.run_dir))
        for side, part in (("rollout", "fixture"), ("replay", "replay"))
    }
    return point_description(
        build_as_dict(rollout),
        build_as_dict(replay),
        knobs,
        ((run.manifest or {}).get("testbed") or {}).get("host"),
        run.lpx_version,
    )


def build_as_dict(build: EngineBuild) -> dict:
    return {
        "engine": build.engine,
        "version": build.version,
        "image_ref": build.image_ref,
        "image_digest": build.image_digest,
        "torch": build.torch,
        "cuda": build.cuda,
        "driver": build.driver,
        "versions": build.versions or {},
    }


def _fmt(value) -> str:
    return "-" if value is None else f"{value:.4g}" if isinstance(value, float) else str(value)
