"""localize.json: what `lpx localize` writes (pipeline/localize/run.py) and `lpx record`
reads, one model. `lpx_localize` marks a file as lpx's (files before the marker have none).
Strict types (no "0.1" for 0.1, no true for 1); fields lpx does not know are kept (a newer
localize may write more)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, StringConstraints

from pipeline.contracts.base import Open
from pipeline.contracts.problems import INT32_MAX, INT64_MAX

VERDICTS = ("clean", "localized", "verified")
SCHEMA_VERSION = 1

# A finite number >= 0: localize.json never writes a non-finite one.
Level = Annotated[float, Field(ge=0, allow_inf_nan=False)]
BoundaryName = Annotated[str, StringConstraints(min_length=1, max_length=128)]  # its column
Index = Annotated[int, Field(ge=0, le=INT32_MAX)]


class First(Open):
    boundary: BoundaryName
    ratio: Level


class Verification(Open):
    verified: bool
    by: str | None = None
    runner: str | None = None
    attempts: list[dict[str, object]] | None = None


class Side(Open):
    spec: str
    engine: str | None = None
    dtype: str | None = None
    reference_dtype: str | None = None
    tp: Index | None = None
    world_size: Index | None = None


class Sides(Open):
    a: Side
    b: Side


class Drift(Open):
    max: Level
    rms: Level


class Boundary(Open):
    boundary: BoundaryName
    layer: Index | None = None
    kind: Annotated[str, StringConstraints(min_length=1, max_length=32)]
    drift: Drift
    floor: Drift
    ratio: Level
    beyond: bool


class LocalizeResult(Open):
    """localize.json (localize/run.py); ``lpx_localize`` marks it as lpx's (files before
    the marker have none)."""

    lpx_localize: Annotated[int, Field(ge=1, le=1)] | None = None
    schema_version: Annotated[int, Field(ge=1, le=1)]
    verdict: Literal[VERDICTS]
    first: First | None = None
    verification: Verification | None = None
    margin: Level
    sides: Sides
    sequences: list[str]
    tokens: Annotated[int, Field(ge=0, le=INT64_MAX)]
    boundaries: list[Boundary]
    seconds: Level | None = None
