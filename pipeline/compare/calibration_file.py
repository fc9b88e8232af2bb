"""calibration.json as lpx reads it: types, ranges, finite values and monotone quantiles,
checked before any number of it judges a comparison.

A calibration sets the limits a replay is judged by, so a damaged one is worse than none: a
NaN quantile compares false with every |d| and a negative one makes every token drift, and
either could end as a PASS. `read_calibration` refuses such a file in one line naming it and
the first wrong field by its JSON path. Fields lpx does not know are kept: a newer
`lpx calibrate` may write more (the format number says when an old reader must refuse).
Format: `lpx calibrate` (calibrate/run.py) and the floors of floor.py; docs/compare.md.

A reader checks the file once, with `load_calibration`, and keeps the model; a function that
takes a calibration also takes the dict of one (json.loads in bench scripts) through
`as_calibration`. `read_calibration` gives the checked dict itself, to callers that store or
pass on the file as read.
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import ValidationError

from pipeline.contracts.calibration import CALIBRATION_FORMAT, PRECISIONS, Calibration
from pipeline.contracts.problems import describe, shown
from pipeline.errors import BadInput

__all__ = [
    "CALIBRATION_FORMAT",
    "PRECISIONS",
    "Calibration",
    "as_calibration",
    "load_calibration",
    "read_calibration",
    "validate_calibration",
]


def load_calibration(path: Path) -> Calibration:
    """calibration.json's model, checked; BadInput otherwise, in one line naming the file and
    its first problem."""
    return _checked(_read_json(path), path)


def read_calibration(path: Path) -> dict:
    """A checked calibration.json as read (unknown fields kept); BadInput otherwise, in one
    line naming the file and its first problem."""
    return validate_calibration(_read_json(path), path)


def as_calibration(
    calibration: Calibration | dict | None, source: str | Path = ""
) -> Calibration | None:
    """The model of a calibration given either way: a model as it is, a dict checked as the
    file would be (BadInput naming ``source``, where it came from); None stays None."""
    if calibration is None or isinstance(calibration, Calibration):
        return calibration
    return _checked(calibration, source or "the calibration given")


def validate_calibration(data, path) -> dict:
    """``data`` itself when it is a calibration lpx can judge with; BadInput naming ``path``
    and the first problem's JSON path otherwise."""
    _checked(data, path)
    return data


def _read_json(path: Path):
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as error:
        raise BadInput(
            f"{path}: cannot read the calibration ({error.strerror or error}); check the path."
        ) from None
    except (UnicodeDecodeError, ValueError) as error:  # ValueError: also JSONDecodeError
        reason = " ".join(str(error).split())[:120]
        raise BadInput(
            f"{path}: not a readable calibration ({reason}); rerun `lpx calibrate`."
        ) from None
    return data


def _checked(data, path) -> Calibration:
    """The model of ``data``, a calibration lpx can judge with; BadInput naming ``path`` and
    the first problem's JSON path otherwise."""
    if not isinstance(data, dict) or "lpx_calibration" not in data:
        raise BadInput(
            f"{path}: not an lpx calibration (no `lpx_calibration: {CALIBRATION_FORMAT}`); "
            "rerun `lpx calibrate`."
        )
    version = data["lpx_calibration"]
    if version == 1 and type(version) is int:
        raise BadInput(
            f"{path}: a calibration of format 1, made before the precision gate (it lacks the "
            "noise's design and variant levels); rerun `lpx calibrate`."
        )
    if version != CALIBRATION_FORMAT or type(version) is not int:
        raise BadInput(
            f"{path}: lpx_calibration {shown(version)} is not a format this lpx reads "
            f"({CALIBRATION_FORMAT}); rerun `lpx calibrate` with this lpx."
        )
    try:
        return Calibration.model_validate(data)
    except ValidationError as error:
        raise BadInput(
            f"{path}: not a calibration lpx can judge with: {describe(error)}; rerun "
            "`lpx calibrate`."
        ) from None
