"""Captures on disk, one file per (side, sequence, boundary), written as each boundary is
computed and read back one at a time, so no capture is held whole in memory."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np

from pipeline.paths import mark_lpx_directory


class CaptureStore:
    def __init__(self, root: Path):
        self.root = Path(root)
        # marked as lpx's: `remove` deletes it whole, and a rerun may (paths.written_by_lpx)
        mark_lpx_directory(self.root)

    def path(self, side: str, sequence: int, boundary: str) -> Path:
        return self.root / side / str(sequence) / f"{boundary}.npy"

    def write(self, side: str, sequence: int, boundary: str, rows: np.ndarray) -> None:
        path = self.path(side, sequence, boundary)
        path.parent.mkdir(parents=True, exist_ok=True)
        np.save(path, rows, allow_pickle=False)

    def read(self, side: str, sequence: int, boundary: str) -> np.ndarray | None:
        path = self.path(side, sequence, boundary)
        return np.load(path, allow_pickle=False) if path.is_file() else None

    def remove(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
