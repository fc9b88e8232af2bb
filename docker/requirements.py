"""Print lpx's requirements (core + the given extras) from pyproject.toml, one per line.

Images install these before copying lpx's source, so a source-only change rebuilds only the
last layers. Usage: python3 docker/requirements.py fsdp,deepspeed,megatron < pyproject.toml
"""

import sys
import tomllib

project = tomllib.load(sys.stdin.buffer)["project"]
extras = [e for e in (sys.argv[1] if len(sys.argv) > 1 else "").split(",") if e]
lines = ["setuptools>=68", *project["dependencies"]]
for extra in extras:
    lines += project["optional-dependencies"][extra]
print("\n".join(lines))
