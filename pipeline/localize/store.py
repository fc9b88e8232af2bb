"""Captures on disk, one file per (side, sequence, boundary), written as each boundary is
computed and read back one at a time, so no capture is held whole in memory."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np


class CaptureStore:
    def __init__(self, root: Path):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def path(self, side: str, sequence: int, boundary: str) -> Path:
        return self.root / side / str(sequence) / f"{boundary}.npy"

    def writer(self, side: str, sequence: int):
        folder = self.root / side / str(sequence)
        folder.mkdir(parents=True, exist_ok=True)

        def write(boundary: str, rows: np.ndarray) -> None:
            np.save(folder / f"{boundary}.npy", rows, allow_pickle=False)

        return write

    def read(self, side: str, sequence: int, boundary: str) -> np.ndarray | None:
        path = self.path(side, sequence, boundary)
        return np.load(path, allow_pickle=False) if path.is_file() else None

    def remove(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
