"""`lpx ingest --preset` reads what a framework's dump holds at each stage (issue 59 item 3).

A rollout-stage dump (no old/ref logprobs yet) gives a fixture without those channels that
replays and compares for real; a trainer-stage dump keeps them; a present field that is
malformed, and a dump whose lines come from two stages, are one-line errors naming the line.
The dumps' rollout logprobs are the tiny model's HF fp32 teacher-forced logprobs (the
`lpx make-model` model), so a faithful ingest must compare equal to an HF fp32 replay."""

from __future__ import annotations

import json

import numpy as np
import pytest

from pipeline.fixture.io import read_table
from support.helpers import read_report, run_lpx

# (prompt, response) token ids; the tiny model's vocabulary has 512 ids
SEQUENCES = [
    ([12, 40, 41], [55, 60, 61, 62]),
    ([7, 300], [301, 302, 303, 304, 305, 306]),
    ([99, 100, 101, 102], [17, 18, 19, 20, 21]),
]
RESPONSE_MASKS = [[1, 1, 1, 1], [1, 1, 0, 0, 1, 1], [1, 1, 1, 1, 0]]  # 0: a tool's tokens


@pytest.fixture(scope="module")
def scored(tiny_model, tmp_path_factory) -> dict:
    """The HF fp32 replay of SEQUENCES: its per-response logprobs (what every dump below
    holds as rollout logprobs) and the replay file (sequence ids are the line numbers)."""
    root = tmp_path_factory.mktemp("scored")
    records = [
        {"prompt_ids": p, "response_ids": r, "rollout_log_probs": [-1.0] * len(r)}
        for p, r in SEQUENCES
    ]
    _write(root / "placeholder.jsonl", records)
    _ok(run_lpx("ingest", root / "placeholder.jsonl", "--model", tiny_model, "--dtype", "fp32",
                "--engine-name", "hf", "--out", root / "placeholder.parquet"))  # fmt: skip
    _ok(run_lpx("replay", root / "placeholder.parquet", "--engine", "hf", "--dtype", "fp32",
                "--out", root / "replay.parquet"))  # fmt: skip
    replay = read_table(root / "replay.parquet")
    logprobs = [replay.channels["replay"][replay.completion_slice(i)].tolist() for i in range(3)]
    return {"logprobs": logprobs, "replay": root / "replay.parquet"}


# -- verl --------------------------------------------------------------------------------


def verl_rollout_stage(logprobs) -> list[dict]:
    """What verl's agent loop writes before the trainer's recompute, padding stripped."""
    return [
        {"prompts": p, "responses": r, "response_mask": m, "rollout_log_probs": lp}
        for (p, r), m, lp in zip(SEQUENCES, RESPONSE_MASKS, logprobs, strict=True)
    ]


def test_a_verl_rollout_stage_dump_replays_and_compares(scored, tiny_model, tmp_path):
    dump = _write(tmp_path / "verl.jsonl", verl_rollout_stage(scored["logprobs"]))
    fixture, report = _ingest_replay_compare(dump, "verl", tiny_model, tmp_path)
    assert set(fixture.channels) == {"rollout"}  # no old/ref invented
    assert fixture.weight_versions is None
    assert fixture.completion_mask.tolist() == [bool(v) for m in RESPONSE_MASKS for v in m]
    assert fixture.metadata["logprob_channels"] == {
        "rollout": "as dumped in field 'rollout_log_probs'"
    }
    assert report["verdict"] == "pass"
    assert report["metrics"]["tokens"] == 12  # the 15 response tokens less 3 masked
    # measured: 0.0 (the same HF fp32 forward on the same tokens)
    assert report["metrics"]["max_abs_diff"] < 1e-5
    assert "old_vs_replay" not in report["metrics"]["kl_input_drift"]
    assert "ref_kl" not in report["metrics"]["kl_input_drift"]


