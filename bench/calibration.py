"""What `lpx calibrate` costs and what floor it gives, per scale (issue 42).

For each scale (the tiny model; random llamas 16 x 1024 and 32 x 512) an HF fp32 rollout of
32 sequences x 128 completion tokens is made once (cached under ~/.cache/lpx/bench-calibration),
then calibrated for fp32 and bf16 (`calibrate`, as `lpx calibrate --dtype bf16` does). It
prints each precision's calibration time and the same time in forwards: a plain SDPA prefill
of the 32 sequences in micro-batches of 8 in that precision, timed in the same sitting. For
fp32 the fp64 reference is part of its time. Then each pair's floor: its mean, q99 and q999
over the fixture's tokens and the variant it was levelled on.

    .venv/bin/python bench/calibration.py                       # every scale, ~10 minutes
    .venv/bin/python bench/calibration.py --scales tiny --json out.json

To compare two checkouts, run this file with another checkout's PYTHONPATH first
(`--lpx DIR` puts DIR's pipeline/ first on the path).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import _bootstrap

ARGS = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ARGS.add_argument("--scales", default="tiny,16x1024,32x512")
ARGS.add_argument("--lpx", type=Path, default=_bootstrap.ROOT)
ARGS.add_argument("--json", type=Path, help="also write the numbers here")
OPTIONS = ARGS.parse_args()
_bootstrap.put_first(OPTIONS.lpx)

import models  # noqa: E402
import numpy as np  # noqa: E402

from pipeline.calibrate.run import calibrate  # noqa: E402
from pipeline.compare.floor import expect  # noqa: E402
from pipeline.engines.hf.model import load_model  # noqa: E402
from pipeline.engines.hf.replay import ReplayKnobs, score_batches  # noqa: E402
from pipeline.fixture.io import read_table  # noqa: E402

SCALES = {
    "tiny": models.tiny,
    "16x1024": lambda: models.random_llama(16, 1024, 0.05),
    "32x512": lambda: models.random_llama(32, 512, 0.05),
}
SEQUENCES = models.SEQUENCES


def forward_seconds(model_dir: Path, fixture, dtype: str) -> float:
    """One plain prefill of the fixture's sequences (micro-batches of 8) in ``dtype``."""
    pairs = [(fixture.prompt_of(r), fixture.completion_of(r)) for r in range(fixture.num_sequences)]
    model = load_model(model_dir, dtype, device="cpu")
    batches = [pairs[i : i + 8] for i in range(0, len(pairs), 8)]
    score_batches(model, batches[:1], ReplayKnobs(dtype=dtype, device="cpu"), progress=False)
    began = time.perf_counter()
    score_batches(model, batches, ReplayKnobs(dtype=dtype, device="cpu"), progress=False)
    return time.perf_counter() - began


def main() -> None:
    results = {}
    for scale in OPTIONS.scales.split(","):
        model_dir = SCALES[scale]()
        fixture = read_table(models.calibration_fixture(scale, model_dir))
        forward = {d: forward_seconds(model_dir, fixture, d) for d in ("float32", "bfloat16")}
        began = time.perf_counter()
        result = calibrate(fixture, model_dir, ["bfloat16"], SEQUENCES, "cpu", keyed=False)
        total = time.perf_counter() - began
        completion = [fixture.completion_of(r) for r in range(fixture.num_sequences)]
        positions = np.concatenate([np.arange(len(c)) for c in completion])
        surprisal = -np.asarray(fixture.channels["rollout"], dtype=np.float64)[
            np.asarray(fixture.completion_mask, dtype=bool)
        ]
        print(f"\n== {scale} ({OPTIONS.lpx}): calibration {total:.1f} s")
        for name, seconds in result["timing_s"].items():
            print(f"  {name:9s} {seconds:7.1f} s = {seconds / forward[name]:5.1f} forwards "
                  f"(one prefill {forward[name]:.2f} s)")  # fmt: skip
        floors = {}
        for pair, floor in result["pairs"].items():
            expected = expect(floor, surprisal, positions)
            floors[pair] = {
                "mean": float(expected["mean"].mean()),
                "q99": float(expected["q99"].mean()),
                "q999": float(expected["q999"].mean()),
                "levelled_on": max(floor["variant_means"], key=floor["variant_means"].get),
                "allowance": floor["allowance"],
            }
            f = floors[pair]
            print(f"  {pair:18s} mean {f['mean']:.3g}  q99 {f['q99']:.3g}  q999 {f['q999']:.3g}"
                  f"  allowance {f['allowance']:.3f}  widest: {f['levelled_on']}")  # fmt: skip
        results[scale] = {
            "seconds": total,
            "timing_s": result["timing_s"],
            "forward_s": forward,
            "floors": floors,
        }
    if OPTIONS.json:
        OPTIONS.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
