"""Change points of a series at report time (where a metric's level shifted)."""

from __future__ import annotations


def change_points(values: list) -> list[int]:
    return []
