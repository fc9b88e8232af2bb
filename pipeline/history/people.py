"""What people say about the history: acknowledge or silence an alert, annotate a series.

Each changes how the past is judged, so the series is re-evaluated in the same transaction
(an acknowledgement or a distribution change starts a new baseline; an excluded point
leaves every baseline).
"""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from pipeline.db.models import Alert, Annotation, Comparison, Run, Series
from pipeline.errors import BadInput
from pipeline.history.detection import DetectionConfig
from pipeline.history.evaluate import CHANGE, EXCLUDE, reevaluate_series, utc_now


def acknowledge(session: Session, alert_id: int, note: str, silence: bool = False) -> list[Alert]:
    """Acknowledge (or silence) an alert and every open alert of the same event: the same
    series with the same first bad point (one step moves several metrics at once)."""
    alert = session.get(Alert, alert_id)
    if alert is None:
        raise BadInput(f"no alert {alert_id}; `lpx history alerts` lists them.")
    if not note.strip():
        raise BadInput("--note must say why (it is shown beside the alert).")
    same_event = session.scalars(
        select(Alert).where(
            Alert.series_id == alert.series_id,
            Alert.first_bad_id == alert.first_bad_id,
            Alert.status == "active",
            Alert.id != alert.id,
        )
    ).all()
    for target in [alert, *same_event]:
        target.status = "silenced" if silence else "acknowledged"
        target.note = note.strip()
        target.updated_at = utc_now()
    session.flush()
    reevaluate_series(session, session.get(Series, alert.series_id), DetectionConfig())
    return [alert, *same_event]


def annotate(session: Session, series_ref: str, run_ref: str, kind: str, reason: str) -> Annotation:
    if kind not in (CHANGE, EXCLUDE):
        raise BadInput(f"unknown annotation {kind!r}.")
    if not reason.strip():
        raise BadInput("--reason must say why (it is shown on the series page).")
    series = resolve_series(session, series_ref)
    run = resolve_run(session, run_ref)
    on_series = session.scalar(
        select(Comparison.id).where(Comparison.series_id == series.id, Comparison.run_id == run.id)
    )
    if on_series is None:
        raise BadInput(
            f"run {run.id} has no point on series {series.id} ({series.label}); "
            f"`lpx history series {series.id}` lists its runs."
        )
    annotation = Annotation(
        series_id=series.id, run_id=run.id, kind=kind, reason=reason.strip(), created_at=utc_now()
    )
    session.add(annotation)
    session.flush()
    reevaluate_series(session, series, DetectionConfig())
    return annotation


def resolve_series(session: Session, ref: str) -> Series:
    """A series by id or by a prefix of its key (at least 6 hex digits)."""
    return _resolve(session, Series, ref, "series", "lpx history series")


def resolve_run(session: Session, ref: str) -> Run:
    return _resolve(session, Run, ref, "run", "lpx history runs")


def _resolve(session: Session, model, ref: str, noun: str, listing: str):
    ref = str(ref).strip()
    if ref.isdigit():
        found = session.get(model, int(ref))
        if found is not None:
            return found
    if len(ref) >= 6:
        matches = session.scalars(select(model).where(model.key.startswith(ref.lower()))).all()
        if len(matches) == 1:
            return matches[0]
        if len(matches) > 1:
            raise BadInput(f"{noun} key prefix {ref!r} matches {len(matches)}; give more of it.")
    raise BadInput(f"no {noun} {ref!r}; `{listing}` lists them with their ids.")
