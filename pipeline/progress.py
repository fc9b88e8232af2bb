"""Progress bars on a terminal, silence in CI logs and pipes."""

from __future__ import annotations

import os
import sys


def progress_enabled() -> bool:
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        return False
    if os.environ.get("LPX_PROGRESS", "").lower() in ("0", "false", "no"):
        return False
    return sys.stderr.isatty()


def progress_bar(iterable, desc: str, unit: str = "it", total: int | None = None):
    from tqdm import tqdm

    return tqdm(
        iterable, desc=desc, unit=unit, total=total, disable=not progress_enabled(), leave=False
    )
