"""`lpx run PLAN.yaml --runner local`: stages as processes, partial runs kept, --resume."""

import json

import pytest
import yaml

from tests.helpers import run_lpx


def write_plan(tmp_path, model, **changes):
    plan = {
        "version": 1,
        "name": "t",
        "model": str(model),
        "sampling": {"max_tokens": 8, "samples_per_prompt": 1},
        "rollout": {"engine": "hf", "dtype": "fp32"},
        "replays": [
            {"name": "fp32", "engine": "hf", "dtype": "fp32"},
            {"name": "bf16", "engine": "hf", "dtype": "bf16"},
        ],
        "history": {"db": str(tmp_path / "h.db"), "report": str(tmp_path / "site")},
    }
    plan.update(changes)
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(plan))
    return path


def manifest(run_dir):
    return json.loads((run_dir / "lpx-run.json").read_text())


def statuses(run_dir):
    return {s["name"]: s["status"] for s in manifest(run_dir)["stages"]}


@pytest.mark.parametrize(
    "change, expected",
    [
        (
            {"replays": [{"name": "x", "engine": "hff"}]},
            "replays.0.engine: Value error, unknown engine 'hff'",
        ),
        ({"rollout": {"engine": "hf", "dtyp": "fp32"}}, "rollout.dtyp: unknown key"),
        ({"replays": [{"name": "../x", "engine": "hf"}]}, "replays.0.name"),
        ({"replays": []}, "replays: List should have at least 1 item"),
        ({"sampling": {"max_tokens": 0}}, "sampling.max_tokens"),
        ({"version": 2}, "version"),
        (
            {"replays": [{"name": "a", "engine": "hf"}, {"name": "a", "engine": "hf"}]},
            "appears twice",
        ),
    ],
)
def test_a_bad_plan_is_one_line_naming_the_key(change, expected, tmp_path):
    plan = write_plan(tmp_path, "tiny", **change)
    result = run_lpx("run", plan, "--out", tmp_path / "run")
    assert result.exit_code == 2 and expected in result.output, result.output
    assert str(plan) in result.output and not (tmp_path / "run").exists()


def test_a_plan_runs_records_and_reports(tiny_model, tmp_path):
    plan = write_plan(tmp_path, tiny_model)
    run_dir = tmp_path / "run"
    result = run_lpx("run", plan, "--out", run_dir)
    assert result.exit_code == 0, result.output
    assert statuses(run_dir) == {
        "rollout": "ok",
        "replay-fp32": "ok",
        "replay-bf16": "ok",
        "compare": "ok",
    }
    assert manifest(run_dir)["status"] == "pass"
    matrix = json.loads((run_dir / "compare" / "report.json").read_text())
    assert matrix["verdict"] == "pass" and len(matrix["pairs"]) == 2
    assert (tmp_path / "site" / "index.html").is_file()
    assert (run_dir / "logs" / "rollout.log").is_file()
    history = run_lpx("history", "--db", tmp_path / "h.db", "--json")
    runs = json.loads(history.output)
    assert len(runs) == 1 and runs[0]["status"] == "pass", history.output
    assert run_lpx("run", plan, "--out", run_dir).exit_code == 2  # never over a finished run


def test_a_failing_stage_keeps_what_finished_and_resume_reruns_only_it(tiny_model, tmp_path):
    plan = write_plan(
        tmp_path,
        tiny_model,
        replays=[
            {"name": "fp32", "engine": "hf", "dtype": "fp32"},
            {"name": "broken", "engine": "hf", "dtype": "fp32", "knobs": {"padding_side": "up"}},
        ],
    )
    run_dir = tmp_path / "run"
    result = run_lpx("run", plan, "--out", run_dir)
    assert result.exit_code == 2, result.output
    stages = {s["name"]: s for s in manifest(run_dir)["stages"]}
    assert stages["replay-broken"]["status"] == "error"
    assert "padding_side" in stages["replay-broken"]["message"]
    assert stages["compare"]["status"] == "ok"  # the replay that finished is compared
    assert (run_dir / "replay-fp32.parquet").is_file()
    runs = json.loads(run_lpx("history", "--db", tmp_path / "h.db", "--json").output)
    assert [r["status"] for r in runs] == ["error"]

    fixture_before = (run_dir / "fixture.parquet").stat().st_mtime_ns
    write_plan(
        tmp_path,
        tiny_model,
        replays=[
            {"name": "fp32", "engine": "hf", "dtype": "fp32"},
            {"name": "broken", "engine": "hf", "dtype": "fp32", "knobs": {"padding_side": "left"}},
        ],
    )
    result = run_lpx("run", plan, "--out", run_dir, "--resume")
    assert result.exit_code == 0, result.output
    stages = {s["name"]: s for s in manifest(run_dir)["stages"]}
    assert stages["rollout"]["message"] == "kept from the resumed run"
    assert stages["replay-fp32"]["message"] == "kept from the resumed run"
    assert stages["replay-broken"]["status"] == "ok" and "seconds" in stages["replay-broken"]
    assert (run_dir / "fixture.parquet").stat().st_mtime_ns == fixture_before
    runs = json.loads(run_lpx("history", "--db", tmp_path / "h.db", "--json").output)
    assert sorted(r["status"] for r in runs) == ["error", "pass"]


