"""The agent loop on real engines, replayed and compared as `lpx` runs them: token-in-token-out
trajectories pass at fp32 agreement, every one token-exact; the same loop in messages mode,
through the tiny model's template that strips thinking, fails naming `thinking_stripped` at the
first model turn after the user's follow-up (rendered by lpx, by vLLM's and by SGLang's own chat
paths), and the tokens whose context is exact stay inside precision."""

from __future__ import annotations

import json
from dataclasses import replace

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
    assert report["metrics"]["token_exact_rate"] == 1.0
    assert report["metrics"]["model_tokens_outside_precision"] == 0
    by_turn = report["metrics"]["by_turn"]
    assert [row["turn"] for row in by_turn] == list(range(1, TURNS + 1))
    assert {row["tokens"] for row in by_turn} == {TRAJECTORIES * TURN_TOKENS}
    assert max(row["max_abs_diff"] for row in by_turn) < FP32_TOLERANCE
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
    # HF has no chat path of its own: lpx renders with transformers
    assert fixture.metadata["agent_loop"]["rendered_by"].startswith("lpx")
    assert_thinking_stripped_named_and_nothing_else(done, report, fixture)


@pytest.mark.engine
@pytest.mark.parametrize(
    "engine, path", [pytest.param("vllm", "vLLM LLM.chat", marks=pytest.mark.vllm),
                     pytest.param("sglang", "SGLang /v1/chat/completions",
                                  marks=pytest.mark.sglang)],
)  # fmt: skip
def test_messages_mode_through_the_engines_own_chat_path_names_the_stripped_thinking(
    engine, path, tmp_path, tiny_model, prompts
):
    """vLLM renders each turn's conversation with LLM.chat, SGLang with its OpenAI chat
    endpoint (the opened <think> continued as the final assistant message; SGLang tokenizes
    it on its own): the ids each engine rendered are the contexts checked, and the same
    class is named at the same turn as when lpx renders."""
    done, report, fixture, _ = agent_run(tmp_path, tiny_model, prompts, engine=engine,
                                         mode="messages")  # fmt: skip
    assert fixture.metadata["agent_loop"]["rendered_by"].startswith(path)
    assert fixture.metadata["prompts_rendered_by"].startswith(path)
    assert_thinking_stripped_named_and_nothing_else(done, report, fixture)


def assert_thinking_stripped_named_and_nothing_else(done, report, fixture):
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
    assert report["metrics"]["token_exact_rate"] == 0.0  # every trajectory parts at turn 6
    judged = sum(row["tokens"] for row in report["metrics"]["by_turn"])
    assert judged == report["metrics"]["tokens"]
    assert report["metrics"]["model_tokens_outside_precision"] == MODEL_TOKENS - judged
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


def _agent_dump(table, path, shape: str, shift_mask_of: str | None = None):
    """The fixture's trajectories as an agent framework dumps them: verl's AgentLoopOutput
    (prompt_ids, response_ids, response_mask, response_logprobs with 0.0 on tool tokens,
    num_turns) or slime's Sample (tokens, response_length, loss_mask, rollout_log_probs)."""
    import numpy as np

    lines = []
    for row, sequence_id in enumerate(table.sequence_ids):
        prompt = [int(v) for v in table.prompt_of(row)]
        span = table.completion_slice(row)
        response = [int(v) for v in table.completion_ids[span]]
        mask = [int(v) for v in table.completion_mask[span]]
        logprobs = [0.0 if not m else float(v)
                    for m, v in zip(mask, table.channels["rollout"][span], strict=True)]  # fmt: skip
        if sequence_id == shift_mask_of:  # the mask one token late, the logprobs where they were
            mask = [0] + mask[:-1]
        turns = sum(1 for a, b in zip([0] + mask, mask, strict=False) if b and not a)
        assert not np.isnan(logprobs).any()
        if shape == "verl-agent":
            lines.append({"prompt_ids": prompt, "response_ids": response, "response_mask": mask,
                          "response_logprobs": logprobs, "num_turns": 2 * turns})  # fmt: skip
        elif shape == "skyrl":  # TrajectoryOutput
            lines.append({"prompt_ids": prompt, "response_ids": response, "loss_mask": mask,
                          "rollout_logprobs": logprobs, "stop_reason": "length"})  # fmt: skip
        elif shape == "skyrl-generator":  # a sample of GeneratorOutput
            lines.append({"prompt_token_ids": prompt, "response_ids": response,
                          "loss_masks": mask, "rollout_logprobs": logprobs, "rewards": 0.0,
                          "trajectory_ids": {"instance_id": sequence_id, "repetition_id": 0}})  # fmt: skip
        else:
            lines.append({"tokens": prompt + response, "response_length": len(response),
                          "loss_mask": mask, "rollout_log_probs": logprobs})  # fmt: skip
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


