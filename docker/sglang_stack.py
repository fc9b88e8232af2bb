"""Write what Dockerfile.sglang's CPU target installs over lpx's venv, as environments.STACKS
says SGLang installs: stack-no-deps.txt, the pinned release and what goes beside it without
dependencies (sglang==0.5.23, torchvision==0.28.0); stack-companions.txt, the packages it
needs that lpx's venv lacks, installed with their dependencies and every package already
installed held at its version. Run by `scripts/wheelhouse sglang` with .venv's python:
    python docker/sglang_stack.py OUT
"""

import sys
from pathlib import Path

from pipeline.engines.sglang.server import default_environment

if __name__ == "__main__":
    out, environment = Path(sys.argv[1]), default_environment()
    (out / "stack-no-deps.txt").write_text("\n".join(environment.requirements) + "\n")
    (out / "stack-companions.txt").write_text("\n".join(environment.companions) + "\n")
