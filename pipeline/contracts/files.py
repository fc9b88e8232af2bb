"""The names of the files one stage leaves for the next: one list, read by every stage."""

from __future__ import annotations

REPORT = "report.json"  # compare's verdict, written last: its presence means compare finished
TOKENS = "tokens.parquet"  # compare's token-level drift table
SEQUENCES = "sequences.parquet"  # compare's per-sequence rows and findings' lists (sequences.py)
SUMMARY = "summary.md"  # compare's verdict for people
COMPARE_OUTPUTS = (REPORT, TOKENS, SEQUENCES, SUMMARY)
MANIFEST = "lpx-run.json"  # a run directory's stages and statuses (lpx run, lpx smoke)
CALIBRATION = "calibration.json"  # beside a replay or fixture: compare finds it
LOCALIZE_DIR = "localize"  # beside a failing pair's report.json
LOCALIZE = "localize.json"
BISECT = "bisect.json"  # lpx bisect's answer, rewritten after every probe run
