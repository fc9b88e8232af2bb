"""The per-position drift map: |d| per completion position for the most drifting sequences,
binned to fit a row. report.json carries it, so a run page can draw its heatmap from the
report alone (the history stores reports, not token tables)."""

from __future__ import annotations

import math

import numpy as np

MAP_SEQUENCES = 64  # the most drifting sequences get a row
MAP_COLUMNS = 128  # longer completions are binned: max |d| per bin


def drift_map(
    names, sequence_index: np.ndarray, positions: np.ndarray, abs_diff: np.ndarray, tau
) -> dict | None:
    """``sequence_index``, ``positions`` and ``abs_diff`` are per token (completion region);
    ``names[i]`` is sequence i's id. Non-finite drift is kept as "inf"."""
    if not len(abs_diff):
        return None
    drift = np.where(np.isfinite(abs_diff), np.abs(abs_diff.astype(np.float64)), np.inf)
    width = int(positions.max()) + 1
    bin_size = max(1, math.ceil(width / MAP_COLUMNS))
    grid = np.full((len(names), math.ceil(width / bin_size)), np.nan)
    np.fmax.at(grid, (sequence_index, positions // bin_size), drift)
    worst = np.nan_to_num(grid, nan=-1.0).max(axis=1)
    rows = [int(i) for i in np.argsort(-worst, kind="stable") if worst[i] >= 0][:MAP_SEQUENCES]
    shown = _three_significant(grid[rows])
    return {
        "tau": tau,
        "bin": bin_size,
        "positions": width,
        "rows": [
            {
                "sequence_id": str(names[i]),
                "cells": [None if v != v else "inf" if v == np.inf else v for v in row.tolist()],
            }
            for i, row in zip(rows, shown, strict=True)
        ],
    }


def _three_significant(values: np.ndarray) -> np.ndarray:
    """Round to 3 significant digits (what a heatmap cell shows), NaN and inf kept."""
    with np.errstate(divide="ignore", invalid="ignore"):
        finite = np.isfinite(values) & (values != 0)
        exponent = np.where(finite, np.floor(np.log10(np.abs(values), where=finite)), 0)
        scale = 10.0 ** (exponent - 2)
        return np.where(finite, np.round(values / scale) * scale, values)
