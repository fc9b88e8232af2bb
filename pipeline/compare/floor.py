"""A model's precision noise floor: how far two correct scorings of the same tokens differ,
per bucket of token surprisal and position, and what that predicts for a compared batch.

Pure numpy. `fit_floor` turns |d| samples (from `lpx calibrate`'s re-scorings) into a small
JSON-able table; `expect` reads it back for each token of a comparison: the floor's mean and
spread, its tail quantiles, and a sketch of its distribution, from which the precision gate
(`precision_gate.py`) gives any batch statistic's distribution under pure noise.

Tokens are bucketed by surprisal (-logprob of the reference) and by completion position:
low-probability tokens and long contexts drift more under low precision. A cell with too
few samples falls back to its surprisal row, then to the whole pair.
"""

from __future__ import annotations

import numpy as np

SURPRISAL_EDGES = (0.0, 0.01, 0.1, 0.5, 1.0, 2.0, 4.0, 8.0)  # nats; the last bin is open
POSITION_EDGES = (0, 16, 64, 256, 1024)  # completion positions; the last bin is open
MIN_CELL = 40  # samples a cell needs to stand on its own
SKETCH = 128  # quantiles kept per cell: the distribution's shape, for batch statistics
QUANTILES = {"q50": 0.5, "q90": 0.9, "q99": 0.99, "q999": 0.999}
# What `expect` reads per token: the level, spread and skew of |d| (the gate's mean test), its
# tail quantiles (the exceedance tests), and the other mean-type metrics' moments.
MOMENTS = (
    "n",
    "mean",
    "var",
    "m3",
    "q99",
    "q999",
    "mean_sq",
    "var_sq",
    "mean_expm1",
    "var_expm1",
)


def fit_floor(abs_diff, surprisal, position) -> dict:
    """The floor of one dtype pair from |d| samples and each sample's bucket coordinates."""
    abs_diff = np.asarray(abs_diff, dtype=np.float64)
    s_bin, p_bin = bucket_of(surprisal, position)
    cells = {}
    for s in range(len(SURPRISAL_EDGES)):
        row = s_bin == s
        if row.any():
            cells[f"{s}"] = _cell(abs_diff[row])
        for p in range(len(POSITION_EDGES)):
            mine = row & (p_bin == p)
            if mine.sum() >= MIN_CELL:
                cells[f"{s},{p}"] = _cell(abs_diff[mine])
    return {
        "tokens": int(len(abs_diff)),
        "all": _cell(abs_diff),
        "cells": cells,
        "surprisal_edges": list(SURPRISAL_EDGES),
        "position_edges": list(POSITION_EDGES),
    }


def expect(floor: dict, surprisal, position) -> dict:
    """Per token: its cell's moments (MOMENTS: mean, variance and third central moment of
    |d|, q99 and q999, mean d^2 and expm1(|d|) with their variances), and the index of the
    cell each token reads (for sketches and per-cell sample counts)."""
    s_bin, p_bin = bucket_of(surprisal, position, floor)
    names, choose = _cell_table(floor)
    cell_of = choose[s_bin, p_bin]
    cells = [_lookup(floor, name) for name in names]
    out = {}
    for key in MOMENTS:
        out[key] = np.array([cell.get(key, np.nan) for cell in cells], dtype=np.float64)[cell_of]
    out["cells"] = cells
    out["cell_of"] = cell_of
    return out


def mixture_quantile(expected: dict, q: float) -> float:
    """The q-quantile of |d| under pure noise for the compared tokens: their cells'
    sketches, weighted by how many tokens read each."""
    counts = np.bincount(expected["cell_of"], minlength=len(expected["cells"]))
    values, weights = [], []
    for cell, count in zip(expected["cells"], counts, strict=True):
        if count:
            sketch = np.asarray(cell["sketch"], dtype=np.float64)
            values.append(sketch)
            weights.append(np.full(len(sketch), count / len(sketch)))
    if not values:
        return 0.0
    values, weights = np.concatenate(values), np.concatenate(weights)
    order = np.argsort(values)
    cumulative = np.cumsum(weights[order]) / weights.sum()
    return float(values[order][min(np.searchsorted(cumulative, q), len(values) - 1)])


def _cell(values: np.ndarray) -> dict:
    cell = {"n": int(len(values)), "mean": float(values.mean()), "max": float(values.max())}
    cell.update({name: float(np.quantile(values, q)) for name, q in QUANTILES.items()})
    centred = values - values.mean()
    cell["var"] = float(np.mean(centred**2))
    cell["m3"] = float(np.mean(centred**3))
    squared, grown = values * values, np.expm1(values)
    cell["mean_sq"], cell["var_sq"] = float(squared.mean()), float(squared.var())
    cell["mean_expm1"], cell["var_expm1"] = float(grown.mean()), float(grown.var())
    grid = (np.arange(SKETCH) + 0.5) / SKETCH
    cell["sketch"] = [float(v) for v in np.quantile(values, grid)]
    return cell


def bucket_of(surprisal, position, floor: dict | None = None):
    """Each token's (surprisal bin, position bin) under the floor's edges (the defaults without one)."""
    s_edges = np.asarray((floor or {}).get("surprisal_edges", SURPRISAL_EDGES), dtype=np.float64)
    p_edges = np.asarray((floor or {}).get("position_edges", POSITION_EDGES), dtype=np.float64)
    surprisal = np.nan_to_num(np.asarray(surprisal, dtype=np.float64), nan=0.0, posinf=1e9)
    s_bin = np.clip(np.searchsorted(s_edges, surprisal, side="right") - 1, 0, len(s_edges) - 1)
    p_bin = np.clip(
        np.searchsorted(p_edges, np.asarray(position, dtype=np.float64), side="right") - 1,
        0,
        len(p_edges) - 1,
    )
    return s_bin, p_bin


def _cell_table(floor: dict) -> tuple[list[str], np.ndarray]:
    """The cell names, and for each (surprisal bin, position bin) the index of the name it
    reads: its own cell, else its surprisal row, else the whole pair."""
    cells = floor["cells"]
    shape = (len(floor["surprisal_edges"]), len(floor["position_edges"]))
    names: list[str] = []
    choose = np.zeros(shape, dtype=np.int64)
    for s in range(shape[0]):
        for p in range(shape[1]):
            name = f"{s},{p}" if f"{s},{p}" in cells else f"{s}" if f"{s}" in cells else "all"
            if name not in names:
                names.append(name)
            choose[s, p] = names.index(name)
    return names, choose


def _lookup(floor: dict, name: str) -> dict:
    return floor["all"] if name == "all" else floor["cells"][name]