@pytest.mark.parametrize("shape, extra", [("verl-agent", ()), ("slime", ("--multi-turn",))])
def test_an_agent_frameworks_dump_is_ingested_as_turns_and_its_masks_honoured(
    shape, extra, tito, tiny_model, tmp_path
):
    _, _, table, _ = tito
    dump = _agent_dump(table, tmp_path / "dump.jsonl", shape)
    fixture = tmp_path / "fixture.parquet"
    done = run_lpx("ingest", dump, "--preset", shape, *extra, "--model", tiny_model,
                   "--dtype", "fp32", "--engine-name", "hf", "--out", fixture)  # fmt: skip
    assert done.exit_code == 0, done.output
    ingested = read_table(fixture)
    # a dump without ids: each trajectory is named by its line
    roles = [t["role"] for t in ingested.metadata["trajectories"]["1"]["turns"]]
    assert roles[0] == "user" and roles.count("assistant") == TURNS and "tool" in roles
    replay = tmp_path / "replay.parquet"
    assert run_lpx("replay", fixture, "--engine", "hf", "--dtype", "fp32", "--model", tiny_model,
                   "--out", replay).exit_code == 0  # fmt: skip
    done = run_lpx("compare", fixture, replay, "--model", tiny_model, "--out", tmp_path / "c")
    report = read_report(tmp_path / "c")
    assert done.exit_code == 0 and report["verdict"] == "pass", done.output
    assert report["metrics"]["tokens"] == MODEL_TOKENS  # the tool turns' tokens masked
    assert report["metrics"]["max_abs_diff"] < FP32_TOLERANCE


@pytest.mark.parametrize("shape", ["skyrl", "skyrl-generator"])
def test_skyrl_dumps_read_as_the_verl_agent_dump_of_the_same_trajectories(shape, tito, tmp_path):
    """SkyRL's per-trajectory record and its batch's samples name the same things otherwise:
    ingested, they are the verl-agent dump's fixture, token for token and turn for turn."""
    _, _, table, _ = tito
    fixtures = {}
    for preset in ("verl-agent", shape):
        dump = _agent_dump(table, tmp_path / f"{preset}.jsonl", preset)
        fixtures[preset] = tmp_path / f"{preset}.parquet"
        done = run_lpx("ingest", dump, "--preset", preset, "--out", fixtures[preset])
        assert done.exit_code == 0, done.output
    ours, theirs = read_table(fixtures["verl-agent"]), read_table(fixtures[shape])
    assert theirs.completion_ids.tolist() == ours.completion_ids.tolist()
    assert theirs.completion_mask.tolist() == ours.completion_mask.tolist()
    assert theirs.channels["rollout"].tolist() == ours.channels["rollout"].tolist()
    assert theirs.metadata["trajectories"] == ours.metadata["trajectories"]
    assert int(theirs.completion_mask.sum()) == MODEL_TOKENS


