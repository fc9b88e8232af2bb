"""The machine a stage runs on, as the run history's testbed: host, CPU, GPUs, driver.

Read without importing torch (nvidia-smi where it exists, /proc/cpuinfo otherwise).
``LPX_TESTBED`` names the testbed explicitly, e.g. a runner pool ("h100-nightly").
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
from functools import lru_cache


def describe_testbed() -> dict:
    gpus = _nvidia_gpus()
    return {
        "name": os.environ.get("LPX_TESTBED") or None,
        "host": platform.node(),
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "gpu_model": gpus[0][0] if gpus else None,
        "gpu_count": len(gpus),
        "driver": gpus[0][1] if gpus else None,
    }


@lru_cache(maxsize=1)
def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@lru_cache(maxsize=1)
def _nvidia_gpus() -> list[tuple[str, str]]:
    if not shutil.which("nvidia-smi"):
        return []
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    rows = [line.split(",") for line in out.strip().splitlines() if "," in line]
    return [(name.strip(), driver.strip()) for name, driver in rows]
