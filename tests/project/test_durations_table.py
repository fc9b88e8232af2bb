"""tests/durations.json, the order the two workers take the files (tests/conftest.py): it
names only files that exist, with seconds a fresh clone measured (scripts/test-durations)."""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_table_names_existing_test_files_with_measured_seconds():
    table = json.loads((ROOT / "tests" / "durations.json").read_text())
    assert len(table) >= 80  # every file of the suite was measured
    missing = [path for path in table if not (ROOT / path).is_file()]
    assert missing == []
    assert all(isinstance(s, int | float) and s >= 0 for s in table.values())
    assert list(table.values()) == sorted(table.values(), reverse=True)  # heaviest first