@pytest.mark.parametrize(
    "mask, message",
    [
        ([1, 1], "field 'response_mask' has 2 values for 6 completion tokens."),
        ([1, 1, 2, 1, 1, 1], "field 'response_mask' is a mask: it must hold true/false or 1/0."),
        ("111111", "field 'response_mask' must be a list of one value per completion token, "
         "got str."),
    ],
)  # fmt: skip
def test_a_malformed_verl_response_mask_is_one_line_naming_the_line(
    mask, message, scored, tmp_path
):
    records = verl_rollout_stage(scored["logprobs"])
    records[1]["response_mask"] = mask
    dump = _write(tmp_path / "verl.jsonl", records)
    out = tmp_path / "f.parquet"
    result = run_lpx("ingest", dump, "--preset", "verl", "--out", out)
    assert _error(result) == f"Error: {dump} line 2: {message}"
    assert not out.exists()


def test_a_verl_trainer_stage_dump_keeps_old_and_ref(scored, tmp_path):
    records = verl_rollout_stage(scored["logprobs"])
    for record in records:
        record["old_log_probs"] = [v - 0.25 for v in record["rollout_log_probs"]]
        record["ref_log_prob"] = [v - 0.5 for v in record["rollout_log_probs"]]
    dump = _write(tmp_path / "verl.jsonl", records)
    fixture = _ingest(dump, "verl", tmp_path / "f.parquet")
    assert set(fixture.channels) == {"rollout", "old", "ref"}
    for channel, key in (("old", "old_log_probs"), ("ref", "ref_log_prob")):
        dumped = np.array([v for r in records for v in r[key]], dtype=np.float32)
        assert np.array_equal(fixture.channels[channel], dumped)
    # compare reads them: old is the replay's logprobs less 0.25 on every active token
    result = run_lpx("compare", tmp_path / "f.parquet", scored["replay"], "--out", tmp_path / "c")
    assert result.exit_code == 0, result.output
    drift = read_report(tmp_path / "c")["metrics"]["kl_input_drift"]
    assert drift["old_vs_replay"]["max_abs_diff"] == pytest.approx(0.25, abs=1e-6)
    assert drift["old_vs_replay"]["mean_abs_diff"] == pytest.approx(0.25, abs=1e-6)
    assert "ref_kl" in drift


def test_verl_padded_rows_are_unpadded_with_their_attention_mask(scored, tmp_path):
    """A DataProto row dumped as-is: prompts left-padded, responses right-padded, per-token
    fields padded to the response length; the pad tokens are not read as tokens."""
    plain = verl_rollout_stage(scored["logprobs"])
    for record in plain:
        record["old_log_probs"] = [v - 0.25 for v in record["rollout_log_probs"]]
    padded = []
    for record in plain:
        left, right = 5 - len(record["prompts"]), 7 - len(record["responses"])
        padded.append({
            "prompts": [0] * left + record["prompts"],
            "responses": record["responses"] + [0] * right,
            "attention_mask": [0] * left + [1] * (5 - left) + [1] * (7 - right) + [0] * right,
            "response_mask": record["response_mask"] + [0] * right,
            "rollout_log_probs": record["rollout_log_probs"] + [0.0] * right,
            "old_log_probs": record["old_log_probs"] + [-7.0] * right,  # the trainer's junk
        })  # fmt: skip
    expected = _ingest(_write(tmp_path / "plain.jsonl", plain), "verl", tmp_path / "a.parquet")
    got = _ingest(_write(tmp_path / "padded.jsonl", padded), "verl", tmp_path / "b.parquet")
    assert got.prompt_ids.tolist() == [t for p, _ in SEQUENCES for t in p]
    for name in ("prompt_offsets", "prompt_ids", "completion_offsets", "completion_ids",
                 "completion_mask"):  # fmt: skip
        assert np.array_equal(getattr(got, name), getattr(expected, name)), name
    for channel in ("rollout", "old"):
        assert np.array_equal(got.channels[channel], expected.channels[channel]), channel


