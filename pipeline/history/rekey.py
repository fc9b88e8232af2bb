"""Re-key a history under the key rules of this lpx (keys.py).

Engine builds, cases and series whose keys the rules now compute otherwise get the new key;
rows that now share a key are merged into the oldest (every comparison, metric value,
localize row, alert, annotation and bisect moves with them). Idempotent: a history already
keyed this way is left as it is. A migration that changes a key rule runs it
(db/migrations/versions/0007_series_keys.py; 0008 after the address rule).

What it cannot re-derive: a knob that was an output path inside its run directory under a
name that does not say so (the case row does not hold the run's directory); such a series
stays split.
"""

from __future__ import annotations

from collections import defaultdict

from sqlalchemy import delete, select, update
from sqlalchemy.orm import Session

from pipeline.db.models import (
    Alert,
    Annotation,
    Bisect,
    Case,
    Comparison,
    EngineBuild,
    LocalizeBoundary,
    MetricValue,
    Series,
    Testbed,
)
from pipeline.history import keys
from pipeline.history.evaluate import build_as_dict


def rekey(session: Session) -> dict[str, int]:
    """Re-key and merge; returns how many rows of each kind were re-keyed or merged away,
    and the ids of the series that took others' points (``merged_series``: judge them again)."""
    counts = {"builds": _rekey_builds(session)}
    case_keys, counts["cases"] = _rekey_cases(session)
    merged, counts["series"] = _rekey_series(session)
    for old, new in case_keys.items():
        session.execute(update(Bisect).where(Bisect.case_key == old).values(case_key=new))
    session.flush()
    counts["merged_series"] = sorted(merged)
    return counts


def _rekey_builds(session: Session) -> int:
    builds = session.scalars(select(EngineBuild).order_by(EngineBuild.id)).all()
    wanted = {}
    for build in builds:
        described = build_as_dict(build)
        if build.versions:  # a build recorded with its packages: name its whole stack
            described["version"] = keys.stack_version(build.engine, build.versions)
        wanted[build.id] = (keys.digest(described), described["version"])
    groups = _groups(builds, lambda b: wanted[b.id][0])
    changed = 0
    for survivor, losers in groups:
        for loser in losers:
            for column in (Comparison.rollout_build_id, Comparison.replay_build_id):
                session.execute(
                    update(Comparison).where(column == loser.id).values({column: survivor.id})
                )
        changed += _merge(session, survivor, losers, wanted[survivor.id][0])
        if survivor.version != wanted[survivor.id][1]:
            survivor.version = wanted[survivor.id][1]
    return changed


def _rekey_cases(session: Session) -> tuple[dict[str, str], int]:
    cases = session.scalars(select(Case).order_by(Case.id)).all()
    numerics = _numerics_of_cases(session)
    wanted = {case.id: keys.case_key(_case_description(case, numerics)) for case in cases}
    renamed = {case.key: wanted[case.id] for case in cases if case.key != wanted[case.id]}
    changed = 0
    for survivor, losers in _groups(cases, lambda c: wanted[c.id]):
        for loser in losers:
            session.execute(
                update(Series).where(Series.case_id == loser.id).values(case_id=survivor.id)
            )
        changed += _merge(session, survivor, losers, wanted[survivor.id])
    return renamed, changed


def _numerics_of_cases(session: Session) -> dict[int, tuple]:
    """Case id -> (rollout numerics, replay numerics), where the table has the columns
    (migration 0009); empty before it (the re-keys of 0007 and 0008 run before it)."""
    from sqlalchemy import inspect

    columns = {c["name"] for c in inspect(session.connection()).get_columns("cases")}
    if "rollout_numerics" not in columns:
        return {}
    rows = session.execute(select(Case.id, Case.rollout_numerics, Case.replay_numerics))
    return {row[0]: (row[1], row[2]) for row in rows}


def _case_description(case: Case, numerics: dict | None = None) -> dict:
    """The case a row was keyed from (keys.describe_case). A row's label is the plan's name,
    or the model's directory name where the comparison had none."""
    unnamed = case.label == str(case.model).rstrip("/").split("/")[-1]
    return {
        "label": None if unnamed else case.label,
        "model": case.model,
        "weights_fingerprint": case.weights_fingerprint,
        "tokenizer_fingerprint": case.tokenizer_fingerprint,
        "prompt_set": case.prompt_set,
        "channel": case.channel,
        "rollout_dtype": case.rollout_dtype,
        "replay_dtype": case.replay_dtype,
        "rollout_numerics": (numerics or {}).get(case.id, (None, None))[0],
        "replay_numerics": (numerics or {}).get(case.id, (None, None))[1],
        "knobs": case.knobs or {},
        "layout": case.layout or {},
    }


def _rekey_series(session: Session) -> tuple[set[int], int]:
    series_rows = session.scalars(select(Series).order_by(Series.id)).all()
    case_keys = dict(session.execute(select(Case.id, Case.key)).all())
    testbed_keys = dict(session.execute(select(Testbed.id, Testbed.key)).all())
    wanted = {
        s.id: keys.series_key(
            case_keys[s.case_id], s.rollout_engine, s.replay_engine, testbed_keys[s.testbed_id]
        )
        for s in series_rows
    }
    merged, changed = set(), 0
    for survivor, losers in _groups(series_rows, lambda s: wanted[s.id]):
        for loser in losers:
            for table in (Comparison, MetricValue, LocalizeBoundary, Alert, Annotation):
                session.execute(
                    update(table).where(table.series_id == loser.id).values(series_id=survivor.id)
                )
            latest = [t for t in (survivor.last_started_at, loser.last_started_at) if t]
            survivor.last_started_at = max(latest) if latest else None
            merged.add(survivor.id)
        changed += _merge(session, survivor, losers, wanted[survivor.id])
    return merged, changed


def _groups(rows: list, key_of) -> list[tuple[object, list]]:
    """(oldest row, the others) per new key, oldest first."""
    grouped = defaultdict(list)
    for row in rows:  # rows come ordered by id
        grouped[key_of(row)].append(row)
    return [(found[0], found[1:]) for found in grouped.values()]


def _merge(session: Session, survivor, losers: list, key: str) -> int:
    """Delete the merged-away rows and give the survivor its key (through a placeholder, so
    a key another row still holds for a moment never collides)."""
    model = type(survivor)
    if losers:
        session.flush()
        session.execute(delete(model).where(model.id.in_([row.id for row in losers])))
        for row in losers:
            session.expunge(row)
    if survivor.key == key:
        return len(losers)
    survivor.key = f"rekey-{survivor.id}"
    session.flush()
    survivor.key = key
    return len(losers) + 1
