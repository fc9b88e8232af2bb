"""The agent loop on real engines, replayed and compared as `lpx` runs them: token-in-token-out
trajectories pass at fp32 agreement, every one token-exact; the same loop in messages mode,
through the tiny model's template that strips thinking, fails naming `thinking_stripped` at the
first model turn after the user's follow-up, and the tokens whose context is exact stay inside
precision."""

from __future__ import annotations

import json

import pytest

from pipeline.fixture.io import read_table
from support.helpers import read_report, run_lpx

TRAJECTORIES, TURNS, TURN_TOKENS = 8, 4, 12
MODEL_TOKENS = TRAJECTORIES * TURNS * TURN_TOKENS
# fp32 rollout against fp32 replay of the same model (measured: max |d| 3.8e-6 HF, 4.5e-6 vLLM)
FP32_TOLERANCE = 2e-5
# the tiny template's turns: system 0, user 1, model 2, tool 3, model 4, user 5, model 6, ...
FIRST_MODEL_TURN_AFTER_A_USER_FOLLOW_UP = 6


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    from pipeline.prompts import smoke_prompt_texts

    path = tmp_path_factory.mktemp("agent") / "prompts.txt"
    path.write_text("\n".join(smoke_prompt_texts()[:TRAJECTORIES]) + "\n")
    return path


def agent_run(tmp, model, prompts, engine="hf", mode="tito", replay_engine="hf", *replay_extra):
    fixture = tmp / f"{engine}-{mode}.parquet"
    done = run_lpx("rollout", "--engine", engine, "--model", model, "--prompts", prompts,
                   "--agent-turns", TURNS, "--max-tokens", TURN_TOKENS, "--ignore-eos",
                   "--dtype", "fp32", "--agent-mode", mode, "--out", fixture)  # fmt: skip
    assert done.exit_code == 0, done.output
    replay = tmp / f"replay-{replay_engine}.parquet"
    done = run_lpx("replay", fixture, "--engine", replay_engine, "--dtype", "fp32", "--model",
                   model, *replay_extra, "--out", replay)  # fmt: skip
    assert done.exit_code == 0, done.output
    out = tmp / "compare"
    done = run_lpx("compare", fixture, replay, "--model", model, "--out", out)
    return done, read_report(out), read_table(fixture), fixture


@pytest.fixture(scope="module")
def tito(tmp_path_factory, tiny_model, prompts):
    return agent_run(tmp_path_factory.mktemp("tito"), tiny_model, prompts)


def test_token_in_token_out_trajectories_pass_token_exact_at_fp32_agreement(tito):
    done, report, fixture, _ = tito
    assert done.exit_code == 0, done.output
    assert report["verdict"] == "pass"
    assert not [f for f in report["diagnosis"] if f["cause"] == "trajectory_tokens"]
    # every model token judged (the tool turns' tokens are masked), tool turns between
    assert report["metrics"]["tokens"] == MODEL_TOKENS
    assert report["metrics"]["max_abs_diff"] < FP32_TOLERANCE
    described = fixture.metadata["trajectories"]
    assert len(described) == TRAJECTORIES
    for entry in described.values():
        roles = [t["role"] for t in entry["turns"]]
        assert roles.count("assistant") == TURNS and "tool" in roles
        # token-in-token-out: every context the engine reported is the sequence's prefix
        assert not any("context_ids" in t for t in entry["turns"])
    assert fixture.metadata["agent_loop"] == {
        "turns": TURNS, "mode": "tito", "think": True, "env_seed": 0,
    }  # fmt: skip