def test_verl_routed_experts_on_a_padded_row_keep_their_real_positions(scored, tmp_path):
    """verl's agent loop writes routed_experts over every position of the padded row (zeros
    on the padding); the real positions are the ones an unpadded dump holds."""
    (prompt, response), logprobs = SEQUENCES[0], scored["logprobs"][0]
    real = [[sorted([i % 8, (i + 3) % 8])] for i in range(len(prompt) + len(response))]  # top-2
    plain = {"prompts": prompt, "responses": response, "rollout_log_probs": logprobs,
             "routed_experts": real}  # fmt: skip
    padded = {
        "prompts": [0, 0] + prompt,
        "responses": response + [0],
        "attention_mask": [0, 0] + [1] * (len(prompt) + len(response)) + [0],
        "rollout_log_probs": logprobs + [0.0],
        "routed_experts": [[[0, 0]]] * 2 + real + [[[0, 0]]],
    }
    field = ("--field", "routed_experts=routed_experts")
    expected = _ingest(
        _write(tmp_path / "a.jsonl", [plain]), "verl", tmp_path / "a.parquet", *field
    )
    got = _ingest(_write(tmp_path / "b.jsonl", [padded]), "verl", tmp_path / "b.parquet", *field)
    assert got.routed_experts.tolist() == expected.routed_experts.tolist() == real[:-1]


def test_a_hole_in_the_attention_mask_is_refused(scored, tmp_path):
    record = verl_rollout_stage(scored["logprobs"])[0]
    record["attention_mask"] = [1, 0, 1, 1, 1, 1, 1]
    dump = _write(tmp_path / "verl.jsonl", [record])
    assert _error(run_lpx("ingest", dump, "--preset", "verl", "--out", tmp_path / "f.parquet")) == (
        f"Error: {dump} line 1: field 'attention_mask' must be 0s then 1s over the prompt (left "
        "padding) and 1s then 0s over the response (right padding); holes inside a sequence "
        "are not a padding lpx can undo."
    )


# -- two stages in one dump, and fields the user names --------------------------------------


def test_a_dump_that_mixes_stages_is_refused_naming_both_lines(scored, tmp_path):
    records = verl_rollout_stage(scored["logprobs"])
    for record in records[0], records[2]:  # the trainer recomputed lines 1 and 3 only
        record["old_log_probs"] = record["rollout_log_probs"]
    dump = _write(tmp_path / "verl.jsonl", records)
    out = tmp_path / "f.parquet"
    assert _error(run_lpx("ingest", dump, "--preset", "verl", "--out", out)) == (
        f"Error: {dump} line 2: no field 'old_log_probs', which line 1 has; the dump mixes stages "
        "(or joins two dumps): ingest each stage's lines apart, or leave the field out with "
        "--field old=."
    )
    assert not out.exists()
    records[0].pop("old_log_probs")  # now line 1 lacks it and line 3 is the first to hold it
    dump = _write(tmp_path / "verl.jsonl", records)
    assert _error(run_lpx("ingest", dump, "--preset", "verl", "--out", out)).startswith(
        f"Error: {dump} line 1: no field 'old_log_probs', which line 3 has;"
    )
    left_out = _ingest(dump, "verl", out, "--field", "old=")
    assert set(left_out.channels) == {"rollout"}


def test_a_field_named_with_field_is_required(scored, tmp_path):
    dump = _write(tmp_path / "verl.jsonl", verl_rollout_stage(scored["logprobs"]))
    result = run_lpx("ingest", dump, "--preset", "verl", "--field", "ref=ref_log_prob",
                     "--out", tmp_path / "f.parquet")  # fmt: skip
    assert _error(result) == (
        f"Error: {dump} line 1: no field 'ref_log_prob' (the line has: prompts, response_mask, "
        "responses, rollout_log_probs); map it with --field."
    )
    result = run_lpx("ingest", dump, "--preset", "verl", "--field",
                     "attention_mask=attention_mask", "--out", tmp_path / "f.parquet")  # fmt: skip
    assert _error(result).startswith(f"Error: {dump} line 1: no field 'attention_mask' (")
    result = run_lpx("ingest", dump, "--field", "rollout=", "--out", tmp_path / "f.parquet")
    assert _error(result) == (
        "Error: --field rollout=: rollout cannot be left out; give its JSON key. Fields that "
        "can: sequence_id, attention_mask, mask, old, ref, current, weight_version, "
        "routed_experts."
    )


