"""Bisects in the history: `lpx record BISECT_DIR` stores bisect.json; the series page lists
the bisects of its case and engine pair, next to its alerts.

A bisect names its series the way `record` names a comparison's: the case key of a probe's
report.json and the two engines by name. The testbed is left out: a bisect may run on
another machine than the nightly that flagged the regression.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from pydantic import ValidationError
from sqlalchemy import select
from sqlalchemy.orm import Session

from pipeline.contracts.bisect import BisectState, as_written
from pipeline.contracts.files import BISECT as FILE
from pipeline.contracts.files import MANIFEST, REPORT
from pipeline.contracts.problems import describe
from pipeline.contracts.report import Report, load_report
from pipeline.db.models import Alert, Bisect, Case, MetricValue, Series
from pipeline.errors import BadInput
from pipeline.history import keys
from pipeline.history.detection import Boundary, violates


def is_bisect(directory: Path) -> bool:
    return (Path(directory) / FILE).is_file() and not (Path(directory) / MANIFEST).is_file()


@dataclass(frozen=True)
class FinishedBisect:
    """A finished bisect.json and the series it belongs to."""

    state: BisectState
    series: dict[str, str]  # case_key, rollout_engine, replay_engine; {} without a report


def read_bisect(directory: Path) -> FinishedBisect:
    """bisect.json with the series it belongs to; a bisect still running is refused."""
    path = Path(directory) / FILE
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise BadInput(f"{path}: not readable JSON ({error}); record a bisect lpx wrote.") from None
    if not isinstance(data, dict) or "bisect_id" not in data:
        raise BadInput(f"{path}: not an lpx bisect (no bisect_id).")
    try:
        state = BisectState.model_validate(data)
    except ValidationError as error:
        raise BadInput(
            f"{path}: not a bisect.json as lpx writes it: {describe(error, count=3)}; record "
            "the bisect.json lpx bisect wrote, unedited, or run the bisect again."
        ) from None
    if state.result is None:
        raise BadInput(
            f"{path}: the bisect has not finished; finish it (lpx bisect ... --out "
            f"{directory} --resume), then record it."
        )
    return FinishedBisect(state, _series_of(Path(directory), state))


def record_bisect(session: Session, directory: Path, found: FinishedBisect) -> bool:
    """Store one bisect; False when it is stored already (recording twice changes nothing)."""
    state, series = found.state, found.series
    if session.scalar(select(Bisect.id).where(Bisect.bisect_id == state.bisect_id)):
        return False
    result, finished = state.result, state.finished_at
    session.add(
        Bisect(
            bisect_id=state.bisect_id,
            case_key=series.get("case_key"),
            rollout_engine=series.get("rollout_engine"),
            replay_engine=series.get("replay_engine"),
            plan=state.plan.name,
            pair=state.pair,
            side=state.side,
            good=state.good,
            bad=state.bad,
            first_bad=result.first_bad,
            last_good=result.last_good,
            stopped=result.stopped,
            runs=result.runs,
            path=str(Path(directory).resolve()),
            result=as_written(result),
            finished_at=datetime.fromisoformat(finished).replace(tzinfo=None) if finished else None,
        )
    )
    return True


def bisects_by_series(session: Session) -> dict[tuple, list[dict]]:
    """(case key, rollout engine, replay engine) -> that pair's bisects, newest first."""
    found: dict[tuple, list[dict]] = {}
    for row in session.scalars(select(Bisect).order_by(Bisect.id.desc())):
        result = row.result or {}
        found.setdefault((row.case_key, row.rollout_engine, row.replay_engine), []).append(
            {
                "bisect_id": row.bisect_id[:12],
                "plan": row.plan,
                "pair": row.pair,
                "side": row.side,
                "good": row.good,
                "bad": row.bad,
                "first_bad": row.first_bad,
                "last_good": row.last_good,
                "maybe_first_bad": result.get("maybe_first_bad") or [],
                "flaky": result.get("flaky") or [],
                "errors": result.get("errors") or [],
                "stopped": row.stopped,
                "runs": row.runs,
                "changed": result.get("changed") or {},
                "path": row.path,
                "finished_at": row.finished_at.isoformat(timespec="seconds")
                if row.finished_at
                else "",
            }
        )
    return found


def _series_of(directory: Path, state: BisectState) -> dict[str, str]:
    """The case key and engines of the first probe run that wrote a report."""
    for run in state.runs:
        report_path = directory / run.run_dir / "compare" / REPORT
        try:
            report = load_report(report_path)
        except (OSError, ValueError):
            continue
        case_key, rollout, replay = series_of_report(report)
        return {"case_key": case_key, "rollout_engine": rollout, "replay_engine": replay}
    return {}


def series_bands(
    session: Session, case_key: str, rollout_engine: str, replay_engine: str
) -> dict[str, tuple[float | None, float | None, str]]:
    """Each tracked metric's band (lower, upper, which way is better) at the series' last
    good point: the last good of its newest alert, else its newest point judged ok. What a
    bisect's probe is judged by besides the policy, so a regression the nightly flagged by
    its history (inside the policy, outside the band) is bisected by the same rule."""
    series_ids = session.scalars(
        select(Series.id)
        .join(Case, Case.id == Series.case_id)
        .where(
            Case.key == case_key,
            Series.rollout_engine == rollout_engine,
            Series.replay_engine == replay_engine,
        )
    ).all()
    if not series_ids:
        return {}
    good = session.scalar(
        select(Alert.last_good_id)
        .where(Alert.series_id.in_(series_ids), Alert.last_good_id.is_not(None))
        .order_by(Alert.id.desc())
        .limit(1)
    )
    if good is None:
        good = session.scalar(
            select(MetricValue.comparison_id)
            .where(MetricValue.series_id.in_(series_ids), MetricValue.status == "ok")
            .order_by(MetricValue.started_at.desc())
            .limit(1)
        )
    if good is None:
        return {}
    rows = session.execute(
        select(MetricValue.name, MetricValue.lower, MetricValue.upper, MetricValue.better).where(
            MetricValue.comparison_id == good,
            (MetricValue.lower.is_not(None)) | (MetricValue.upper.is_not(None)),
        )
    )
    return {name: (lower, upper, better) for name, lower, upper, better in rows}


def outside_bands(metrics: dict, bands: dict) -> list[str]:
    """The metrics of a probe's report that lie outside the series' band on the bad side."""
    outside = []
    for name, (lower, upper, better) in sorted(bands.items()):
        if name not in metrics:
            continue
        low = -math.inf if lower is None else lower
        high = math.inf if upper is None else upper
        if violates(metrics[name], Boundary(0.0, 0.0, low, high, 0), better):
            value = metrics[name]
            shown = "not finite" if value is None else f"{value:.4g}"
            outside.append(f"{name} {shown} outside [{low:.4g}, {high:.4g}]")
    return outside


def series_of_report(report: Report) -> tuple[str, str, str]:
    meta = report.metadata
    return (
        keys.case_key(keys.describe_case(meta)),
        keys.engine_name(meta.get("fixture") or {}),
        keys.engine_name(meta.get("replay") or {}),
    )
