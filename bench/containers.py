"""The container smoke against the same plan run locally, image sizes, and rebuild times.

    .venv/bin/python bench/containers.py            # needs Docker and the CPU images
    .venv/bin/python bench/containers.py --rebuild  # also time a source-only rebuild

Targets (issue 9): the container smoke under 3 minutes and within 1.5x of `--runner local`.
Build the images first: scripts/docker-base, scripts/wheelhouse train|vllm, then
`docker compose build train-image vllm-image` (docs/containers.md).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _bootstrap import ROOT
from _commands import run_lpx

PLAN = ROOT / "examples" / "smoke.yaml"
IMAGES = ("lpx-train:cpu", "lpx-vllm:cpu")


def timed_run(runner: str, work: Path) -> tuple[float, dict]:
    run_dir = work / f"run-{runner}"
    seconds, result = run_lpx(
        "run", PLAN, "--runner", runner, "--out", run_dir, "--db", work / f"{runner}.db",
        "--report-out", work / runner, cwd=work,
    )  # fmt: skip
    if result.returncode != 0:
        sys.exit(f"{runner} run failed:\n{result.stdout[-2000:]}{result.stderr[-2000:]}")
    manifest = json.loads((run_dir / "lpx-run.json").read_text())
    return seconds, {s["name"]: s.get("seconds") for s in manifest["stages"]}


def image_size_gb(image: str) -> float:
    out = subprocess.run(
        ["docker", "image", "inspect", image, "--format", "{{.Size}}"],
        capture_output=True,
        text=True,
        check=True,
    )
    return int(out.stdout.strip()) / 1e9


def source_only_rebuild() -> float:
    """Rebuild lpx-train:cpu after touching one source file: only lpx's layers rebuild."""
    marker = ROOT / "pipeline" / "_bench_marker.py"
    marker.write_text(f"# {time.time()}\n")
    try:
        start = time.monotonic()
        subprocess.run(
            [
                "docker",
                "build",
                "-q",
                "-f",
                "Dockerfile.megatron",
                "-t",
                "lpx-train:cpu",
                "--build-arg",
                "BASE_IMAGE=lpx-base:bookworm",
                "--build-arg",
                "WHEELHOUSE=wheelhouse/train",
                ".",
            ],
            cwd=ROOT,
            check=True,
            capture_output=True,
        )
        return time.monotonic() - start
    finally:
        marker.unlink()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rebuild", action="store_true", help="also time a source-only rebuild")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        local, local_stages = timed_run("local", work)
        docker, docker_stages = timed_run("docker", work)
    print(f"smoke plan, local runner:  {local:6.1f} s")
    print(
        f"smoke plan, docker runner: {docker:6.1f} s  (target < 180 s: {docker / 180:.2f}x "
        f"of the limit; {docker / local:.2f}x local, target <= 1.5x)"
    )
    for name, seconds in docker_stages.items():
        print(
            f"  {name:<26} docker {seconds or 0:6.1f} s   local {local_stages.get(name) or 0:6.1f} s"
        )
    for image in IMAGES:
        print(f"image {image:<14} {image_size_gb(image):5.2f} GB")
    if args.rebuild:
        print(f"source-only rebuild of lpx-train:cpu: {source_only_rebuild():.1f} s")


if __name__ == "__main__":
    main()