# -- slime -------------------------------------------------------------------------------


def slime_rollout_stage(logprobs) -> list[dict]:
    """Sample.to_dict() of a rollout: prompt + response in `tokens`; loss_mask null where
    every token trains; weight_versions empty where SGLang reported no version."""
    return [
        {"tokens": p + r, "response_length": len(r), "loss_mask": None if all(m) else m,
         "rollout_log_probs": lp, "weight_versions": []}
        for (p, r), m, lp in zip(SEQUENCES, RESPONSE_MASKS, logprobs, strict=True)
    ]  # fmt: skip


def test_a_slime_rollout_stage_dump_replays_and_compares(scored, tiny_model, tmp_path):
    dump = _write(tmp_path / "slime.jsonl", slime_rollout_stage(scored["logprobs"]))
    fixture, report = _ingest_replay_compare(dump, "slime", tiny_model, tmp_path)
    assert set(fixture.channels) == {"rollout"}
    assert fixture.weight_versions is None  # none reported: none invented
    assert fixture.prompt_ids.tolist() == [t for p, _ in SEQUENCES for t in p]
    assert fixture.completion_mask.tolist() == [bool(v) for m in RESPONSE_MASKS for v in m]
    assert report["verdict"] == "pass"
    assert report["metrics"]["tokens"] == 12
    assert report["metrics"]["max_abs_diff"] < 1e-5  # measured: 0.0


def test_slime_weight_versions_are_one_per_generate_call(scored, tmp_path):
    records = slime_rollout_stage(scored["logprobs"])
    for record in records:
        record["weight_versions"] = ["3"]  # one generate call under version 3
    records[2]["weight_versions"] = ["3", "3"]  # a partial rollout resumed under the same one
    fixture = _ingest(_write(tmp_path / "slime.jsonl", records), "slime", tmp_path / "f.parquet")
    assert fixture.weight_versions.tolist() == ["3"] * 15
    records[1]["weight_versions"] = ["3", "4"]  # resumed after a weight update
    dump = _write(tmp_path / "slime.jsonl", records)
    assert _error(
        run_lpx("ingest", dump, "--preset", "slime", "--out", tmp_path / "g.parquet")
    ) == (
        f"Error: {dump} line 2: field 'weight_versions' holds 2 versions (3, 4) for 6 completion "
        "tokens; give one per token, or one per trajectory (a sample that spans a weight update "
        "must say which tokens each version made)."
    )
    records[1]["weight_versions"] = []
    dump = _write(tmp_path / "slime.jsonl", records)
    assert _error(
        run_lpx("ingest", dump, "--preset", "slime", "--out", tmp_path / "g.parquet")
    ) == (
        f"Error: {dump} line 2: no field 'weight_versions', which line 1 has; the dump mixes "
        "stages (or joins two dumps): ingest each stage's lines apart, or leave the field out "
        "with --field weight_version=."
    )


def test_a_malformed_slime_loss_mask_is_one_line_naming_the_line(scored, tmp_path):
    records = slime_rollout_stage(scored["logprobs"])
    records[2]["loss_mask"] = [1, 1, 1, 1]
    dump = _write(tmp_path / "slime.jsonl", records)
    assert _error(
        run_lpx("ingest", dump, "--preset", "slime", "--out", tmp_path / "f.parquet")
    ) == (f"Error: {dump} line 3: field 'loss_mask' has 4 values for 5 completion tokens.")


def test_a_slime_train_stage_dump_keeps_old_and_ref(scored, tmp_path):
    records = [
        {"tokens": p + r, "response_lengths": len(r), "loss_masks": m, "rollout_log_probs": lp,
         "log_probs": [v - 0.125 for v in lp], "ref_log_probs": [v - 0.5 for v in lp]}
        for (p, r), m, lp in zip(SEQUENCES, RESPONSE_MASKS, scored["logprobs"], strict=True)
    ]  # fmt: skip
    dump = _write(tmp_path / "train.jsonl", records)
    fixture = _ingest(dump, "slime-train", tmp_path / "f.parquet")
    assert set(fixture.channels) == {"rollout", "old", "ref"}
    for channel, key in (("old", "log_probs"), ("ref", "ref_log_probs")):
        dumped = np.array([v for r in records for v in r[key]], dtype=np.float32)
        assert np.array_equal(fixture.channels[channel], dumped)