def test_nemo_rl_grpo_train_data_reads_as_the_verl_agent_dump_of_the_same_trajectories(
    tito, tmp_path
):
    """GRPO's train_data_step{N}.jsonl rows: the flattened sequence right-padded to the batch,
    input_lengths, token_loss_mask, generation_logprobs (0.0 off the generated tokens) and
    prev_logprobs over every token; ingested, the verl-agent dump's fixture, with the
    trainer's prev_logprobs as the `old` channel. A mask that is not 0/1 is one line."""
    _, _, table, _ = tito
    verl = _agent_dump(table, tmp_path / "verl.jsonl", "verl-agent")
    assert run_lpx("ingest", verl, "--preset", "verl-agent", "--out",
                   tmp_path / "verl.parquet").exit_code == 0  # fmt: skip
    rows = [json.loads(line) for line in verl.read_text().splitlines()]
    longest = max(len(r["prompt_ids"]) + len(r["response_ids"]) for r in rows)
    lines = []
    for k, row in enumerate(rows):
        tokens = row["prompt_ids"] + row["response_ids"]
        pad = longest - len(tokens)
        lines.append({"idx": k + 1, "content": "...", "input_lengths": len(tokens),
                      "token_ids": tokens + [0] * pad,
                      "token_loss_mask": [0] * len(row["prompt_ids"]) + row["response_mask"] + [0] * pad,
                      "generation_logprobs": [0.0] * len(row["prompt_ids"]) + row["response_logprobs"] + [0.0] * pad,
                      "prev_logprobs": [-0.5] * longest, "advantages": [0.0] * longest})  # fmt: skip
    dump = tmp_path / "train_data_step1.jsonl"
    dump.write_text("".join(json.dumps(line) + "\n" for line in lines))
    done = run_lpx("ingest", dump, "--preset", "nemo-rl-train", "--out", tmp_path / "n.parquet")
    assert done.exit_code == 0, done.output
    ours, theirs = read_table(tmp_path / "verl.parquet"), read_table(tmp_path / "n.parquet")
    assert theirs.completion_ids.tolist() == ours.completion_ids.tolist()
    assert theirs.completion_mask.tolist() == ours.completion_mask.tolist()
    assert theirs.channels["rollout"].tolist() == ours.channels["rollout"].tolist()
    assert set(theirs.channels["old"].tolist()) == {-0.5}
    assert theirs.metadata["trajectories"] == ours.metadata["trajectories"]
    assert theirs.metadata["agent_loop"] == {"mode": "ingested", "preset": "nemo-rl-train"}
    lines[1]["token_loss_mask"][-1 - (longest - lines[1]["input_lengths"])] = 2
    dump.write_text("".join(json.dumps(line) + "\n" for line in lines))
    done = run_lpx("ingest", dump, "--preset", "nemo-rl-train", "--out", tmp_path / "bad.parquet")
    assert done.exit_code == 2
    assert f"{dump} line 2: `token_loss_mask` is a mask: it must hold 0 or 1" in done.output
    assert not (tmp_path / "bad.parquet").exists()
    done = run_lpx("ingest", dump, "--preset", "nemo-rl-train", "--field", "mask=m", "--out",
                   tmp_path / "bad.parquet")  # fmt: skip
    assert done.exit_code == 2 and "--field does not apply" in done.output


def test_a_dumps_mask_one_token_off_its_logprobs_is_named_and_kept_out_of_precision(
    tito, tiny_model, tmp_path
):
    _, _, table, _ = tito
    dump = _agent_dump(table, tmp_path / "dump.jsonl", "verl-agent", shift_mask_of="3-0")
    fixture = tmp_path / "fixture.parquet"
    assert run_lpx("ingest", dump, "--preset", "verl-agent", "--model", tiny_model, "--dtype",
                   "fp32", "--out", fixture).exit_code == 0  # fmt: skip
    replay = tmp_path / "replay.parquet"
    assert run_lpx("replay", fixture, "--engine", "hf", "--dtype", "fp32", "--model", tiny_model,
                   "--out", replay).exit_code == 0  # fmt: skip
    done = run_lpx("compare", fixture, replay, "--model", tiny_model, "--out", tmp_path / "c")
    report = read_report(tmp_path / "c")
    assert done.exit_code == 1 and report["verdict"] == "fail", done.output
    (finding,) = [f for f in report["diagnosis"] if f["severity"] == "fault"]
    assert finding["cause"] == "trajectory_tokens" and finding["status"] == "verified"
    assert finding["details"]["class"] == "mask_off_by_one"
    assert finding["sequences"] == ["4"]  # the dump's line 4, trajectory 3-0
    # every model turn of the trajectory, each named at its own turn
    assert len(finding["details"]["partings"]) == TURNS
    # its turns are kept out of precision; the other 7 trajectories are judged and agree
    assert report["metrics"]["tokens"] == MODEL_TOKENS - TURNS * TURN_TOKENS
    assert report["metrics"]["max_abs_diff"] < FP32_TOLERANCE


@pytest.mark.distributed
def test_the_example_agent_plan_runs_records_a_series_of_its_own_and_reports_per_turn(tmp_path):
    """examples/smoke-agent.yaml as the docs run it: HF agent loop, HF and FSDP2 replays,
    recorded with the loop in the case (its own series), the run page's per-turn table."""
    import sqlite3
    from pathlib import Path

    plan = Path(__file__).parents[2] / "examples" / "smoke-agent.yaml"
    db, site = tmp_path / "h.db", tmp_path / "site"
    done = run_lpx("run", plan, "--out", tmp_path / "run", "--db", db, "--report-out", site)
    assert done.exit_code == 0, done.output
    with sqlite3.connect(db) as connection:
        loops = {row[0] for row in connection.execute("SELECT agent_loop FROM cases")}
    # the case names the loop and the template that rendered its turns
    from pipeline.fingerprint import chat_template_fingerprint

    template = chat_template_fingerprint(tmp_path / "run" / "model").removeprefix("sha256:")
    assert loops == {f"4 turns, tito, thinking, template {template[:12]}"}
    page = (site / "runs" / "1.html").read_text()
    assert "of trajectories token-exact" in page and page.count('class="by-turn"') == 2


