"""`lpx run PLAN.yaml --runner local`: stages as processes, partial runs kept, --resume."""

import json
from pathlib import Path

import pytest
import yaml

from support.helpers import run_lpx


def write_plan(tmp_path, model, **changes):
    """PLAN.yaml with ``changes`` over a small HF plan; a change to None leaves the key out."""
    plan = {
        "version": 1,
        "name": "t",
        "model": None if model is None else str(model),
        "sampling": {"max_tokens": 8, "samples_per_prompt": 1},
        "rollout": {"engine": "hf", "dtype": "fp32"},
        "replays": [
            {"name": "fp32", "engine": "hf", "dtype": "fp32"},
            {"name": "bf16", "engine": "hf", "dtype": "bf16"},
        ],
        "history": {"db": str(tmp_path / "h.db"), "report": str(tmp_path / "site")},
    }
    plan.update(changes)
    plan = {key: value for key, value in plan.items() if value is not None}
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
        ({"name": "../../X"}, "name: Value error, plan name '../../X': use letters, digits"),
        ({"name": "a/b"}, "plan name 'a/b'"),
        ({"rollout": {"engine": "hf", "memory": "lots"}}, "rollout.memory"),
    ],
)
def test_a_bad_plan_is_one_line_naming_the_key(change, expected, tmp_path):
    plan = write_plan(tmp_path, "tiny", **change)
    result = run_lpx("run", plan, "--out", tmp_path / "run")
    assert result.exit_code == 2 and expected in result.output, result.output
    assert str(plan) in result.output and not (tmp_path / "run").exists()


def test_a_plan_without_a_model_is_refused_and_says_how_to_ask_for_the_tiny_one(tmp_path):
    plan = write_plan(tmp_path, None)
    result = run_lpx("run", plan, "--out", tmp_path / "run")
    assert result.exit_code == 2
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    (line,) = lines
    assert line.startswith(f"Error: {plan}: model: missing") and "`model: tiny`" in line, line
    assert not (tmp_path / "run").exists()


def test_a_plan_name_never_becomes_a_path_outside_runs(tmp_path, monkeypatch):
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    plan = write_plan(tmp_path, "tiny", name="../../escaped")
    result = run_lpx("run", plan)  # the default run directory: runs/<name>-<UTC time>
    assert result.exit_code == 2 and "plan name '../../escaped'" in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.yaml", "work"]
    assert list(work.iterdir()) == []


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
    # the run ends with one Error: line naming the stage, its log and the resume
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert errors == [result.stderr.splitlines()[-1]], result.stderr
    assert errors[0].startswith("Error: stage replay-broken failed: exit 2: ")
    assert "padding_side" in errors[0]
    assert f"log: {run_dir / 'logs' / 'replay-broken.log'}" in errors[0]
    assert f"`lpx run {plan} --out {run_dir} --resume`" in errors[0]
    assert "Error:" not in result.stdout, result.stdout
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
    # a rollout that takes seconds even forked warm: 512 tokens, 2.1-2.5 s on a quiet machine
    # (8 tokens took under 0.5 s from a warm interpreter the worker's earlier runs had started)
    sampling = {"max_tokens": 512, "samples_per_prompt": 1}
    plan = write_plan(tmp_path, tiny_model, stage_timeout_s=0.3, sampling=sampling)
    run_dir = tmp_path / "run"
    result = run_lpx("run", plan, "--out", run_dir)
    assert result.exit_code == 2
    stages = {s["name"]: s for s in manifest(run_dir)["stages"]}
    assert stages["rollout"]["status"] == "error"
    assert "timed out after 0.3 s" in stages["rollout"]["message"]
    assert stages["replay-fp32"]["message"] == "not run: rollout failed"
    last = result.stderr.splitlines()[-1]
    assert last.startswith("Error: stage rollout failed: timed out after 0.3 s; raise"), last
    assert "2 later stage(s) did not run" in last


# examples/smoke.yaml itself (vLLM-CPU rollout, HF fp32/bf16, FSDP2, DeepSpeed ZeRO-3 and
# Megatron TP=2 replays) runs in tests/project/test_containers.py, as the README's compose line
# runs it (every stage in its container; never skipped under CI=true). Running it here too, as
# processes, cost 110 s of the suite for what the tests below already hold of the local runner
# (stages as processes, distributed replays through `lpx replay --nproc`, record, report).


@pytest.mark.parametrize(
    "name",
    [
        "smoke.yaml",
        "smoke-sglang.yaml",
        "smoke-local.yaml",
        "smoke-http.yaml",
        "nightly-gpu.yaml",
        "nightly-sglang.yaml",
        "nightly-fp8.yaml",
        "nightly-agent.yaml",
        "smoke-agent.yaml",
    ],
)
def test_the_example_plans_are_valid(name):

    from pipeline.orchestrator.plan import load_plan
    from pipeline.orchestrator.stages import expand

    plan = load_plan(Path(__file__).parents[2] / "examples" / name)
    stages = expand(plan)
    assert [s.name for s in stages][:2] == ["model", "rollout"]
    assert len(stages) == 2 + (plan.calibrate is not None) + len(plan.replays)
    if plan.calibrate is not None:
        calibrate = next(s for s in stages if s.name == "calibrate")
        assert calibrate.needs == ["rollout"] and calibrate.outputs == ["calibration.json"]


