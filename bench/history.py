"""lpx benchmark: a year of nightly history (365 runs x 50 series x 20 metrics).

Prints one line per target of the history issue with the measured value and its ratio:
recording the year (one import of every night) in under 10 s, plus the latency of one
night recorded in its own transaction, as the nightly job does, rendering the full report in under 10 s with no page over 2 MB, and `lpx gate`
answering in under 1 s.

    .venv/bin/python bench/history.py                  # SQLite
    .venv/bin/python bench/history.py --postgres       # also a PostgreSQL 16 (pgserver)
    .venv/bin/python bench/history.py --nights 90      # a quicker look
"""

from __future__ import annotations

import argparse
import itertools
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timedelta
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipeline.history.collect import collect_run  # noqa: E402
from pipeline.history.database import open_history  # noqa: E402
from pipeline.history.record import record_runs  # noqa: E402
from pipeline.report.site import build_site  # noqa: E402
from tests.synthetic_runs import BASE_METRICS, pair_report, write_run  # noqa: E402

TARGET_RECORD_S = 10.0
TARGET_RENDER_S = 10.0
TARGET_PAGE_BYTES = 2_000_000
TARGET_GATE_S = 1.0
ENGINES = ("hf", "fsdp", "deepspeed", "megatron", "vllm")
DTYPES = ("bfloat16", "float32")
TENSOR_PARALLEL = (1, 2, 4, 8, 16)


def make_year(root: Path, nights: int, series: int) -> list[Path]:
    """``nights`` run directories with ``series`` comparisons each (engine x dtype x TP),
    noisy metrics, two vLLM upgrades and one real step on a few series."""
    rng = np.random.default_rng(0)
    combos = list(itertools.product(ENGINES, DTYPES, TENSOR_PARALLEL))[:series]
    start = datetime(2026, 1, 1, 3, 0)
    dirs = []
    for night in range(nights):
        version = "0.30.0" if night < nights // 3 else "0.31.0" if night < 2 * nights // 3 else "0.32.0"
        pairs = {}
        for index, (engine, dtype, tp) in enumerate(combos):
            scale = 1.0 if dtype == "bfloat16" else 1e-4
            step = 3.0 if index % 17 == 0 and night >= 2 * nights // 3 else 1.0
            noise = np.exp(rng.normal(0, 0.05, len(BASE_METRICS)))
            metrics = {
                name: value * scale * step * float(n)
                for (name, value), n in zip(BASE_METRICS.items(), noise, strict=True)
            }
            pairs[f"{index:02d}-{engine}-tp{tp}-{dtype}"] = pair_report(
                replay=engine, rollout_version=version, replay_dtype=dtype, rollout_dtype=dtype,
                tp=tp, metrics=metrics, sequence_ids=[f"{night}-{i}" for i in range(4)],
            )
        dirs.append(write_run(root / f"night-{night:03d}", pairs,
                              started_at=start + timedelta(days=night), tokens=True))
    return dirs


def measure(url: str, runs: list[Path], site: Path, nightly_url: str) -> dict:
    """The year recorded as one import (`lpx record` of every night: read, judge, one
    transaction), then the same nights recorded one transaction each into a second database,
    as a nightly job does, for the per-night latency."""
    history = open_history(url)
    started = time.perf_counter()
    record_runs(history, [collect_run(run) for run in runs])
    record_s = time.perf_counter() - started
    nightly = open_history(nightly_url)
    started = time.perf_counter()
    for run in runs:
        record_runs(nightly, [collect_run(run)])
    nightly_s = (time.perf_counter() - started) / len(runs)
    nightly.dispose()
    started = time.perf_counter()
    index = build_site(history, site)
    render_s = time.perf_counter() - started
    history.dispose()
    pages = list(index.parent.rglob("*.html"))
    largest = max(pages, key=lambda p: p.stat().st_size)
    started = time.perf_counter()
    gate = subprocess.run([sys.executable, "-m", "pipeline", "gate", "--db", url, "--fail-on", "never"],
                          capture_output=True, text=True, cwd=ROOT)
    gate_s = time.perf_counter() - started
    assert gate.returncode in (0, 1), gate.stderr
    return {"record_s": record_s, "nightly_s": nightly_s, "render_s": render_s, "pages": len(pages),
            "largest": largest, "largest_bytes": largest.stat().st_size, "gate_s": gate_s}


def report(name: str, numbers: dict, nights: int, series: int) -> None:
    metrics = nights * series * len(BASE_METRICS)
    print(f"[{name}] {nights} runs x {series} series x {len(BASE_METRICS)} metrics = {metrics:,} values")
    print(f"  record   {numbers['record_s']:7.2f} s  ({nights / numbers['record_s']:.0f} runs/s)   "
          f"ratio to 10 s target: {numbers['record_s'] / TARGET_RECORD_S:.2f}")
    print(f"  one night ({series} comparisons) recorded in its own transaction: "
          f"{numbers['nightly_s'] * 1e3:.0f} ms")
    print(f"  render   {numbers['render_s']:7.2f} s  ({numbers['pages']} pages)   "
          f"ratio to 10 s target: {numbers['render_s'] / TARGET_RENDER_S:.2f}")
    print(f"  largest page {numbers['largest_bytes'] / 1e6:6.2f} MB ({numbers['largest'].name})   "
          f"ratio to 2 MB: {numbers['largest_bytes'] / TARGET_PAGE_BYTES:.2f}")
    print(f"  lpx gate {numbers['gate_s']:7.2f} s (whole command)   "
          f"ratio to 1 s target: {numbers['gate_s'] / TARGET_GATE_S:.2f}")


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
        print(f"generated {len(runs)} run directories in {time.perf_counter() - started:.0f} s (not timed)")
        report("sqlite", measure(f"sqlite:///{tmp / 'lpx.db'}", runs, tmp / "site-sqlite",
                                 f"sqlite:///{tmp / 'nightly.db'}"), args.nights, args.series)
        if args.postgres:
            import pgserver

            server = pgserver.get_server(tmp / "pg", cleanup_mode="delete")
            try:
                server.psql("CREATE DATABASE lpx_bench;")
                server.psql("CREATE DATABASE lpx_nightly;")
                base, query = server.get_uri().split("?", 1)
                url = base.rsplit("/", 1)[0].replace("postgresql://", "postgresql+psycopg://")
                report("postgresql", measure(f"{url}/lpx_bench?{query}", runs, tmp / "site-pg",
                                             f"{url}/lpx_nightly?{query}"), args.nights, args.series)
            finally:
                server.cleanup()


if __name__ == "__main__":
    main()
