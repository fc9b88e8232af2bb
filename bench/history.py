"""lpx benchmark: a year of nightly history (365 runs x 50 series x 20 metrics).

Times whole `lpx` commands as users run them (Python start included) and prints each
target of the history issue with its ratio: `lpx record` importing the year (< 10 s), one
night recorded by its own `lpx record` as a nightly job does, `lpx report` of the full
history (< 10 s, no page over 2 MB), `lpx gate` (< 1 s), and the failing inputs (a corrupt
report, a gate on an error run).

    .venv/bin/python bench/history.py                  # SQLite
    .venv/bin/python bench/history.py --postgres       # also a PostgreSQL 16 (pgserver)
    .venv/bin/python bench/history.py --nights 90      # a quicker look
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import subprocess
import tempfile
import time
from datetime import datetime, timedelta
from pathlib import Path

import numpy as np
from _bootstrap import ROOT
from _commands import run_lpx

from support.synthetic_runs import BASE_METRICS, pair_report, write_run

TARGET_RECORD_S = 10.0
TARGET_RENDER_S = 10.0
TARGET_PAGE_BYTES = 2_000_000
TARGET_GATE_S = 1.0
NIGHTLY_SAMPLES = 5  # the last nights, each recorded by its own `lpx record`
ENGINES = ("hf", "fsdp", "deepspeed", "megatron", "vllm")
DTYPES = ("bfloat16", "float32")
TENSOR_PARALLEL = (1, 2, 4, 8, 16)
AT_ONE = ("ess", "is_ratio_mean", "token_mult_prob_error")


def make_year(root: Path, nights: int, series: int) -> list[Path]:
    """``nights`` run directories with ``series`` comparisons each (engine x dtype x TP),
    noisy metrics, two vLLM upgrades and one real step on a few series."""
    rng = np.random.default_rng(0)
    combos = list(itertools.product(ENGINES, DTYPES, TENSOR_PARALLEL))[:series]
    start = datetime(2026, 1, 1, 3, 0)
    dirs = []
    for night in range(nights):
        version = (
            "0.30.0" if night < nights // 3 else "0.31.0" if night < 2 * nights // 3 else "0.32.0"
        )
        pairs = {}
        for index, (engine, dtype, tp) in enumerate(combos):
            scale = 1.0 if dtype == "bfloat16" else 1e-4
            step = 3.0 if index % 17 == 0 and night >= 2 * nights // 3 else 1.0
            noise = np.exp(rng.normal(0, 0.05, len(BASE_METRICS)))
            metrics = {
                name: _moved(name, value, scale * step * float(n))
                for (name, value), n in zip(BASE_METRICS.items(), noise, strict=True)
            }
            pairs[f"{index:02d}-{engine}-tp{tp}-{dtype}"] = pair_report(
                replay=engine,
                rollout_version=version,
                replay_dtype=dtype,
                rollout_dtype=dtype,
                tp=tp,
                metrics=metrics,
                sequence_ids=[f"{night}-{i}" for i in range(4)],
            )
        dirs.append(
            write_run(
                root / f"night-{night:03d}",
                pairs,
                started_at=start + timedelta(days=night),
                tokens=True,
            )
        )
    return dirs


def _moved(name: str, value: float, factor: float) -> float:
    """``value`` drifted by ``factor``: ratios that are 1 when nothing drifts (ESS, IS ratio
    mean, multiplicative probability error) move their distance from 1, so every value stays
    in the range `lpx record` accepts."""
    if name in AT_ONE:
        return 1.0 + (value - 1.0) * factor
    return value * factor


def lpx(*args) -> tuple[float, subprocess.CompletedProcess]:
    """One whole `lpx` command as a user runs it (Python start and imports included), with CI
    set as a nightly job has it (no progress bars)."""
    return run_lpx(*args, cwd=ROOT, env={"CI": "true"})


def measure(url: str, runs: list[Path], site: Path, tmp: Path) -> dict:
    """Whole commands: the year imported by one `lpx record` (all but the last nights), the
    last nights each recorded by its own `lpx record` as a nightly job does, `lpx report`,
    `lpx gate`, and the failing inputs users hit (a corrupt report, an error run)."""
    last = runs[-NIGHTLY_SAMPLES:]
    record_s, result = lpx("record", *runs[:-NIGHTLY_SAMPLES], "--db", url)
    assert result.returncode == 0, result.stderr
    nightly = []
    for run in last:
        seconds, result = lpx("record", run, "--db", url)
        assert result.returncode == 0, result.stderr
        nightly.append(seconds)
    render_s, result = lpx("report", "--db", url, "--out", site)
    assert result.returncode == 0, result.stderr
    pages = list(site.rglob("*.html"))
    largest = max(pages, key=lambda p: p.stat().st_size)
    gate_s, result = lpx("gate", "--db", url, "--fail-on", "never")
    assert result.returncode in (0, 1), result.stderr
    corrupt = tmp / "corrupt-run" / "compare"
    corrupt.mkdir(parents=True, exist_ok=True)
    (corrupt / "report.json").write_text('{"verdict": "pass", "metrics": ')
    corrupt_s, result = lpx("record", corrupt.parent, "--db", url)
    assert result.returncode == 2, result.stderr
    broken = write_run(
        tmp / "error-run",
        {"c": pair_report()},
        started_at=datetime(2027, 6, 1),
        stage_errors=["replay: CUDA out of memory"],
    )
    lpx("record", broken, "--db", url)
    error_gate_s, result = lpx("gate", "--db", url)
    assert result.returncode == 2, result.stderr
    return {
        "record_s": record_s,
        "recorded": len(runs) - NIGHTLY_SAMPLES,
        "nightly_s": statistics.median(nightly),
        "render_s": render_s,
        "pages": len(pages),
        "largest": largest,
        "largest_bytes": largest.stat().st_size,
        "gate_s": gate_s,
        "corrupt_s": corrupt_s,
        "error_gate_s": error_gate_s,
    }


def report(name: str, numbers: dict, nights: int, series: int) -> None:
    metrics = nights * series * len(BASE_METRICS)
    print(
        f"[{name}] {nights} runs x {series} series x {len(BASE_METRICS)} metrics = {metrics:,} values"
        " (whole lpx commands, Python start included)"
    )
    # The import covers all but the last nights: scale to the year for the target.
    year_s = numbers["record_s"] * nights / numbers["recorded"]
    print(
        f"  lpx record of {numbers['recorded']} runs {numbers['record_s']:7.2f} s "
        f"(a year: {year_s:.2f} s)   ratio to 10 s target: {year_s / TARGET_RECORD_S:.2f}"
    )
    print(
        f"  lpx record of one night ({series} comparisons), median of {NIGHTLY_SAMPLES}: "
        f"{numbers['nightly_s']:.2f} s"
    )
    print(
        f"  lpx report {numbers['render_s']:7.2f} s  ({numbers['pages']} pages)   "
        f"ratio to 10 s target: {numbers['render_s'] / TARGET_RENDER_S:.2f}"
    )
    print(
        f"  largest page {numbers['largest_bytes'] / 1e6:6.2f} MB ({numbers['largest'].name})   "
        f"ratio to 2 MB: {numbers['largest_bytes'] / TARGET_PAGE_BYTES:.2f}"
    )
    print(
        f"  lpx gate {numbers['gate_s']:7.2f} s   ratio to 1 s target: {numbers['gate_s'] / TARGET_GATE_S:.2f}"
    )
    print(
        f"  failing inputs: lpx record of a corrupt report {numbers['corrupt_s']:.2f} s (exit 2), "
        f"lpx gate on an error run {numbers['error_gate_s']:.2f} s (exit 2)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nights", type=int, default=365)
    parser.add_argument("--series", type=int, default=50)
    parser.add_argument("--postgres", action="store_true", help="Also measure PostgreSQL 16.")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        started = time.perf_counter()
        runs = make_year(tmp / "runs", args.nights, args.series)
        print(
            f"generated {len(runs)} run directories in {time.perf_counter() - started:.0f} s (not timed)"
        )
        report(
            "sqlite",
            measure(f"sqlite:///{tmp / 'lpx.db'}", runs, tmp / "site-sqlite", tmp),
            args.nights,
            args.series,
        )
        if args.postgres:
            import pgserver

            server = pgserver.get_server(tmp / "pg", cleanup_mode="delete")
            try:
                server.psql("CREATE DATABASE lpx_bench;")
                base, query = server.get_uri().split("?", 1)
                url = base.rsplit("/", 1)[0].replace("postgresql://", "postgresql+psycopg://")
                report(
                    "postgresql",
                    measure(f"{url}/lpx_bench?{query}", runs, tmp / "site-pg", tmp),
                    args.nights,
                    args.series,
                )
            finally:
                server.cleanup()


if __name__ == "__main__":
    main()
