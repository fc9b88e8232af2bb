"""Does decoding's gap to prefill grow along the completion? (issue 42.1)

Calibration's decode variant costs a forward per token. Decoding only the first K tokens of
each sequence would be exact where it measures and K/length as costly, but only if decoding's
gap to prefill is the same at every position. This scores the calibration bench's fixtures
(bench/calibration.py: 32 sequences x 128 tokens) the calibration's three ways
(`pipeline.calibrate.run.score_ways`) in bf16 and fp32 and prints the mean |d| of decode vs
prefill, and of eager vs prefill, by position bucket.

    .venv/bin/python bench/calibration.py --scales tiny,16x1024,32x512   # makes the fixtures
    .venv/bin/python bench/decode_positions.py --scales tiny,16x1024,32x512

Measured on 2026-11-28 (2-core Xeon): flat at tiny in both precisions; in fp32 decode vs
prefill grows 1.7x from positions 0-8 to 96-128 at 16 x 1024 and 1.4x at 32 x 512.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import _bootstrap  # noqa: F401
import models
import numpy as np

from pipeline.calibrate.run import sample_rows, score_ways
from pipeline.fixture.io import read_table

CACHE = Path.home() / ".cache" / "lpx" / "bench-calibration"  # bench/calibration.py's fixtures
SCALES = {
    "tiny": models.tiny,
    "16x1024": lambda: models.random_llama(16, 1024, 0.05),
    "32x512": lambda: models.random_llama(32, 512, 0.05),
}
BUCKETS = ((0, 8), (8, 16), (16, 32), (32, 64), (64, 96), (96, 128))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scales", default="tiny,16x1024,32x512")
    args = parser.parse_args()
    for scale in args.scales.split(","):
        fixture_path = CACHE / scale / "fixture-fp32.parquet"
        if not fixture_path.is_file():
            sys.exit(f"{fixture_path}: missing; run bench/calibration.py --scales {scale} first")
        fixture = read_table(fixture_path)
        rows = sample_rows(fixture, 32)
        pairs = [(fixture.prompt_of(r), fixture.completion_of(r)) for r in rows]
        positions = np.concatenate([np.arange(len(c)) for _, c in pairs])
        scored, _ = score_ways(SCALES[scale](), pairs, ["bfloat16", "float32"], "cpu", print)
        for precision in ("bfloat16", "float32"):
            prefill = scored[precision, "prefill"].astype(np.float64)
            decode = np.abs(scored[precision, "decode"] - prefill)
            eager = np.abs(scored[precision, "eager"] - prefill)
            measured = np.isfinite(decode)
            print(
                f"{scale} {precision}: mean |d| by position, decode vs prefill | eager vs prefill"
            )
            for low, high in BUCKETS:
                here = (positions >= low) & (positions < high)
                d, e = decode[here & measured].mean(), eager[here].mean()
                print(f"  {low:3d}-{high:3d}: {d:.3g} | {e:.3g}  (ratio {d / e:.2f})")


if __name__ == "__main__":
    main()
