"""What a run page shows for one comparison, distilled from its compare outputs at record
time (the run directory may be gone when the report is rendered): worst tokens with their
decoded text, the diagnosis and its evidence, a per-position drift heatmap per sequence,
and everything needed to reproduce the comparison.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from pipeline.fingerprint import tokenizer_fingerprint

HEATMAP_SEQUENCES = 64  # the most drifting sequences get a heatmap row
HEATMAP_COLUMNS = 128  # positions beyond this are binned (max |d| per bin)
SEQUENCE_ROWS = 200  # per-sequence metric rows kept, worst first
CONTEXT_TOKENS = 6  # tokens of left context decoded with each worst token


def comparison_details(report: dict, tokens_path: Path | None, tokenizers: dict) -> dict:
    meta = report.get("metadata") or {}
    fixture, replay = meta.get("fixture") or {}, meta.get("replay") or {}
    tokens = _read_tokens(tokens_path)
    tokenizer = _tokenizer(fixture.get("model") or {}, tokenizers)
    sequences = sorted(
        (row for row in report.get("sequences") or [] if isinstance(row, dict)),
        key=lambda row: -_number(row.get("max_abs_diff")),
    )
    return {
        "worst": [_decoded(row, tokens, tokenizer) for row in report.get("worst") or []],
        "diagnosis": report.get("diagnosis") or [],
        "policy": report.get("policy") or {},
        "sequences": sequences[:SEQUENCE_ROWS],
        "sequence_count": len(sequences),
        "heatmap": _heatmap(tokens, (report.get("policy") or {}).get("tau")),
        "by_region": {
            name: _scalars(values)
            for name, values in ((report.get("metrics") or {}).get("by_region") or {}).items()
            if name != "completion" and isinstance(values, dict)
        },
        "kl_input_drift": _scalars((report.get("metrics") or {}).get("kl_input_drift") or {}),
        "decoded": tokenizer is not None,
        "reproduce": {
            "command_line": meta.get("command_line", ""),
            "fixture": _side(fixture),
            "replay": _side(replay),
        },
    }


def _side(side: dict) -> dict:
    model = side.get("model") or {}
    engine = side.get("engine") or {}
    return {
        "path": side.get("path"),
        "engine": engine.get("name"),
        "versions": engine.get("versions") or {},
        "dtype": side.get("dtype"),
        "knobs": side.get("knobs") or {},
        "sampling": side.get("sampling") or {},
        "layout": side.get("layout") or {},
        "logprob_channels": side.get("logprob_channels") or {},
        "model_path": model.get("path"),
        "weights_fingerprint": model.get("weights_fingerprint"),
        "tokenizer_fingerprint": model.get("tokenizer_fingerprint"),
        "prompt_set_fingerprint": side.get("prompt_set_fingerprint"),
        "injected_faults": side.get("injected_faults"),
        "weights": side.get("weights"),
    }


def _read_tokens(path: Path | None) -> dict | None:
    """tokens.parquet as numpy columns, or None when missing or unreadable (a run page then
    shows token ids without context and no heatmap; the metrics are still recorded)."""
    if path is None:
        return None
    try:
        import pyarrow.parquet as pq

        table = pq.read_table(
            path, columns=["sequence_id", "position", "region", "token_id", "diff"]
        )
    except Exception:  # noqa: BLE001 - a damaged side file must not block recording the run
        return None
    names, sequence_index = _categories(table.column("sequence_id").combine_chunks())
    regions, region_index = _categories(table.column("region").combine_chunks())
    return {
        "names": names,
        "sequence": sequence_index,
        "position": table.column("position").to_numpy(),
        "completion": regions[region_index] == "completion",
        "token_id": table.column("token_id").to_numpy(),
        "diff": table.column("diff").to_numpy(),
    }


def _categories(column) -> tuple[np.ndarray, np.ndarray]:
    """(distinct values, index of each row's value) of a string or dictionary column."""
    if hasattr(column, "dictionary"):
        values = np.asarray(column.dictionary.to_pylist(), dtype=object)
        return values, column.indices.to_numpy(zero_copy_only=False)
    return np.unique(np.asarray(column.to_pylist(), dtype=object), return_inverse=True)


def _tokenizer(model: dict, cache: dict):
    """The fixture's tokenizer when its files are still there and match the fingerprint."""
    path = model.get("path")
    if not path:
        return None
    if path not in cache:
        cache[path] = None
        tokenizer_file = Path(path) / "tokenizer.json"
        if tokenizer_file.is_file() and (
            not model.get("tokenizer_fingerprint")
            or tokenizer_fingerprint(Path(path)) == model["tokenizer_fingerprint"]
        ):
            try:
                from tokenizers import Tokenizer

                cache[path] = Tokenizer.from_file(str(tokenizer_file))
            except Exception:  # noqa: BLE001 - undecodable: ids are shown instead
                cache[path] = None
    return cache[path]


def _decoded(row: dict, tokens: dict | None, tokenizer) -> dict:
    row = dict(row)
    if tokenizer is None:
        return row
    token_id = row.get("token_id")
    if isinstance(token_id, int):
        row["text"] = tokenizer.decode([token_id], skip_special_tokens=False)
    if tokens is not None and isinstance(row.get("position"), int):
        names = list(tokens["names"])
        if row.get("sequence_id") in names:
            index = names.index(row["sequence_id"])
            in_region = tokens["completion"] == (row.get("region", "completion") == "completion")
            mask = (tokens["sequence"] == index) & in_region
            positions, ids = tokens["position"][mask], tokens["token_id"][mask]
            before = ids[
                (positions < row["position"]) & (positions >= row["position"] - CONTEXT_TOKENS)
            ]
            row["context"] = tokenizer.decode([int(i) for i in before], skip_special_tokens=False)
    return row


def _heatmap(tokens: dict | None, tau) -> dict | None:
    """|d| per completion position for the most drifting sequences, binned to fit a row."""
    if tokens is None or not tokens["completion"].any():
        return None
    mask = tokens["completion"]
    sequence, position = tokens["sequence"][mask], tokens["position"][mask]
    drift = np.abs(tokens["diff"][mask].astype(np.float64))
    drift = np.where(np.isfinite(drift), drift, np.inf)
    width = int(position.max()) + 1
    bin_size = max(1, math.ceil(width / HEATMAP_COLUMNS))
    columns = math.ceil(width / bin_size)
    grid = np.full((len(tokens["names"]), columns), np.nan)
    np.fmax.at(grid, (sequence, position // bin_size), drift)
    worst = np.nan_to_num(grid, nan=-1.0).max(axis=1)
    rows = [i for i in np.argsort(-worst, kind="stable") if worst[i] >= 0][:HEATMAP_SEQUENCES]
    return {
        "tau": tau,
        "bin": bin_size,
        "positions": width,
        "rows": [
            {
                "sequence_id": str(tokens["names"][i]),
                "cells": [None if np.isnan(v) else _round(v) for v in grid[i]],
            }
            for i in rows
        ],
    }


def _round(value: float):
    if not math.isfinite(value):
        return "inf"
    return float(f"{value:.3g}")


def _scalars(values: dict) -> dict:
    return {
        k: v
        for k, v in values.items()
        if isinstance(v, (int, float, str)) and not isinstance(v, bool)
    }


def _number(value) -> float:
    return value if isinstance(value, (int, float)) and math.isfinite(value) else math.inf