def test_a_stage_past_its_timeout_is_killed_and_named(tiny_model, tmp_path):
    plan = write_plan(tmp_path, tiny_model, stage_timeout_s=0.5)
    run_dir = tmp_path / "run"
    result = run_lpx("run", plan, "--out", run_dir)
    assert result.exit_code == 2
    stages = {s["name"]: s for s in manifest(run_dir)["stages"]}
    assert stages["rollout"]["status"] == "error"
    assert "timed out after 0.5 s" in stages["rollout"]["message"]
    assert stages["replay-fp32"]["message"] == "not run: rollout failed"


@pytest.mark.vllm
@pytest.mark.distributed
def test_the_example_smoke_plan_runs_locally(tmp_path):
    """examples/smoke.yaml: vLLM-CPU rollout vs HF fp32/bf16, FSDP2, DeepSpeed ZeRO-3 and
    Megatron TP=2 replays, as a user runs it (its own process, in their directory)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    plan = Path(__file__).parents[1] / "examples" / "smoke.yaml"
    result = subprocess.run(
        [sys.executable, "-m", "pipeline", "run", str(plan), "--out", "runs/plan"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={**os.environ, "CI": "true"},
        timeout=900,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    run_dir = tmp_path / "runs" / "plan"
    assert manifest(run_dir)["status"] == "pass"
    matrix = json.loads((run_dir / "compare" / "report.json").read_text())
    engines = sorted(pair["replay"] for pair in matrix["pairs"])
    assert len(engines) == 5, engines
    for pair in matrix["pairs"]:  # measured: fp32 max |d| 3.8e-6 to 4.2e-6, bf16 0.07
        limit = 0.2 if "bfloat16" in pair["replay"] else 2e-5
        assert pair["max_abs_diff"] < limit, pair
    assert (tmp_path / "runs" / "report" / "index.html").is_file()
    assert (tmp_path / "runs" / "lpx.db").is_file()


@pytest.mark.parametrize("name", ["smoke.yaml", "smoke-local.yaml", "nightly-gpu.yaml"])
def test_the_example_plans_are_valid(name):
    from pathlib import Path

    from pipeline.orchestrator.plan import load_plan
    from pipeline.orchestrator.stages import expand

    plan = load_plan(Path(__file__).parents[1] / "examples" / name)
    stages = expand(plan)
    assert [s.name for s in stages][:2] == ["model", "rollout"]
    assert len(stages) == 2 + len(plan.replays)


def test_the_workflows_name_what_the_nightly_needs():
    """Structure checks (actionlint itself is not installable here: its PyPI wrapper
    downloads the binary from GitHub at build time)."""
    from pathlib import Path

    root = Path(__file__).parents[1] / ".github"
    nightly = yaml.safe_load((root / "workflows" / "nightly.yml").read_text())
    triggers = nightly[True]  # YAML 1.1 reads the key `on` as true
    assert "workflow_dispatch" in triggers and triggers["schedule"][0]["cron"].split()[0] != "0"
    job = nightly["jobs"]["nightly"]
    assert "gpu" in job["runs-on"] and "self-hosted" in job["runs-on"]
    assert "fromJSON" in str(job["strategy"]["matrix"])
    assert any("lpx-train:gpu gate" in str(step.get("run")) for step in job["steps"])
    versions = json.loads((root / "engine-versions.json").read_text())["include"]
    assert versions and all("vllm_base" in v for v in versions)
    ci = yaml.safe_load((root / "workflows" / "ci.yml").read_text())
    runs = [str(step.get("run")) for step in ci["jobs"]["test"]["steps"]]
    assert "bash .ci/run" in runs and "docker compose run --rm smoke" in runs


def test_docker_unreachable_is_one_line_before_any_stage(tmp_path, monkeypatch):
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/no-docker.sock")
    plan = write_plan(tmp_path, "tiny")
    result = run_lpx("run", plan, "--runner", "docker", "--out", tmp_path / "run")
    assert result.exit_code == 2, result.output
    assert "Docker is not reachable" in result.output and "--runner local" in result.output
    assert not (tmp_path / "run").exists()
