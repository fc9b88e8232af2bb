"""A plan's `localize:` runs `lpx localize` on each failing pair after the comparison: the
capture specs come from the pair's engines and dtypes (or the plan), a localize that errors
is noted and the run keeps its verdict and its pairs, and an engine with no capture adapter
is skipped with its reason."""

from __future__ import annotations

import json

import pytest
import yaml
from pipeline.db.models import Comparison, LocalizeBoundary
from sqlalchemy import select

from pipeline.history.database import open_history
from pipeline.orchestrator.localize_stages import capture_spec, localize_stage
from pipeline.orchestrator.plan import Plan
from support.helpers import run_lpx

# fp32 on side A: the seeded stale layer stands far out of fp32's floor (bf16's hides it)
STALE = "hf:dtype=fp32,fault=stale_layer,fault_layer=1"


def plan_of(**changes) -> Plan:
    plan = {
        "version": 1,
        "name": "t",
        "model": "tiny",
        "rollout": {"engine": "hf", "dtype": "fp32"},
        "replays": [{"name": "bf16", "engine": "hf", "dtype": "bf16"}],
        "localize": True,
    }
    return Plan.model_validate({**plan, **changes})


@pytest.mark.parametrize(
    "engine, dtype, knobs, spec",
    [
        ("hf", "bf16", {}, "hf:dtype=bf16"),
        ("fsdp", "float32", {"micro_batch_size": 4}, "fsdp:dtype=fp32"),
        ("deepspeed", "bf16", {}, "deepspeed:dtype=bf16"),
        (
            "megatron",
            "bf16",
            {"tensor_parallel_size": 2},
            "megatron:dtype=bf16,tensor_parallel_size=2",
        ),
        (
            "megatron",
            "fp16",
            {"tensor_parallel_size": 1},
            "megatron:dtype=fp16,tensor_parallel_size=1",
        ),
        (
            "megatron",
            "bf16",
            {"tensor_parallel_size": 1, "expert_model_parallel_size": 2},
            "megatron:dtype=bf16,tensor_parallel_size=1,expert_model_parallel_size=2",
        ),  # fmt: skip
        ("vllm", "fp32", {"tensor_parallel_size": 4}, "vllm:dtype=fp32,tensor_parallel_size=4"),
        ("logprob-server", "bf16", {}, "logprob-server:dtype=bf16"),
    ],
)
def test_each_scoring_engine_maps_to_the_capture_adapter_of_its_name(engine, dtype, knobs, spec):
    assert capture_spec(engine, dtype, knobs) == spec


def test_the_stage_localizes_the_replay_against_the_rollout_in_the_pair_directory():
    plan = plan_of(localize={"sequences": 3, "device": "cpu"})
    stage = localize_stage(plan, plan.replays[0], "compare/0-hf-bfloat16")
    assert stage.name == "localize-bf16" and stage.optional and stage.exit_1 == "fail"
    assert stage.argv == [
        "localize", "fixture.parquet", "--a", "hf:dtype=bf16", "--b", "hf:dtype=fp32",
        "--report", "compare/0-hf-bfloat16/report.json", "--out", "compare/0-hf-bfloat16/localize",
        "--model", "model", "--sequences", "3", "--device", "cpu",
    ]  # fmt: skip
    assert stage.outputs == ["compare/0-hf-bfloat16/localize/localize.json"]


def test_an_http_rollout_is_skipped_with_its_reason_unless_the_plan_names_a_spec():
    http = {"engine": "http", "knobs": {"url": "http://x"}}
    plan = plan_of(rollout=http)
    reason = localize_stage(plan, plan.replays[0], "compare")
    assert isinstance(reason, str) and "\n" not in reason
    assert reason.startswith("skipped: the rollout engine http has no capture adapter (")
    named = plan_of(rollout=http, localize={"rollout": "vllm:dtype=fp32"})
    stage = localize_stage(named, named.replays[0], "compare")
    assert stage.argv[4:6] == ["--b", "vllm:dtype=fp32"]
    unknown = plan_of(localize={"replays": {"bf16": "mystery:dtype=bf16"}})
    assert "no capture adapter for the replay engine mystery" in localize_stage(
        unknown, unknown.replays[0], "compare"
    )


