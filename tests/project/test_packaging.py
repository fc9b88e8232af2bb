"""A plain (non-editable) `pip install .`, as in a container, ships db/ and templates/."""

import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

ROOT = Path(__file__).parents[2]
MAPPED = {"pipeline.db": ROOT / "db", "pipeline.templates": ROOT / "templates"}


def test_the_package_list_matches_the_tree():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    found = {
        ".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "pipeline").rglob("__init__.py")
    }
    for name, directory in MAPPED.items():
        found |= {
            ".".join([name, *p.parent.relative_to(directory).parts])
            for p in directory.rglob("__init__.py")
        }
    assert listed == {f for f in found if "__pycache__" not in f}


def test_a_wheel_carries_migrations_and_templates_and_works_outside_the_repo(tmp_path):
    source = tmp_path / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    for name in ("pipeline", "db", "templates"):
        shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    wheels = tmp_path / "wheels"
    build = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            wheels,
            source,
        ],
        capture_output=True,
        text=True,
    )
    assert build.returncode == 0, build.stderr
    (wheel,) = wheels.glob("lpx-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for expected in (
        "pipeline/db/models.py",
        "pipeline/db/migrations/env.py",
        "pipeline/db/migrations/versions/0001_runs_and_points.py",
        "pipeline/db/migrations/versions/0002_detection.py",
        "pipeline/db/migrations/versions/0003_calibrations.py",
        "pipeline/db/migrations/versions/0004_metric_value_indexes.py",
        "pipeline/db/migrations/versions/0005_localize.py",
        "pipeline/templates/index.html",
        "pipeline/templates/assets/lpx.js",
        "pipeline/templates/assets/lpx.css",
    ):
        assert expected in names, expected
    target = tmp_path / "site-packages"
    install = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", target, wheel],
        capture_output=True,
        text=True,
    )
    assert install.returncode == 0, install.stderr
    script = (
        "import pipeline, sys; assert pipeline.__file__.startswith(sys.argv[1]), pipeline.__file__\n"
        "from pipeline.history.database import open_history, schema_revision\n"
        "from pipeline.report.site import build_site\n"
        "h = open_history(sys.argv[2]); print(schema_revision(h)); print(build_site(h, sys.argv[3]))\n"
    )
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    run = subprocess.run(
        [
            sys.executable,
            "-c",
            script,
            str(target),
            f"sqlite:///{tmp_path / 'h.db'}",
            str(outside / "site"),
        ],
        capture_output=True,
        text=True,
        cwd=outside,
        env={**os.environ, "PYTHONPATH": str(target)},
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines()[0] == "0010"
    assert (outside / "site" / "assets" / "lpx.js").is_file()


def test_the_images_dependency_tables_are_pyprojects():
    """The images' dependency stages read docker/dependencies.toml (so that a change to
    pyproject's package list does not reinstall every dependency); it must be pyproject's
    dependency tables exactly, as `docker/requirements.py --tables` writes them."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    written = subprocess.run(
        [sys.executable, "docker/requirements.py", "--tables"],
        stdin=(root / "pyproject.toml").open("rb"), capture_output=True, text=True, cwd=root,
    )  # fmt: skip
    committed = (root / "docker" / "dependencies.toml").read_text()
    assert written.returncode == 0 and committed == written.stdout, (
        "docker/dependencies.toml is stale: python3 docker/requirements.py --tables "
        "< pyproject.toml > docker/dependencies.toml"
    )
    for dockerfile in ("Dockerfile.megatron", "Dockerfile.vllm", "Dockerfile.sglang"):
        text = (root / dockerfile).read_text()
        assert "< /src/dependencies.toml > /src/requirements.txt" in text, dockerfile
