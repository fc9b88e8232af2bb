"""A setting given twice is refused, naming both (issue 28): `--set`, `ingest --field`, a
sweep's `--setting`, a capture spec and a plan. The later one would silently win, and which
one was meant is the user's to say. Each case runs the real command; none reaches a model."""

from __future__ import annotations

import pytest
import yaml

from support.helpers import run_lpx


def _error(result) -> str:
    assert result.exit_code == 2, result.output
    (line,) = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert "Traceback" not in result.output
    return line


def test_a_replay_knob_set_twice_is_refused(run_dir, tmp_path):
    out = tmp_path / "r.parquet"
    result = run_lpx("replay", run_dir / "fixture.parquet", "--set", "micro_batch_size=2",
                     "--set", "micro_batch_size = 4", "--out", out)  # fmt: skip
    assert _error(result) == (
        "Error: --set 'micro_batch_size=2' and --set 'micro_batch_size = 4': "
        "'micro_batch_size' is given twice; give it once."
    )
    assert not out.exists()


@pytest.fixture
def dump(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt_ids": [1], "response_ids": [2], "rollout_log_probs": [-0.5]}\n')
    return path


@pytest.mark.parametrize(
    "fields, message",
    [
        (["rollout"], "Error: --field 'rollout': expected KEY=VALUE, e.g. --field mask=loss_mask."),
        (["mask=a", "mask=b"], "Error: --field 'mask=a' and --field 'mask=b': 'mask' is given "
         "twice; give it once."),
        (["colour=x"], "Error: --field: unknown field name(s) 'colour'; known: attention_mask, "
         "completion_ids, "),
    ],
)  # fmt: skip
def test_ingest_field_errors_name_field(fields, message, dump, tmp_path):
    args = [part for field in fields for part in ("--field", field)]
    out = tmp_path / "f.parquet"
    assert _error(run_lpx("ingest", dump, *args, "--out", out)).startswith(message)
    assert not out.exists()


def test_a_sweep_setting_with_a_knob_twice_is_refused(tiny_model, tmp_path):
    (tmp_path / "p.txt").write_text("hello\n")
    result = run_lpx(
        "sweep", "--engine", "hf", "--model", tiny_model, "--prompts", tmp_path / "p.txt",
        "--setting", "base:", "--setting", "b:micro_batch_size=1,micro_batch_size=2",
        "--out", tmp_path / "s",
    )  # fmt: skip
    assert _error(result) == (
        "Error: --setting 'b:micro_batch_size=1,micro_batch_size=2': 'micro_batch_size=1' and "
        "'micro_batch_size=2' both set micro_batch_size; give it once."
    )


def _plan(tmp_path, text: str):
    path = tmp_path / "plan.yaml"
    path.write_text("version: 1\nname: t\nmodel: tiny\nrollout: {engine: hf, dtype: fp32}\n" + text)
    return path


@pytest.mark.parametrize(
    "text, message",
    [
        ("replays:\n  - {name: a, engine: hf, knobs: {micro_batch_size: 2, micro_batch_size: 4}}\n",
         "line 6: not valid YAML ('micro_batch_size' is given twice in one mapping ('2' and "
         "'4'); give it once)."),
        ("replays:\n  - {name: a, engine: hf, dtype: bf16, knobs: {dtype: fp32}}\n",
         "replays.0: Value error, knobs.dtype 'fp32' contradicts dtype: 'bf16'; give one dtype, "
         "as dtype: (see docs/orchestrator.md)."),
        ("replays:\n  - {name: a, engine: hf, nproc: 2, knobs: {nproc: 4}}\n",
         "replays.0: Value error, knobs.nproc 4 contradicts nproc: 2"),
        ("replays: [{name: a, engine: hf}]\nlocalize: {rollout: 'hf:dtype=bf16,dtype=fp32'}\n",
         "localize.rollout: Value error, engine spec 'hf:dtype=bf16,dtype=fp32': 'dtype=bf16' "
         "and 'dtype=fp32' both set dtype; give it once."),
    ],
)  # fmt: skip
def test_a_plan_that_says_a_setting_twice_is_refused(text, message, tmp_path):
    plan = _plan(tmp_path, text)
    error = _error(run_lpx("run", plan, "--out", tmp_path / "run"))
    assert error.startswith(f"Error: {plan}") and message in error, error
    assert not (tmp_path / "run").exists()


def test_a_plan_may_say_the_same_dtype_as_a_knob_the_http_engine_reads(tmp_path):
    from pipeline.orchestrator.plan import load_plan

    plan = _plan(tmp_path, "replays: [{name: a, engine: hf, dtype: bf16, "
                 "knobs: {dtype: bfloat16, micro_batch_size: 2}}]\n")  # fmt: skip
    assert load_plan(plan).replays[0].knobs == {"dtype": "bfloat16", "micro_batch_size": 2}
    assert yaml.safe_load(plan.read_text())["rollout"] == {"engine": "hf", "dtype": "fp32"}
