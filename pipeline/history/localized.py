"""localize.json as the history reads it: checked like report.json, then split into what the
comparison keeps (verdict, first boundary, verification, sides) and one row per boundary.

`lpx localize` writes it into `localize/` beside a failing pair's report.json (`lpx run` does
so for each failing pair when the plan asks). A file with a wrong type or range is refused,
naming the field, before the database is touched; one that contradicts itself (a clean verdict
with a boundary beyond the floor) makes the run an error run and is not stored. Pure, except
`read_localize`, which reads the file.
"""

from __future__ import annotations

import json
from pathlib import Path

import orjson
from pydantic import ValidationError

from pipeline.contracts.localize import LocalizeResult
from pipeline.contracts.problems import describe
from pipeline.errors import BadInput

# What a pair's localize is when its stage did not leave a localize.json (lpx run).
STAGE_VERDICTS = ("error", "skipped")
BOUNDARY_COLUMNS = (
    "boundary",
    "layer",
    "kind",
    "drift_max",
    "drift_rms",
    "floor_max",
    "floor_rms",
    "ratio",
    "beyond",
)
SUMMARY_KEYS = ("first", "verification", "margin", "sides", "sequences", "tokens", "seconds")


def localize_problems(result) -> list[str]:
    """What is wrong with a localize.json's types and ranges, the first three said in one
    string ("`path`: what is wrong (got VALUE)"); empty when it can be recorded."""
    if not isinstance(result, dict):
        return ["the file must hold a JSON object"]
    try:
        LocalizeResult.model_validate(result)
    except ValidationError as error:
        return [describe(error, count=3)]
    return []


def localize_contradictions(result: dict) -> list[str]:
    """Why a well-formed localize.json cannot be what it says: a verdict its boundaries do
    not bear out, a first boundary that is not the first beyond the floor, a boundary twice."""
    rows = result["boundaries"]
    verdict, first = result["verdict"], result.get("first")
    verified = bool((result.get("verification") or {}).get("verified"))
    beyond = next((row["boundary"] for row in rows if row["beyond"]), None)
    names = [row["boundary"] for row in rows]
    twice = sorted({n for n in names if names.count(n) > 1})
    found = [f"boundary {twice[0]} is listed twice"] if twice else []
    if verdict == "clean" and beyond is not None:
        found.append(f"the verdict is clean but {beyond} is beyond the floor")
    if verdict != "clean" and first is None:
        found.append(f"the verdict is {verdict} but `first` is null")
    if first is not None and first["boundary"] != beyond:
        found.append(
            f"`first` is {first['boundary']} but the first boundary beyond the floor is {beyond}"
        )
    if verdict == "verified" and not verified:
        found.append("the verdict is verified but verification.verified is not true")
    if verdict == "localized" and verified:
        found.append("the verdict is localized but verification.verified is true")
    return found


def read_localize(path: Path) -> dict:
    """A checked localize.json; BadInput naming the file and the first problems otherwise."""
    try:
        data = path.read_bytes()
        try:
            result = orjson.loads(data)
        except orjson.JSONDecodeError:  # NaN literals or a 70-bit integer: checked below
            result = json.loads(data.decode())
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise BadInput(
            f"{path}: corrupt localize result ({error}); rerun `lpx localize` for this pair or "
            "remove its localize/ directory. Nothing was recorded."
        ) from None
    problems = localize_problems(result)
    if problems:
        raise BadInput(
            f"{path}: not a localize.json as `lpx record` reads it: {problems[0]}. Rerun "
            "`lpx localize` for this pair (or remove its localize/ directory); nothing was "
            "recorded."
        )
    return result


def summary(result: dict, path: Path | None) -> dict:
    """What the comparison keeps besides the boundary rows (the run page's facts)."""
    kept = {key: result.get(key) for key in SUMMARY_KEYS}
    return {**kept, "path": str(path) if path else None}


def stage_summary(message: str) -> dict:
    """A localize stage that wrote no localize.json: its message is all there is."""
    return {"message": message}


def boundary_rows(result: dict) -> list[tuple]:
    """One tuple per boundary in BOUNDARY_COLUMNS order, in the file's (network) order."""
    return [
        (
            row["boundary"],
            row.get("layer"),
            row["kind"],
            float(row["drift"]["max"]),
            float(row["drift"]["rms"]),
            float(row["floor"]["max"]),
            float(row["floor"]["rms"]),
            float(row["ratio"]),
            bool(row["beyond"]),
        )
        for row in result["boundaries"]
    ]


def localize_columns(pair) -> dict:
    """The comparison's localize_verdict, localize_boundary and localize summary, from a
    `collect.PairInput` (not imported: collect reads localize results through this module)."""
    if pair.localize is not None:
        first = pair.localize.get("first") or {}
        return dict(
            localize_verdict=pair.localize["verdict"],
            localize_boundary=first.get("boundary"),
            localize=summary(pair.localize, pair.localize_path),
        )
    if pair.localize_stage is not None:
        return dict(
            localize_verdict=pair.localize_stage["verdict"],
            localize_boundary=None,
            localize=stage_summary(pair.localize_stage["message"]),
        )
    return dict(localize_verdict=None, localize_boundary=None, localize=None)