def _message_log(table, path):
    """The fixture's trajectories as NeMo-RL's message_log: turns with role and token_ids,
    the assistant turns with generation_logprobs."""
    lines = []
    for row, sequence_id in enumerate(table.sequence_ids):
        prompt_len = len(table.prompt_of(row))
        flat = [int(v) for v in table.prompt_of(row)] + [
            int(v) for v in table.completion_ids[table.completion_slice(row)]
        ]
        values = table.channels["rollout"][table.completion_slice(row)]
        turns = []
        for turn in table.metadata["trajectories"][sequence_id]["turns"]:
            entry = {"role": turn["role"], "token_ids": flat[turn["start"] : turn["end"]]}
            if turn["role"] == "assistant":
                lo, hi = turn["start"] - prompt_len, turn["end"] - prompt_len
                entry["generation_logprobs"] = [float(v) for v in values[lo:hi]]
            turns.append(entry)
        lines.append({"idx": sequence_id, "message_log": turns})
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def _after_grpo(dump, path):
    """The message_log as NeMo-RL's GRPO step rewrites it before training (grpo.py at
    7ea279ab): token_loss_mask 1 on generated turns, 0 elsewhere; zero generation_logprobs
    where a turn had none. The prompt's first half becomes an assistant turn of its history."""
    lines = []
    for line in dump.read_text().splitlines():
        record = json.loads(line)
        turns = record["message_log"]
        prompt = turns[0]["token_ids"]
        half = len(prompt) // 2
        turns[:1] = [{"role": "user", "token_ids": prompt[:half]},
                     {"role": "assistant", "token_ids": prompt[half:]}]  # fmt: skip
        for turn in turns:
            generated = "generation_logprobs" in turn
            turn["token_loss_mask"] = [int(generated)] * len(turn["token_ids"])
            turn.setdefault("generation_logprobs", [0.0] * len(turn["token_ids"]))
        lines.append(json.dumps(record))
    path.write_text("\n".join(lines) + "\n")
    return path


def test_a_nemo_rl_message_log_is_ingested_turn_by_turn(tito, tiny_model, tmp_path):
    _, _, table, _ = tito
    dump = _message_log(table, tmp_path / "message_log.jsonl")
    fixture = tmp_path / "fixture.parquet"
    done = run_lpx("ingest", dump, "--preset", "nemo-rl", "--model", tiny_model, "--dtype",
                   "fp32", "--out", fixture)  # fmt: skip
    assert done.exit_code == 0, done.output
    replay = tmp_path / "replay.parquet"
    assert run_lpx("replay", fixture, "--engine", "hf", "--dtype", "fp32", "--model", tiny_model,
                   "--out", replay).exit_code == 0  # fmt: skip
    done = run_lpx("compare", fixture, replay, "--model", tiny_model, "--out", tmp_path / "c")
    report = read_report(tmp_path / "c")
    assert done.exit_code == 0 and report["verdict"] == "pass", done.output
    assert report["metrics"]["tokens"] == MODEL_TOKENS
    assert report["metrics"]["token_exact_rate"] == 1.0
    # as GRPO's add_grpo_token_loss_masks_and_generation_logprobs leaves it: a token_loss_mask
    # on every turn, zero generation_logprobs on the turns the model did not generate, and an
    # assistant turn of the prompt's history (no logprobs, mask 0) is context
    grpo = _after_grpo(dump, tmp_path / "grpo.jsonl")
    done = run_lpx("ingest", grpo, "--preset", "nemo-rl", "--model", tiny_model, "--dtype",
                   "fp32", "--out", tmp_path / "grpo.parquet")  # fmt: skip
    assert done.exit_code == 0, done.output
    done = run_lpx("compare", tmp_path / "grpo.parquet", replay, "--model", tiny_model, "--out",
                   tmp_path / "c2")  # fmt: skip
    report = read_report(tmp_path / "c2")
    assert done.exit_code == 0 and report["verdict"] == "pass", done.output
    assert report["metrics"]["tokens"] == MODEL_TOKENS
    assert report["metrics"]["max_abs_diff"] < FP32_TOLERANCE
    # a loss mask of 1 on a tool turn: one line naming the line and the turn
    lines = grpo.read_text().splitlines()
    bad = json.loads(lines[2])
    turn = next(k for k, t in enumerate(bad["message_log"]) if t["role"] == "tool")
    bad["message_log"][turn]["token_loss_mask"] = [1] * len(bad["message_log"][turn]["token_ids"])
    lines[2] = json.dumps(bad)
    grpo.write_text("\n".join(lines) + "\n")
    done = run_lpx("ingest", grpo, "--preset", "nemo-rl", "--out", tmp_path / "bad.parquet")
    assert done.exit_code == 2
    assert f"{grpo} line 3, turn {turn} (tool): `token_loss_mask` is 1 on a turn" in done.output
    # a tool turn that carries logprobs: one line naming the line and the turn, nothing written
    lines = dump.read_text().splitlines()
    bad = json.loads(lines[1])
    bad["message_log"][3]["generation_logprobs"] = [-1.0] * len(bad["message_log"][3]["token_ids"])
    lines[1] = json.dumps(bad)
    dump.write_text("\n".join(lines) + "\n")
    done = run_lpx("ingest", dump, "--preset", "nemo-rl", "--out", tmp_path / "bad.parquet")
    assert done.exit_code == 2
    assert f"{dump} line 2, turn 3 (tool): `generation_logprobs` on a turn" in done.output
    assert not (tmp_path / "bad.parquet").exists()


