"""`lpx gate`: the CI/nightly verdict on the latest run, from what the history recorded.

``decide`` is pure: the run's status and the open alerts whose latest point is in that run
-> an exit code and the reasons. Acknowledged and silenced alerts never fail the gate. A
failing alert's reasons name its point's findings, each with its status (verified,
plausible, unexplained, ruled out), so a guess never reads as the established cause.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.orm import Session

from pipeline.db.models import Alert, Comparison, Run, Series
from pipeline.errors import EXIT_BAD_INPUT, EXIT_PASS, EXIT_REGRESSION
from pipeline.history.claims import summary
from pipeline.history.queries import findings_of

FAIL_ON = ("regression", "suspicious", "policy", "never")
# What each --fail-on level catches: suspicious includes the confirmed regressions.
CATCHES = {
    "regression": {"regression"},
    "suspicious": {"regression", "suspicious"},
    "policy": {"policy_violation"},
    "never": set(),
}


@dataclass(frozen=True)
class OpenAlert:
    id: int
    kind: str
    series: str
    metric: str
    rule: str
    findings: tuple[dict, ...] = ()  # the claims (Claim.as_dict) of its point in this run


@dataclass(frozen=True)
class Decision:
    exit_code: int
    reasons: list[str]


def decide(run_status: str, run_errors: list[dict], alerts: list[OpenAlert], fail_on) -> Decision:
    if run_status == "error":
        stages = "; ".join(f"{e.get('stage')}: {e.get('message')}" for e in run_errors)
        return Decision(EXIT_BAD_INPUT, [stages or "its stages failed"])
    caught = set().union(*(CATCHES[level] for level in fail_on)) if fail_on else set()
    hits = [a for a in alerts if a.kind in caught]
    reasons = []
    for a in hits:
        reasons.append(f"alert {a.id} {a.kind}: {a.series}: {a.rule}")
        if a.findings:
            reasons.append(f"  diagnosis: {summary(a.findings)}")
    return Decision(EXIT_REGRESSION if hits else EXIT_PASS, reasons)


def open_alerts_of_run(session: Session, run_id: int) -> list[OpenAlert]:
    rows = session.execute(
        select(Alert.id, Alert.kind, Series.label, Alert.metric, Alert.rule, Comparison.findings)
        .join(Comparison, Comparison.id == Alert.latest_id)
        .join(Series, Series.id == Alert.series_id)
        .where(Comparison.run_id == run_id, Alert.status == "active")
        .order_by(Alert.id)
    ).all()
    return [OpenAlert(*row[:5], tuple(findings_of(row[5]))) for row in rows]


def latest_run(session: Session, kind: str | None = None) -> Run | None:
    query = select(Run).order_by(Run.started_at.desc(), Run.id.desc()).limit(1)
    if kind:
        query = query.where(Run.kind == kind)
    return session.scalar(query)
