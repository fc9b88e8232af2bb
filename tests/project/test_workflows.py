"""The GitHub workflows, linted offline (issue 9).

actionlint cannot be installed here (no Debian package; its PyPI wrapper and Go build both
download from GitHub), so ci.yml runs it on GitHub, and these tests run what can run offline:
GitHub's workflow JSON schema (vendored in check-jsonschema) and zizmor's audits (unpinned
actions, template injection, persisted credentials, ...). Each linter is also shown a broken
workflow, so a linter that silently passes everything fails here.
"""

import json
import os
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).parents[2]
WORKFLOWS = sorted((ROOT / ".github" / "workflows").glob("*.yml"))
BIN = Path(os.environ.get("VIRTUAL_ENV", ROOT / ".venv")) / "bin"


def _schema(*files: Path) -> subprocess.CompletedProcess:
    args = [BIN / "check-jsonschema", "--builtin-schema", "vendor.github-workflows", *files]
    return subprocess.run(args, capture_output=True, text=True)


def _zizmor(*paths: Path) -> subprocess.CompletedProcess:
    args = [BIN / "zizmor", "--offline", "--no-progress", *paths]
    return subprocess.run(args, capture_output=True, text=True)


def test_the_workflows_match_githubs_schema():
    assert len(WORKFLOWS) == 2
    result = _schema(*WORKFLOWS)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_workflows_pass_zizmors_audits():
    result = _zizmor(*WORKFLOWS)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "No findings" in result.stdout


BROKEN = """\
name: broken
on: [push]
jobs:
  build:
    runs_on: ubuntu-24.04
    steps:
      - uses: actions/checkout@v4
      - run: echo "${{ github.event.head_commit.message }}"
"""


@pytest.mark.parametrize(
    "lint, finding",
    [(_schema, "runs_on"), (_zizmor, "template-injection"), (_zizmor, "unpinned-uses")],
    ids=["schema-unknown-key", "zizmor-injection", "zizmor-unpinned"],
)
def test_the_linters_catch_a_broken_workflow(lint, finding, tmp_path):
    workflow = tmp_path / ".github" / "workflows" / "broken.yml"
    workflow.parent.mkdir(parents=True)
    text = BROKEN if finding == "runs_on" else BROKEN.replace("runs_on", "runs-on")
    workflow.write_text(text)
    result = lint(workflow)
    assert result.returncode != 0
    assert finding in result.stdout + result.stderr


def test_the_workflows_name_what_the_nightly_needs():
    root = ROOT / ".github"
    nightly = yaml.safe_load((root / "workflows" / "nightly.yml").read_text())
    triggers = nightly[True]  # YAML 1.1 reads the key `on` as true
    assert "workflow_dispatch" in triggers and triggers["schedule"][0]["cron"].split()[0] != "0"
    job = nightly["jobs"]["nightly"]
    assert "gpu" in job["runs-on"] and "self-hosted" in job["runs-on"]
    assert "fromJSON" in str(job["strategy"]["matrix"])
    assert any("lpx-train:gpu gate" in str(step.get("run")) for step in job["steps"])
    # the team's checkpoints reach the nightly service and its stages (compose.yaml)
    assert job["env"]["LPX_MODELS"] == "${{ vars.LPX_MODELS }}"
    # Dockerfile.sglang has a cpu target (the smoke's) too: the nightly builds the GPU one
    builds = " ".join(str(step.get("run")) for step in job["steps"])
    assert "-f Dockerfile.sglang --target gpu -t lpx-sglang:gpu" in builds
    versions = json.loads((root / "engine-versions.json").read_text())["include"]
    assert versions and all({"vllm_base", "train_base", "sglang_base"} <= set(v) for v in versions)
    ci = yaml.safe_load((root / "workflows" / "ci.yml").read_text())
    runs = [str(step.get("run")) for step in ci["jobs"]["test"]["steps"]]
    # the compose smoke through its check script, never bare (tests/project/test_compose_smoke.py)
    assert "bash .ci/run" in runs and "scripts/compose-smoke" in runs
    lint = [str(step.get("run")) for step in ci["jobs"]["workflows"]["steps"]]
    assert any("rhysd/actionlint:" in run and "@sha256:" in run for run in lint)