def _positions_without_tool_turns(turns: list[dict], length: int):
    """Position ids as an engine counts them when it resumes a session without counting the
    tool turns' tokens: each turn after a tool turn starts that many positions early."""
    import numpy as np

    skipped = np.zeros(length + 1, dtype=np.int64)
    for turn in turns:
        if turn["role"] == "tool":
            skipped[turn["end"]] += turn["end"] - turn["start"]
    return np.arange(length) - np.cumsum(skipped)[:length]


def test_a_rollout_whose_positions_skip_the_tool_turns_drifts_more_each_turn_and_is_named(
    tito, tiny_model, tmp_path
):
    """The rollout engine's logprobs as the real model gives them when the engine counts no
    positions for tool output: turn 1 is exact, each later turn sits closer to the context it
    reads by every tool turn so far. Compare names the growth from turn 2, with turn 1 clean."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from pipeline.faults.forward import score_sequence
    from pipeline.fixture.io import write_table

    _, _, table, fixture_path = tito
    model = AutoModelForCausalLM.from_pretrained(tiny_model, torch_dtype=torch.float32).eval()
    rollout = table.channels["rollout"].copy()
    mask = table.completion_mask.astype(bool)
    with torch.no_grad():
        for row, sequence_id in enumerate(table.sequence_ids):
            prompt, completion = table.prompt_of(row), table.completion_of(row)
            turns = table.metadata["trajectories"][sequence_id]["turns"]
            positions = _positions_without_tool_turns(turns, len(prompt) + len(completion))
            scored = score_sequence(model, prompt, completion, positions=positions)
            span = table.completion_slice(row)
            rollout[span] = np.where(mask[span], scored, rollout[span])
    faulted = tmp_path / "positions-skip-tools.parquet"
    write_table(replace(table, channels={**table.channels, "rollout": rollout}), faulted)
    replay = fixture_path.parent / "replay-hf.parquet"
    done = run_lpx("compare", faulted, replay, "--model", tiny_model, "--no-verify",
                   "--out", tmp_path / "c")  # fmt: skip
    assert done.exit_code == 1, done.output
    report = read_report(tmp_path / "c")
    assert report["verdict"] == "fail"
    (growth,) = [f for f in report["diagnosis"] if f["cause"] == "turn_growth"]
    assert growth["severity"] == "fault" and growth["first_position"] == {"turn": 2}
    assert growth["sequence_count"] == TRAJECTORIES
    per_turn = growth["details"]["per_turn"]
    assert [row["turn"] for row in per_turn] == list(range(1, TURNS + 1))
    assert per_turn[0]["mean_abs_diff"] < FP32_TOLERANCE  # turn 1 saw no tool turn
    assert growth["details"]["p"] < growth["details"]["alpha"] == 1e-3
    by_turn = report["metrics"]["by_turn"]
    assert by_turn[0]["max_abs_diff"] < FP32_TOLERANCE < by_turn[1]["mean_abs_diff"]
