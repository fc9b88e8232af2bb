"""lpx benchmark: report.json's size and `lpx report`'s time with per-sequence data in
sequences.parquet, against the layout before it (every row and list inline in report.json).

Builds one synthetic comparison (support/synthetic_runs.py:drifting_pair, a tenth of the
sequences drifting, so one finding names tens of thousands), writes it as `lpx compare`
does now and as it did before (the same report with the rows and lists read back inline),
records each into its own history and times `lpx report` on both (whole commands, Python
start included). Targets (issue 54): report.json under 1 MB at 320,000 sequences; `lpx
report` no slower than before.

    .venv/bin/python bench/report_size.py                       # 320,000 sequences
    .venv/bin/python bench/report_size.py --sequences 40000     # a quicker look
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from _bootstrap import ROOT
from _commands import run_lpx

from support.synthetic_runs import drifting_pair

TARGET_REPORT_BYTES = 1_000_000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=int, default=320_000)
    parser.add_argument("--repeats", type=int, default=3, help="`lpx report` runs per layout")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        seconds = write_both(root, args.sequences)
        new, old = root / "new" / "compare", root / "old" / "compare"
        size = {name: (new / name).stat().st_size for name in
                ("report.json", "sequences.parquet", "tokens.parquet")}  # fmt: skip
        before = (old / "report.json").stat().st_size
        print(f"{args.sequences:,} sequences (compare and write: {seconds:.1f} s)")
        print(f"  report.json before: {before / 1e6:9.2f} MB (rows and lists inline)")
        print(
            f"  report.json after:  {size['report.json'] / 1e6:9.3f} MB "
            f"({'meets' if size['report.json'] < TARGET_REPORT_BYTES else 'MISSES'} < 1 MB), "
            f"{before / size['report.json']:.0f}x smaller"
        )
        print(f"  sequences.parquet:  {size['sequences.parquet'] / 1e6:9.2f} MB")
        print(f"  tokens.parquet:     {size['tokens.parquet'] / 1e6:9.2f} MB")
        recorded = {
            layout: timed(["record", str(root / layout), "--db", str(root / f"{layout}.db")])
            for layout in ("old", "new")
        }
        rendered = {"old": [], "new": []}
        for _ in range(args.repeats):  # interleaved: a busy machine slows both alike
            for layout in ("old", "new"):
                site = root / f"site-{layout}"
                rendered[layout].append(
                    timed(["report", "--db", str(root / f"{layout}.db"), "--out", str(site)])
                )
        times = {layout: statistics.median(values) for layout, values in rendered.items()}
        for layout, word in (("old", "before"), ("new", "after ")):
            print(
                f"  {word}: lpx record {recorded[layout]:.2f} s, lpx report {times[layout]:.2f} s "
                f"(median of {args.repeats}), history "
                f"{(root / f'{layout}.db').stat().st_size / 1e6:.2f} MB"
            )
        ratio = times["new"] / times["old"]
        print(
            f"  lpx report after/before: {ratio:.2f} ({'no slower' if ratio <= 1.05 else 'SLOWER'})"
        )


def write_both(root: Path, sequences: int) -> float:
    """The comparison as compare writes it (root/new/compare) and as an older compare did
    (root/old/compare); seconds to compare and write the new one."""
    from pipeline.compare.outputs import write_outputs
    from pipeline.compare.run import compare_tables
    from pipeline.contracts.report import Report
    from pipeline.contracts.sequences import finding_sequences, sequence_rows

    fixture, replay = drifting_pair(sequences)
    started = time.perf_counter()
    comparison = compare_tables(fixture, replay, "fixture.parquet", "replay.parquet")
    new = root / "new" / "compare"
    write_outputs(comparison, new)
    seconds = time.perf_counter() - started
    path = new / "report.json"
    data = json.loads(path.read_text())
    report = Report.model_construct(**data)
    data["sequences"] = sequence_rows(report, path)
    for finding, named in zip(data["diagnosis"], finding_sequences(report, path), strict=True):
        finding["sequences"] = named
        finding.pop("sequence_count")
        finding.pop("sequences_column")
    del data["sequence_table"]
    old = root / "old" / "compare"
    old.mkdir(parents=True)
    (old / "report.json").write_text(json.dumps(data, indent=2))  # as compare indented it
    shutil.copy(new / "tokens.parquet", old)
    return seconds


def timed(argv: list[str]) -> float:
    seconds, result = run_lpx(*argv, cwd=ROOT)
    if result.returncode != 0:
        raise SystemExit(f"lpx {' '.join(argv)} failed: {result.stderr.strip()[-400:]}")
    return seconds


if __name__ == "__main__":
    main()