@pytest.mark.engine
@pytest.mark.parametrize(
    "engine", [pytest.param("vllm", marks=pytest.mark.vllm),
               pytest.param("sglang", marks=pytest.mark.sglang)],
)  # fmt: skip
def test_the_serving_engines_run_the_loop_in_one_session_token_exact(
    engine, tmp_path, tiny_model, prompts
):
    """vLLM (one engine for every turn) and SGLang (one server lpx starts): token-in-token-out
    trajectories, every context the engine reports the sequence's prefix, fp32 agreement
    with the HF replay (measured max |d|: vLLM 4.5e-6, SGLang 6.3e-6)."""
    done, report, fixture, _ = agent_run(tmp_path, tiny_model, prompts, engine=engine)
    assert done.exit_code == 0 and report["verdict"] == "pass", done.output
    assert fixture.metadata["engine"]["name"] == engine
    assert not [f for f in report["diagnosis"] if f["cause"] == "trajectory_tokens"]
    assert report["metrics"]["tokens"] == MODEL_TOKENS
    assert report["metrics"]["max_abs_diff"] < FP32_TOLERANCE
    assert not any("context_ids" in t for e in fixture.metadata["trajectories"].values()
                   for t in e["turns"])  # fmt: skip


@pytest.mark.distributed
def test_a_sharded_trainer_scores_the_trajectories_at_fp32_agreement(tito, tiny_model, tmp_path):
    fixture = tito[3]
    replay = tmp_path / "replay-fsdp.parquet"
    done = run_lpx("replay", fixture, "--engine", "fsdp", "--nproc", 2, "--dtype", "fp32",
                   "--model", tiny_model, "--out", replay)  # fmt: skip
    assert done.exit_code == 0, done.output
    done = run_lpx("compare", fixture, replay, "--model", tiny_model, "--out", tmp_path / "c")
    report = read_report(tmp_path / "c")
    assert done.exit_code == 0 and report["verdict"] == "pass", done.output
    assert report["metrics"]["tokens"] == MODEL_TOKENS
    assert report["metrics"]["max_abs_diff"] < FP32_TOLERANCE


def test_messages_mode_through_a_template_that_strips_thinking_fails_naming_the_turn(
    tmp_path, tiny_model, prompts
):
    done, report, fixture, _ = agent_run(tmp_path, tiny_model, prompts, mode="messages")
    assert done.exit_code == 1, done.output
    assert report["verdict"] == "fail"
    tokens = [f for f in report["diagnosis"] if f["cause"] == "trajectory_tokens"]
    by_class = {f["details"]["class"]: f for f in tokens}
    thinking = by_class["thinking_stripped"]
    assert thinking["status"] == "verified"
    assert thinking["sequence_count"] == TRAJECTORIES  # every trajectory, at the same turn
    turns = {p["turn"] for p in thinking["details"]["partings"]}
    assert turns == {FIRST_MODEL_TURN_AFTER_A_USER_FOLLOW_UP}
    # a messages-mode loop may also re-merge a model turn's decoded text: never another class
    assert set(by_class) <= {"thinking_stripped", "bpe_remerge"}
    # nothing else is blamed: no engine drift, no precision finding
    assert {f["cause"] for f in report["diagnosis"] if f["severity"] == "fault"} == {
        "trajectory_tokens"
    }
    # the model tokens whose context is exact are judged, and stay at fp32 agreement: the
    # turns before the follow-up (2 of 4 model turns) at least
    assert MODEL_TOKENS // 2 - 2 * TURN_TOKENS <= report["metrics"]["tokens"] < MODEL_TOKENS
    assert report["metrics"]["max_abs_diff"] < FP32_TOLERANCE
    assert report["policy"]["violations"] == []
    # the engine's contexts that were not the sequence's prefix are kept in the fixture
    kept = [t for e in fixture.metadata["trajectories"].values() for t in e["turns"]
            if "context_ids" in t]  # fmt: skip
    assert len(kept) >= TRAJECTORIES * 2


def test_an_agent_loop_needs_text_prompts_and_a_chat_template(tmp_path, tiny_model):
    ids = tmp_path / "ids.jsonl"
    ids.write_text(json.dumps({"prompt_ids": [5, 6, 7]}) + "\n")
    done = run_lpx("rollout", "--model", tiny_model, "--prompts", ids, "--agent-turns", 2,
                   "--out", tmp_path / "f.parquet")  # fmt: skip
    assert done.exit_code == 2
    assert f"{ids} line 1: an agent loop renders prompts through the chat template" in done.output
    assert not (tmp_path / "f.parquet").exists()