@pytest.mark.parametrize(
    "localize, expected",
    [
        ({"replays": {"nope": "hf"}}, "localize.replays names nope, which is not a replay"),
        ({"rollout": "hf:dtype"}, "localize.rollout: Value error, engine spec 'hf:dtype'"),
        ({"sequences": 0}, "localize.sequences"),
        ({"spec": "hf"}, "localize.spec: unknown key"),
    ],
)
def test_a_bad_localize_key_is_one_line_naming_it(localize, expected, tmp_path):
    plan = tmp_path / "plan.yaml"
    plan.write_text(yaml.safe_dump({**plan_of().model_dump(), "localize": localize}))
    result = run_lpx("run", plan, "--out", tmp_path / "run")
    assert result.exit_code == 2 and expected in result.stderr, result.stderr
    assert len(result.stderr.splitlines()) == 1 and not (tmp_path / "run").exists()


def test_failing_pairs_are_localized_and_a_failing_localize_keeps_the_run(tiny_model, tmp_path):
    """Two bf16 replays fail a strict policy. One is localized with a seeded stale layer 1 on
    its side (the plan names its spec); the other's spec has a knob the adapter refuses, so
    its stage errors: the run
    still exits 1 (its comparisons failed), both pairs are recorded and reported."""
    policy = tmp_path / "policy.yaml"
    policy.write_text(
        "version: 1\nprofiles:\n  float32: {tau: 1.0e-4, limits: {max_abs_diff: 1.0e-4}}\n"
        "  bfloat16: {tau: 0.1, limits: {max_abs_diff: 1.0e-9}}\n"
    )
    plan = {
        "version": 1,
        "name": "t",
        "model": str(tiny_model),
        "prompts": "bundled",
        "sampling": {"max_tokens": 8, "samples_per_prompt": 1},
        "rollout": {"engine": "hf", "dtype": "fp32"},
        "replays": [
            {"name": "stale", "engine": "hf", "dtype": "bf16"},
            {"name": "broken", "engine": "hf", "dtype": "bf16"},
        ],
        "policy": str(policy),
        "diagnose": False,
        "localize": {"sequences": 2, "replays": {"stale": STALE, "broken": "hf:nonsense=1"}},
        "history": {"db": str(tmp_path / "h.db"), "report": str(tmp_path / "site")},
    }
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(plan))
    run_dir = tmp_path / "run"
    result = run_lpx("run", path, "--out", run_dir)
    assert result.exit_code == 1, result.output
    assert "(localize-broken failed, the comparison's results are kept" in result.stdout
    # side B derived from the rollout: hf fp32
    assert f"--a {STALE} --b hf:dtype=fp32 --report compare/0-hf-bfloat16/report.json" in (
        result.stderr
    )
    manifest = json.loads((run_dir / "lpx-run.json").read_text())
    stages = {s["name"]: s for s in manifest["stages"]}
    assert manifest["status"] == "fail"
    assert stages["compare"]["status"] == "fail"
    assert stages["localize-stale"]["status"] == "fail"  # exit 1: a boundary beyond the floor
    broken = stages["localize-broken"]
    assert broken["status"] == "error" and broken["optional"] is True
    assert broken["pair"] == "compare/1-hf-bfloat16" and "nonsense" in broken["message"]
    localized = json.loads((run_dir / "compare/0-hf-bfloat16/localize/localize.json").read_text())
    assert localized["verdict"] in ("localized", "verified")
    assert localized["first"]["boundary"] == "layers.1.mlp_out"
    assert localized["sides"]["a"]["spec"] == STALE and len(localized["sequences"]) == 2

    history = open_history(f"sqlite:///{tmp_path / 'h.db'}")
    with history.read() as session:
        verdicts = dict(session.execute(select(Comparison.pair, Comparison.localize_verdict)).all())
        ratios = session.scalars(select(LocalizeBoundary.ratio).order_by(LocalizeBoundary.id))
        ratios = list(ratios)
    history.dispose()
    assert verdicts == {
        "compare/0-hf-bfloat16": localized["verdict"],
        "compare/1-hf-bfloat16": "error",
    }
    assert ratios == [row["ratio"] for row in localized["boundaries"]]
    runs = json.loads(run_lpx("history", "--db", tmp_path / "h.db", "--json").output)
    assert [r["status"] for r in runs] == ["fail"]  # not an error run
    page = (tmp_path / "site" / "runs" / "1.html").read_text()
    assert page.count('class="localize"') == 2 and "nonsense" in page
