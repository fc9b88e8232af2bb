"""Print lpx's requirements (core + the given extras), one per line, from the dependency tables
of pyproject.toml or of docker/dependencies.toml (the same tables alone).

Images install these before copying lpx's source, so a source-only change rebuilds only the
last layers; and they read docker/dependencies.toml, not pyproject.toml, so that a change to
pyproject's package list or tool settings does not reinstall every dependency (about 8 minutes
for the three CPU images). `--tables` writes that file from pyproject.toml; a test holds the two
equal (tests/project/test_packaging.py).

Usage: python3 docker/requirements.py fsdp,deepspeed,megatron < docker/dependencies.toml
       python3 docker/requirements.py --tables < pyproject.toml > docker/dependencies.toml
"""

import json
import sys
import tomllib

HEADER = (
    "# pyproject.toml's dependency tables alone, for the images' dependency stages.\n"
    "# Generated: python3 docker/requirements.py --tables < pyproject.toml > docker/dependencies.toml\n"
)


def tables(project: dict) -> str:
    lines = [HEADER, "[project]", f"dependencies = {json.dumps(project['dependencies'])}", ""]
    lines.append("[project.optional-dependencies]")
    for extra, requirements in project.get("optional-dependencies", {}).items():
        lines.append(f"{extra} = {json.dumps(requirements)}")
    return "\n".join(lines) + "\n"


project = tomllib.load(sys.stdin.buffer)["project"]
if sys.argv[1:] == ["--tables"]:
    sys.stdout.write(tables(project))
    sys.exit(0)
extras = [e for e in (sys.argv[1] if len(sys.argv) > 1 else "").split(",") if e]
lines = ["setuptools>=68", *project["dependencies"]]
for extra in extras:
    lines += project["optional-dependencies"][extra]
print("\n".join(lines))