# -- generic -----------------------------------------------------------------------------


def generic_rollout_stage(logprobs) -> list[dict]:
    return [
        {"prompt_ids": p, "response_ids": r, "rollout_log_probs": lp}
        for (p, r), lp in zip(SEQUENCES, logprobs, strict=True)
    ]


def test_a_generic_rollout_stage_dump_replays_and_compares(scored, tiny_model, tmp_path):
    dump = _write(tmp_path / "generic.jsonl", generic_rollout_stage(scored["logprobs"]))
    fixture, report = _ingest_replay_compare(dump, "generic", tiny_model, tmp_path)
    assert set(fixture.channels) == {"rollout"}
    assert fixture.completion_mask.all() and fixture.weight_versions is None
    assert report["verdict"] == "pass"
    assert report["metrics"]["tokens"] == 15
    assert report["metrics"]["max_abs_diff"] < 1e-5  # measured: 0.0


def test_a_generic_trainer_stage_dump_keeps_its_channels_and_mask(scored, tmp_path):
    records = generic_rollout_stage(scored["logprobs"])
    for record, mask in zip(records, RESPONSE_MASKS, strict=True):
        record["loss_mask"] = mask
        record["old_log_probs"] = [v - 0.25 for v in record["rollout_log_probs"]]
        record["ref_log_probs"] = [v - 0.5 for v in record["rollout_log_probs"]]
        record["weight_version"] = 4
    fixture = _ingest(_write(tmp_path / "g.jsonl", records), "generic", tmp_path / "f.parquet")
    assert set(fixture.channels) == {"rollout", "old", "ref"}
    dumped = np.array([v for r in records for v in r["ref_log_probs"]], dtype=np.float32)
    assert np.array_equal(fixture.channels["ref"], dumped)
    assert fixture.completion_mask.tolist() == [bool(v) for m in RESPONSE_MASKS for v in m]
    assert fixture.weight_versions.tolist() == ["4"] * 15


def test_a_malformed_generic_loss_mask_is_one_line_naming_the_line(scored, tmp_path):
    records = generic_rollout_stage(scored["logprobs"])
    records[1]["loss_mask"] = [1, 1, 1, 1, 1, -1]
    dump = _write(tmp_path / "g.jsonl", records)
    assert _error(run_lpx("ingest", dump, "--out", tmp_path / "f.parquet")) == (
        f"Error: {dump} line 2: field 'loss_mask' is a mask: it must hold true/false or 1/0."
    )


# -- helpers -----------------------------------------------------------------------------


def _ingest_replay_compare(dump, preset, model, root):
    """The fixture `lpx ingest` wrote, and the report of `lpx compare` against its HF fp32
    replay (`lpx replay`), each run as a user runs it."""
    _ingest(dump, preset, root / "fixture.parquet", "--model", model, "--dtype", "fp32")
    _ok(run_lpx("replay", root / "fixture.parquet", "--engine", "hf", "--dtype", "fp32",
                "--out", root / "replay.parquet"))  # fmt: skip
    compared = run_lpx("compare", root / "fixture.parquet", root / "replay.parquet",
                       "--out", root / "compare")  # fmt: skip
    assert compared.exit_code == 0, compared.output
    return read_table(root / "fixture.parquet"), read_report(root / "compare")


def _ingest(dump, preset, out, *extra):
    _ok(run_lpx("ingest", dump, "--preset", preset, "--out", out, *extra))
    return read_table(out, expect_kind="fixture")


def _write(path, records):
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def _ok(result):
    assert result.exit_code == 0, result.output


def _error(result) -> str:
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    (line,) = [line for line in result.output.splitlines() if line.startswith("Error:")]
    return line
