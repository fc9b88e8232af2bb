"""A validation error said the way lpx says bad input: "`json.path`: what is wrong (got
VALUE)", the first few on one line, every control character visible (other people's text
never reaches the terminal raw)."""

from __future__ import annotations

from pydantic import ValidationError
from pydantic_core import PydanticCustomError

from pipeline.text import for_terminal

INT64_MAX = 2**63 - 1
INT32_MAX = 2**31 - 1


def must_be(expected: str) -> PydanticCustomError:
    """The error a check of lpx's own raises: "must be a number >= 0"."""
    return PydanticCustomError("lpx_expected", "must be {expected}", {"expected": expected})


def describe(error: ValidationError, count: int = 1) -> str:
    """The first ``count`` problems of a validation, each as "`json.path`: what is wrong
    (got VALUE)", on one line with every control character visible."""
    problems = error.errors()
    said = []
    for problem in problems[:count]:
        where = json_path(problem["loc"])
        message = problem["msg"].removeprefix("Value error, ")
        got = "" if problem["type"] == "value_error" else f" (got {shown(problem.get('input'))})"
        if problem["type"] == "missing":
            got = ""
        said.append(f"`{where}`: {message}{got}" if where else f"{message}{got}")
    more = len(problems) - count
    text = "; ".join(said) + (f" (and {more} more)" if more > 0 else "")
    return for_terminal(" ".join(text.split()))


def json_path(loc) -> str:
    """("pairs", "a|b", "cells", 3) as pairs.a|b.cells[3]."""
    text = ""
    for part in loc:
        if isinstance(part, int):
            text += f"[{part}]"
        else:
            text += ("." if text else "") + str(part)
    return text


def shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
