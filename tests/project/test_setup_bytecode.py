"""scripts/setup's .venv keeps the bytecode of what it imports even under
PYTHONDONTWRITEBYTECODE: its packages are installed uncompiled, so without that every process
compiled again each module it imported (~10 s for one that loads an HF model)."""

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VENV_PYTHON = ROOT / ".venv" / "bin" / "python"


@pytest.mark.skipif(not VENV_PYTHON.exists(), reason="no .venv: scripts/setup has not run here")
def test_the_setup_venv_writes_bytecode_when_the_environment_says_not_to(tmp_path):
    (tmp_path / "freshly_written.py").write_text("VALUE = 7\n")
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "PYTHONPATH": str(tmp_path)}
    done = subprocess.run(
        [VENV_PYTHON, "-c", "import sys, freshly_written; print(sys.dont_write_bytecode)"],
        env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert done.stdout.strip() == "False"
    assert [p.name for p in (tmp_path / "__pycache__").glob("freshly_written.*.pyc")]
    # and a plain interpreter, without the venv's .pth, does not: the variable is what it says
    base = subprocess.run(
        [VENV_PYTHON, "-S", "-c", "import sys; print(sys.dont_write_bytecode)"],
        env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert base.stdout.strip() == "True"
