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
    # Pick the rows first (each sequence's worst token), then bin only their tokens.
    worst = np.full(len(names), -1.0)
    _segment_max(worst, sequence_index, drift)
    order = np.argsort(-worst, kind="stable")
    rows = order[worst[order] >= 0][:MAP_SEQUENCES].tolist()
    row_of = np.full(len(names), -1)
    row_of[rows] = np.arange(len(rows))
    keep = row_of[sequence_index] >= 0
    grid = np.full((len(rows), math.ceil(width / bin_size)), np.nan)
    np.fmax.at(grid, (row_of[sequence_index[keep]], positions[keep] // bin_size), drift[keep])
    shown = _three_significant(grid)
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


def _segment_max(out: np.ndarray, sequence_index: np.ndarray, values: np.ndarray) -> None:
    """out[s] = max(out[s], values of sequence s); fast when tokens come in sequence order."""
    if np.all(sequence_index[1:] >= sequence_index[:-1]):
        starts = np.flatnonzero(np.r_[True, sequence_index[1:] != sequence_index[:-1]])
        seqs = sequence_index[starts]
        out[seqs] = np.maximum(out[seqs], np.maximum.reduceat(values, starts))
    else:
        np.maximum.at(out, sequence_index, values)


def _three_significant(values: np.ndarray) -> np.ndarray:
    """Round to 3 significant digits (what a heatmap cell shows), NaN and inf kept."""
    with np.errstate(divide="ignore", invalid="ignore"):
        finite = np.isfinite(values) & (values != 0)
        exponent = np.where(finite, np.floor(np.log10(np.abs(values), where=finite)), 0)
        scale = 10.0 ** (exponent - 2)
        return np.where(finite, np.round(values / scale) * scale, values)