def test_docker_unreachable_is_one_line_before_any_stage(tmp_path, monkeypatch):
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/no-docker.sock")
    plan = write_plan(tmp_path, "tiny")
    result = run_lpx("run", plan, "--runner", "docker", "--out", tmp_path / "run")
    assert result.exit_code == 2, result.output
    assert "Docker is not reachable" in result.output and "--runner local" in result.output
    assert not (tmp_path / "run").exists()


@pytest.mark.vllm
def test_a_rollout_served_by_a_server_lpx_starts_and_stops(tmp_path):
    """examples/smoke-http.yaml: a real `vllm serve` started for the rollout stage, sampled
    over HTTP by the http engine, stopped after it; HF replays it."""
    import os
    import subprocess
    import sys

    plan = Path(__file__).parents[2] / "examples" / "smoke-http.yaml"
    result = subprocess.run(
        [sys.executable, "-m", "pipeline", "run", str(plan), "--out", "runs/http"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={**os.environ, "CI": "true"},
        timeout=900,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    run_dir = tmp_path / "runs" / "http"
    assert "server up at http://127.0.0.1:8765" in result.stderr
    report = json.loads((run_dir / "compare" / "report.json").read_text())
    # measured: served vLLM fp32 vs HF fp32 max |d| 3.8e-6 on 384 tokens
    assert report["verdict"] == "pass" and report["metrics"]["max_abs_diff"] < 2e-5
    assert (run_dir / "logs" / "rollout-server.log").stat().st_size > 0


def test_a_server_that_dies_fails_its_stage_with_its_exit_code(tiny_model, tmp_path):
    plan = write_plan(
        tmp_path,
        tiny_model,
        rollout={
            "engine": "http",
            "knobs": {"api": "openai"},
            "server": {"argv": ["python3", "-c", "import sys; sys.exit(3)"], "port": 8766},
        },
    )
    run_dir = tmp_path / "run"
    result = run_lpx("run", plan, "--out", run_dir)
    assert result.exit_code == 2
    stages = {s["name"]: s for s in manifest(run_dir)["stages"]}
    assert stages["rollout"]["message"] == "the server exited with 3 (see rollout-server.log)"
    assert stages["replay-fp32"]["message"] == "not run: rollout failed"


def test_a_full_volume_stops_the_run_names_the_stage_and_resume_finishes(
    tiny_model, tmp_path, small_volume
):
    from pipeline.paths import RESERVE, RESERVE_BYTES

    plan = write_plan(tmp_path, tiny_model)
    # Room for the run's reserve, the prompts, the fixture and the logs, not for the replays.
    volume = small_volume((RESERVE_BYTES >> 10) + 36)
    run_dir = volume / "run"
    result = run_lpx("run", plan, "--out", run_dir)
    assert result.exit_code == 2, result.output
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("Error: stage ") and "is full (log: " in last, last
    assert "; free space (or move the run), then `lpx run" in last
    assert f"--out {run_dir} --resume" in last
    # Stages before the one that hit the full volume are kept; it and every later one are
    # errors saying the volume is full (the later ones: not run).
    stages = manifest(run_dir)["stages"]
    names = [s["name"] for s in stages]
    assert names == ["rollout", "replay-fp32", "replay-bf16", "compare"]
    full_at = names.index(last.split()[2].rstrip(":"))
    assert full_at >= 1 and all(s["status"] == "ok" for s in stages[:full_at]), stages
    assert "is full" in stages[full_at]["message"] and stages[full_at]["status"] == "error"
    assert all(s["message"].startswith("not run: the volume") for s in stages[full_at + 1 :])
    assert manifest(run_dir)["status"] == "error" and not (run_dir / RESERVE).exists()
    runs = json.loads(run_lpx("history", "--db", tmp_path / "h.db", "--json").output)
    assert [r["status"] for r in runs] == ["error"]

    small_volume(8 << 10)  # space freed
    result = run_lpx("run", plan, "--out", run_dir, "--resume")
    assert result.exit_code == 0, result.output
    assert statuses(run_dir) == dict.fromkeys(
        ["rollout", "replay-fp32", "replay-bf16", "compare"], "ok"
    )
    assert manifest(run_dir)["stages"][0]["message"] == "kept from the resumed run"


def test_a_volume_too_full_for_the_reserve_is_refused_before_any_stage(
    tiny_model, tmp_path, small_volume
):
    plan = write_plan(tmp_path, tiny_model)
    run_dir = small_volume(256) / "run"
    result = run_lpx("run", plan, "--out", run_dir)
    assert result.exit_code == 2
    assert f"{run_dir}: less than 1024 KiB free on its volume" in result.output, result.output
    assert not (run_dir / "fixture.parquet").exists()
