"""Bisects in the history: `lpx record BISECT_DIR` stores bisect.json; the series page lists
the bisects of its case and engine pair, next to its alerts.

A bisect names its series the way `record` names a comparison's: the case key of a probe's
report.json and the two engines by name. The testbed is left out: a bisect may run on
another machine than the nightly that flagged the regression.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.orm import Session

from pipeline.db.models import Bisect
from pipeline.errors import BadInput
from pipeline.history import keys

FILE = "bisect.json"


def is_bisect(directory: Path) -> bool:
    return (Path(directory) / FILE).is_file() and not (Path(directory) / "lpx-run.json").is_file()


def read_bisect(directory: Path) -> dict:
    """bisect.json with the series it belongs to; a bisect still running is refused."""
    path = Path(directory) / FILE
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise BadInput(f"{path}: not readable JSON ({error}); record a bisect lpx wrote.") from None
    if not isinstance(state, dict) or "bisect_id" not in state:
        raise BadInput(f"{path}: not an lpx bisect (no bisect_id).")
    if not state.get("result"):
        raise BadInput(
            f"{path}: the bisect has not finished; finish it (lpx bisect ... --out "
            f"{directory} --resume), then record it."
        )
    state["series"] = _series_of(Path(directory), state)
    return state


def record_bisect(session: Session, directory: Path, state: dict) -> bool:
    """Store one bisect; False when it is stored already (recording twice changes nothing)."""
    if session.scalar(select(Bisect.id).where(Bisect.bisect_id == state["bisect_id"])):
        return False
    result, series = state["result"], state["series"]
    finished = state.get("finished_at")
    session.add(
        Bisect(
            bisect_id=state["bisect_id"],
            case_key=series.get("case_key"),
            rollout_engine=series.get("rollout_engine"),
            replay_engine=series.get("replay_engine"),
            plan=state["plan"]["name"],
            pair=state["pair"],
            side=state["side"],
            good=state["good"],
            bad=state["bad"],
            first_bad=result.get("first_bad"),
            last_good=result.get("last_good"),
            stopped=result.get("stopped"),
            runs=int(result.get("runs") or 0),
            path=str(Path(directory).resolve()),
            result=result,
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


def _series_of(directory: Path, state: dict) -> dict:
    """The case key and engines of the first probe run that wrote a report."""
    for run in state.get("runs", []):
        report_path = directory / run["run_dir"] / "compare" / "report.json"
        try:
            report = json.loads(report_path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        meta = report.get("metadata") or {}
        return {
            "case_key": keys.case_key(keys.case_description(report)),
            "rollout_engine": keys.engine_name(meta.get("fixture") or {}),
            "replay_engine": keys.engine_name(meta.get("replay") or {}),
        }
    return {}
