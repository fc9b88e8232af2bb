"""Small helpers for tests: run the real CLI in-process and read its report."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from pipeline.cli import cli


def run_lpx(*args: str):
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)


def read_report(out_dir: Path) -> dict:
    return json.loads((Path(out_dir) / "report.json").read_text())
