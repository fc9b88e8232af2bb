"""Floors kept on disk between runs: a side's level floor (its reference forward against its
declared one) and its local floor (the step rule's) depend only on its weights, engine spec and
layout, dtype, the kernels that run it and the tokens, so a second `lpx localize` over the same
weights and sequences runs no reference forward at all.

One JSON file per (side, sequences), named by a sha256 of everything the floors depend on, in
$LPX_LOCALIZE_FLOOR_CACHE, else $LPX_CACHE/localize-floors, else ~/.cache/lpx/localize-floors.
A file that cannot be read as this format is ignored (and rewritten): a cache never decides a
verdict it could not have reproduced.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from pathlib import Path

CACHE_FORMAT = 1


def cache_dir() -> Path:
    explicit = os.environ.get("LPX_LOCALIZE_FLOOR_CACHE")
    if explicit:
        return Path(explicit)
    root = os.environ.get("LPX_CACHE")
    return (Path(root) if root else Path.home() / ".cache" / "lpx") / "localize-floors"


def floor_key(side, spec: str, model_dir: Path, device: str, sequences) -> str:
    """The sha256 naming one side's floors over `sequences` ([(id, token ids)])."""
    import torch
    import transformers

    described = {
        "format": CACHE_FORMAT,
        "weights": _weights(str(Path(model_dir).resolve()), _stamp(Path(model_dir))),
        "spec": spec,
        "layout": side.layout,
        "dtype": side.dtype,
        "reference_dtype": side.reference_dtype,
        "device": device,
        # the kernels: a floor is what this build's arithmetic does
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "sequences": [[sequence_id, [int(t) for t in ids]] for sequence_id, ids in sequences],
    }
    text = json.dumps(described, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def read(key: str, directory: Path | None = None) -> dict | None:
    """{"level": {...}, "local": {...} or absent} for `key`, or None when not cached."""
    path = (directory or cache_dir()) / f"{key}.json"
    try:
        stored = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(stored, dict) or stored.get("format") != CACHE_FORMAT:
        return None
    if stored.get("key") != key or not isinstance(stored.get("level"), dict):
        return None
    return stored


def write(key: str, floors: dict, directory: Path | None = None) -> None:
    """Store `floors` ({"level": ..., "local": ...}) atomically: a reader never sees half."""
    from pipeline.paths import write_text_atomic

    directory = directory or cache_dir()
    try:
        directory.mkdir(parents=True, exist_ok=True)
        text = json.dumps({"format": CACHE_FORMAT, "key": key, **floors}, allow_nan=False)
        write_text_atomic(directory / f"{key}.json", text + "\n")
    except (OSError, ValueError):
        pass  # a cache that cannot be written costs the next run a forward, nothing else


def _stamp(model_dir: Path) -> tuple:
    """Names, sizes and times of the weight files: a rewritten file is hashed again."""
    from pipeline.fingerprint import WEIGHT_PATTERNS

    files = sorted({p for pattern in WEIGHT_PATTERNS for p in model_dir.glob(pattern)})
    return tuple((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files)


@functools.lru_cache(maxsize=8)
def _weights(model_dir: str, stamp: tuple) -> str:
    """The weights' sha256, hashed once per process for files that did not change."""
    from pipeline.fingerprint import weights_fingerprint

    return weights_fingerprint(Path(model_dir))
