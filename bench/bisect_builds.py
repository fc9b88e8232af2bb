"""`lpx bisect` over eight real transformers releases: wall time, runs, and what each costs.

The releases 5.18.0 ... 5.22.0 (scripts/setup fetches them into .venv/engine-wheels), each
installed offline into an environment layered on lpx's; the Gemma-norm fault is seeded into
5.20.2 and every later one by a patch, so the first bad build is known. The plan is the
nightly's shape on the tiny model (HF rollout, HF fp32 replay, compare with verification).
The environment cache starts empty, so the environments' cost is in the wall time; a second
pass over the same cache (--warm) shows a bisect whose environments are made already.

    .venv/bin/python bench/bisect_builds.py                 # about 4 minutes on two cores
    .venv/bin/python bench/bisect_builds.py --warm --runs 3 --reconfirm 2
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
from pathlib import Path

from _bootstrap import ROOT
from _commands import run_lpx
from packaging.version import Version

from pipeline.faults.releases import norm_patch

WHEELS = ROOT / ".venv" / "engine-wheels"
RELEASES = ["5.18.0", "5.19.0", "5.20.0", "5.20.1", "5.20.2", "5.21.0", "5.21.1", "5.22.0"]
FIRST_BAD = "5.20.2"
PLAN = """version: 1
name: bisect-bench
model: tiny
sampling: {max_tokens: 16, temperature: 1.0, seed: 0}
rollout: {engine: hf, dtype: fp32}
replays: [{name: hf-fp32, engine: hf, dtype: fp32}]
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--reconfirm", type=int, default=3)
    parser.add_argument("--warm", action="store_true", help="bisect twice; report the second")
    options = parser.parse_args()
    if not WHEELS.is_dir():
        sys.exit(f"{WHEELS} is missing: run ./scripts/setup")
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        builds = root / "builds.yaml"
        builds.write_text(_builds(root))
        (root / "plan.yaml").write_text(PLAN)
        env = {"LPX_CACHE": str(root / "cache")}
        passes = 2 if options.warm else 1
        for number in range(passes):
            out = root / f"bisect-{number}"
            argv = ["bisect", root / "plan.yaml"]
            argv += ["--pair", "hf-fp32", "--builds", builds, "--wheelhouse", WHEELS]
            argv += ["--good", f"pip:transformers=={RELEASES[0]}", "--bad", f"{RELEASES[-1]}+gemma"]
            argv += ["--runs", options.runs, "--reconfirm", options.reconfirm]
            argv += ["--out", out]
            wall, done = run_lpx(*argv, env=env)
            if done.returncode != 0:
                sys.exit(f"lpx bisect failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
            if number == passes - 1:
                _print(json.loads((out / "bisect.json").read_text()), wall, options, root)


def _builds(root: Path) -> str:
    lines = []
    for version in RELEASES:
        if Version(version) < Version(FIRST_BAD):
            lines.append(f"- pip:transformers=={version}")
            continue
        wheel = WHEELS / f"transformers-{version}-py3-none-any.whl"
        patch = norm_patch(wheel, root / f"gemma-{version}.patch")
        lines.append(f'- {{name: "{version}+gemma", pip: transformers=={version}, patch: {patch}}}')
    return "\n".join(lines) + "\n"


def _print(state: dict, wall: float, options, root: Path) -> None:
    result, runs = state["result"], state["runs"]
    count = len(RELEASES)
    bound = options.runs * (2 + math.ceil(math.log2(count - 1))) + 2 * options.reconfirm
    right = result["first_bad"] == f"{FIRST_BAD}+gemma"
    print(f"builds: {count}; first bad: {result['first_bad']} ({'right' if right else 'WRONG'})")
    print(
        f"runs: {result['runs']} (bound {bound}: runs x (2 + ceil(log2 {count - 1})) + 2 x reconfirm)"
    )
    print(f"builds probed: {result['builds_probed']}")
    print(f"wall time: {wall:.1f} s ({wall / result['runs']:.1f} s per run, environments included)")
    for outcome in ("good", "bad"):
        seconds = [r["seconds"] for r in runs if r["outcome"] == outcome]
        if seconds:
            print(
                f"  {outcome} run: median {statistics.median(seconds):.1f} s "
                f"(min {min(seconds):.1f}, max {max(seconds):.1f}, n={len(seconds)})"
            )
    for cause in result.get("causes") or []:
        print(f"  first bad's cause: {cause['cause']} ({cause['status']})")
    if result.get("explained_seconds") is not None:
        print(
            f"  the first bad's comparison verified once, at the end: {result['explained_seconds']:.1f} s"
        )
    made = [
        json.loads(p.read_text())["seconds"] for p in (root / "cache").rglob("lpx-environment.json")
    ]
    if made:
        print(
            f"  environment made: median {statistics.median(made):.1f} s (n={len(made)}, cached after)"
        )


if __name__ == "__main__":
    main()
