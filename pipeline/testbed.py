"""The machine a stage runs on, as the run history's testbed: host, CPU, GPUs, driver,
compute capability, and the CUDA, cuDNN and NCCL builds the installed torch runs with.

Read without importing torch (nvidia-smi where it exists, /proc/cpuinfo otherwise, package
metadata for the CUDA libraries), so the orchestrator stays light. Each replay records the
same facts from inside its engine (pipeline.devices), which is what a containerised stage
ran with. ``LPX_TESTBED`` names the testbed explicitly, e.g. a runner pool ("h100-nightly").
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import platform
import re
import shutil
import subprocess
from functools import lru_cache
from pathlib import Path

GPU_QUERY = "name,driver_version,compute_cap,memory.total"


def describe_testbed() -> dict:
    gpus = nvidia_gpus()
    first = gpus[0] if gpus else {}
    testbed = {
        "name": os.environ.get("LPX_TESTBED") or None,
        "host": platform.node(),
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "gpu_model": first.get("name"),
        "gpu_count": len(gpus),
        "driver": first.get("driver"),
    }
    if gpus:
        testbed.update(
            compute_capability=first.get("compute_capability"),
            gpu_memory_mib=first.get("memory_mib"),
            cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"),
            **torch_cuda_build(),
        )
    return testbed


def torch_cuda_build() -> dict:
    """The CUDA, cuDNN and NCCL that the installed torch was built with or ships, from its
    files and package metadata (importing torch would cost the orchestrator seconds)."""
    build = {"cuda": None, "cudnn": None, "nccl": None}
    spec = importlib.util.find_spec("torch")
    if spec and spec.origin:
        try:
            build["cuda"] = cuda_from_version_file(
                (Path(spec.origin).parent / "version.py").read_text()
            )
        except OSError:
            pass
    for name, key in (("nvidia-cudnn", "cudnn"), ("nvidia-nccl", "nccl")):
        build[key] = _package_version(name)
    return build


def cuda_from_version_file(text: str) -> str | None:
    """The CUDA version in torch/version.py's text (`cuda = '13.0'`; None in a CPU build)."""
    found = re.search(r"^cuda[^=\n]*=\s*'([^']+)'", text, re.M)
    return found.group(1) if found else None


def _package_version(prefix: str) -> str | None:
    """The version of the first installed distribution named ``prefix-cuXX``."""
    for suffix in ("cu13", "cu12", "cu11"):
        try:
            return importlib.metadata.version(f"{prefix}-{suffix}")
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


@lru_cache(maxsize=1)
def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@lru_cache(maxsize=1)
def nvidia_gpus() -> list[dict]:
    """One dict per GPU nvidia-smi lists (it ignores CUDA_VISIBLE_DEVICES: the host's GPUs)."""
    if not shutil.which("nvidia-smi"):
        return []
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={GPU_QUERY}", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    gpus = []
    for line in out.strip().splitlines():
        fields = [field.strip() for field in line.split(",")]
        if len(fields) < 2:
            continue
        fields += [""] * (4 - len(fields))
        gpus.append(
            {
                "name": fields[0],
                "driver": fields[1],
                "compute_capability": _known(fields[2]),
                "memory_mib": int(fields[3]) if fields[3].isdigit() else None,
            }
        )
    return gpus


def _known(value: str) -> str | None:
    """nvidia-smi prints `[N/A]` or an error for a field an older driver does not have."""
    return value if value and not value.startswith("[") and "not" not in value.lower() else None
