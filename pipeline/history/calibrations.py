"""Calibrations in the history: a night's `lpx calibrate` is stored with its key, and a later
night with the same weights, engine, layout, hardware and libraries reuses it instead of
re-scoring."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import select
from sqlalchemy.orm import Session

from pipeline.db.models import Calibration
from pipeline.history.database import History
from pipeline.history.keys import digest


def calibration_digest(key: dict) -> str:
    """What identifies a calibration: its key without the model's path (the same weights
    elsewhere on disk are the same model)."""
    return digest({k: v for k, v in (key or {}).items() if k != "model_path"})


def store_calibration(session: Session, payload: dict, run_id: int | None = None) -> bool:
    """Add a calibration unless the same one (key and time made) is stored; True when added."""
    key = calibration_digest(payload.get("key") or {})
    made = datetime.fromisoformat(str(payload["created_at"]))
    exists = session.scalar(
        select(Calibration.id).where(Calibration.key == key, Calibration.created_at == made)
    )
    if exists is not None:
        return False
    key_fields = payload.get("key") or {}
    session.add(
        Calibration(
            key=key,
            model_fingerprint=key_fields.get("model_fingerprint"),
            engine=str(key_fields.get("engine") or "hf"),
            hardware=key_fields.get("hardware"),
            precisions=list(payload.get("precisions") or []),
            created_at=made,
            run_id=run_id,
            payload=payload,
        )
    )
    return True


def find_calibration(history: History, key: dict, precisions: list[str]) -> dict | None:
    """The newest stored calibration with this key that measured every given precision."""
    wanted = set(precisions)
    with history.read() as session:
        rows = session.scalars(
            select(Calibration)
            .where(Calibration.key == calibration_digest(key))
            .order_by(Calibration.created_at.desc())
        )
        for row in rows:
            if wanted <= set(row.precisions or []):
                return row.payload
    return None
