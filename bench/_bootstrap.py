"""The one import bootstrap of bench/: every script imports it first (`import _bootstrap`), so
`pipeline` and `support` come from this checkout however the script is started.

A script run as `python bench/NAME.py` has bench/ first on sys.path (its siblings, `models`
among them, import by name); this puts the repo root right behind it, once.
"""

from __future__ import annotations

import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent


def put_first(checkout: Path | str) -> None:
    """Import from ``checkout`` before anything else: another checkout of lpx (a before and
    after in one sitting) or a library's source tree. Call it before importing from there."""
    entry = str(Path(checkout).resolve())
    if entry in sys.path:
        sys.path.remove(entry)
    sys.path.insert(0, entry)


def _behind_bench(root: Path) -> None:
    entry = str(root)
    if entry not in sys.path:
        at = 1 if sys.path and Path(sys.path[0] or ".").resolve() == BENCH else 0
        sys.path.insert(at, entry)


_behind_bench(ROOT)
