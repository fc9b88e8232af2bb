import copy
import json

import numpy as np
import pyarrow.parquet as pq
import pytest

from pipeline.fixture.io import read_table, write_table
from pipeline.fixture.table import table_from_sequences
from support.helpers import run_lpx


def small_table(**overrides):
    args = dict(
        kind="fixture",
        sequence_ids=["a", "b"],
        prompts=[[1, 5, 6], [1, 7]],
        completions=[[8, 9, 10], [11]],
        channels={"rollout": [[-0.5, -1.0, -0.1], [-2.0]]},
        metadata={"dtype": "float32", "model": {"vocab_size": 32}},
    )
    args.update(overrides)
    return table_from_sequences(**args)


def test_round_trip_keeps_everything(tmp_path):
    table = small_table(weight_versions=[["3", "3", "4"], ["4"]], masks=[[1, 0, 1], [1]])
    table.channels["old"] = np.array([-0.4, -1.1, -0.2, -2.1], dtype=np.float32)
    path = write_table(table, tmp_path / "f.parquet")
    back = read_table(path)
    assert back.sequence_ids == ["a", "b"]
    assert back.prompt_ids.tolist() == [1, 5, 6, 1, 7]
    assert back.completion_offsets.tolist() == [0, 3, 4]
    assert back.completion_mask.tolist() == [True, False, True, True]
    assert back.channels["rollout"].tolist() == pytest.approx([-0.5, -1.0, -0.1, -2.0])
    assert back.channels["old"].dtype == np.float32
    assert back.weight_versions.tolist() == ["3", "3", "4", "4"]
    assert back.metadata == {"dtype": "float32", "model": {"vocab_size": 32}}


def test_pandas_style_readers_see_plain_columns(tmp_path):
    path = write_table(small_table(), tmp_path / "f.parquet")
    arrow = pq.read_table(path)
    assert arrow.column("completion_ids").to_pylist() == [[8, 9, 10], [11]]
    assert json.loads(arrow.schema.metadata[b"lpx"])["schema_version"] == 1


def _compare_exit(tmp_path, fixture, replay_path=None):
    """Write ``fixture``, compare it against a clean replay of itself; return the result."""
    path = write_table(fixture, tmp_path / "fixture.parquet")
    if replay_path is None:
        replay = copy.deepcopy(small_table())
        replay.kind = "replay"
        replay.channels = {"replay": replay.channels["rollout"].copy()}
        replay_path = write_table(replay, tmp_path / "replay.parquet")
    result = run_lpx("compare", path, replay_path, "--out", tmp_path / "cmp")
    return result, path


BAD_FIXTURES = {
    "nan_logprob": (
        dict(channels={"rollout": [[-0.5, float("nan"), -0.1], [-2.0]]}),
        "sequence 'a' position 1",
    ),
    "minus_inf_logprob": (
        dict(channels={"rollout": [[-0.5, -1.0, float("-inf")], [-2.0]]}),
        "sequence 'a' position 2 has logprobs 'rollout' = -inf",
    ),
    "positive_logprob": (
        dict(channels={"rollout": [[-0.5, -1.0, 0.5], [-2.0]]}),
        "sequence 'a' position 2",
    ),
    "token_outside_vocab": (
        dict(completions=[[8, 9, 10], [99]]),
        "sequence 'b' completion position 0 has token id 99",
    ),
    "duplicate_ids": (dict(sequence_ids=["a", "a"]), "sequence id 'a' appears more than once"),
    "empty_prompt": (dict(prompts=[[], [1, 7]]), "sequence 'a' has an empty prompt"),
}


@pytest.mark.parametrize("case", sorted(BAD_FIXTURES))
def test_bad_values_exit_2_naming_file_and_sequence(tmp_path, case):
    overrides, expected = BAD_FIXTURES[case]
    result, path = _compare_exit(tmp_path, small_table(**overrides))
    assert result.exit_code == 2
    assert str(path) in result.output and expected in result.output
    assert len(result.output.strip().splitlines()) == 1
    assert not (tmp_path / "cmp" / "report.json").exists()


def test_logprob_length_mismatch(tmp_path):
    import pyarrow as pa

    path = write_table(small_table(), tmp_path / "f.parquet")
    arrow = pq.read_table(path)
    column = pa.array([[-0.5, -1.0], [-2.0]], pa.list_(pa.float32()))
    arrow = arrow.set_column(
        arrow.schema.get_field_index("logprobs_rollout"), "logprobs_rollout", column
    )
    pq.write_table(arrow, path)
    result = run_lpx("fixture", "show", path)
    assert result.exit_code == 2
    assert "sequence 'a' has 2 logprobs 'rollout' values for 3 completion tokens" in result.output


def test_truncated_and_foreign_files(tmp_path):
    path = write_table(small_table(), tmp_path / "f.parquet")
    data = path.read_bytes()
    (tmp_path / "cut.parquet").write_bytes(data[: len(data) // 2])
    result = run_lpx("fixture", "show", tmp_path / "cut.parquet")
    assert result.exit_code == 2 and "truncated or corrupt" in result.output
    (tmp_path / "text.parquet").write_text("sequence_id,logprob\n")
    assert run_lpx("fixture", "show", tmp_path / "text.parquet").exit_code == 2
    pq.write_table(pq.read_table(path).replace_schema_metadata({}), tmp_path / "plain.parquet")
    result = run_lpx("fixture", "show", tmp_path / "plain.parquet")
    assert result.exit_code == 2 and "without lpx metadata" in result.output


def _rewrite_column(path, name, array):
    import pyarrow as pa

    arrow = pq.read_table(path)
    lists = pa.ListArray.from_arrays(arrow.column(name).combine_chunks().offsets, array)
    arrow = arrow.set_column(arrow.schema.get_field_index(name), name, lists)
    pq.write_table(arrow, path)  # keeps the lpx schema metadata


@pytest.mark.parametrize(
    "column, values, expected",
    [
        (
            "completion_ids",
            [8.0, 9.5, 10.0, 11.0],
            "holds double values; token ids must be integers",
        ),
        (
            "completion_ids",
            [8, 2**31, 10, 11],
            "sequence 'a' position 1: completion_ids holds 2147483648",
        ),
        ("prompt_ids", [1, 5, -3, 1, 7], "sequence 'a' position 2: prompt_ids holds -3"),
        ("completion_mask", [1, 2, 1, 1], "sequence 'a' position 1: completion_mask is 2"),
        ("completion_mask", ["y", "n", "y", "y"], "holds string values; it must be boolean"),
        ("logprobs_rollout", [-0.5, -1e39, -0.1, -2.0], "-1e+39, which overflows float32"),
        ("logprobs_rollout", ["-0.5", "-1", "-0.1", "-2"], "logprobs are floats"),
    ],
)
def test_parquet_columns_of_the_wrong_type_are_refused_not_wrapped(
    tmp_path, column, values, expected
):
    """Another tool's fixture with float or int64 token ids, or float64 logprobs beyond
    float32, was silently cast (9.5 -> 9, 2^31 -> -2^31, -1e39 -> -inf)."""
    import pyarrow as pa

    path = write_table(small_table(), tmp_path / "f.parquet")
    _rewrite_column(path, column, pa.array(values))
    result = run_lpx("fixture", "show", path)
    assert result.exit_code == 2, result.output
    assert str(path) in result.output and expected in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1


def test_integer_masks_and_float64_logprobs_in_range_are_read(tmp_path):
    import pyarrow as pa

    path = write_table(small_table(), tmp_path / "f.parquet")
    _rewrite_column(path, "completion_mask", pa.array([1, 0, 1, 1], pa.int64()))
    _rewrite_column(path, "logprobs_rollout", pa.array([-0.5, -1.0, -0.1, -2.0], pa.float64()))
    back = read_table(path)
    assert back.completion_mask.tolist() == [True, False, True, True]
    assert back.channels["rollout"].dtype == np.float32


@pytest.mark.parametrize(
    "edit, expected",
    [
        (lambda h: h["metadata"]["model"].update(vocab_size="32"), "metadata.model.vocab_size"),
        (lambda h: h["metadata"].update(model="tiny"), "metadata.model"),
        (lambda h: h["metadata"].update(dtype=32), "metadata.dtype"),
        (lambda h: h["metadata"].update(dtype="float8"), "metadata.dtype"),
        (
            lambda h: h["metadata"].update(engine={"versions": {"vllm": 11}}),
            "metadata.engine.versions.vllm",
        ),
        (lambda h: h.update(metadata=[]), "metadata"),
        (lambda h: h.update(top_k=-1), "top_k"),
        (lambda h: h.update(kind=None), "kind"),
        (lambda h: h.update(schema_version=True), "schema_version True is not supported"),
    ],
)
def test_header_fields_of_the_wrong_type_are_named(tmp_path, edit, expected):
    """Metadata of the wrong type ended in `TypeError ... (an engine or library failed)`."""
    path = write_table(small_table(), tmp_path / "f.parquet")
    arrow = pq.read_table(path)
    header = json.loads(arrow.schema.metadata[b"lpx"])
    edit(header)
    pq.write_table(arrow.replace_schema_metadata({b"lpx": json.dumps(header)}), path)
    for args in (("fixture", "show", path), ("compare", path, path, "--out", tmp_path / "c")):
        result = run_lpx(*args)
        assert result.exit_code == 2, result.output
        assert str(path) in result.output and expected in result.output, result.output
        assert "TypeError" not in result.output and len(result.output.strip().splitlines()) == 1


def test_unknown_schema_version(tmp_path):
    path = write_table(small_table(), tmp_path / "f.parquet")
    arrow = pq.read_table(path)
    header = json.loads(arrow.schema.metadata[b"lpx"])
    header["schema_version"] = 7
    pq.write_table(arrow.replace_schema_metadata({b"lpx": json.dumps(header)}), path)
    result = run_lpx("fixture", "show", path)
    assert result.exit_code == 2
    assert "schema_version 7 is not supported" in result.output and str(path) in result.output


def test_sequence_missing_on_one_side(tmp_path):
    replay = small_table(sequence_ids=["a", "c"])
    replay.kind = "replay"
    replay.channels = {"replay": replay.channels.pop("rollout")}
    replay_path = write_table(replay, tmp_path / "replay.parquet")
    result, _ = _compare_exit(tmp_path, small_table(), replay_path)
    assert result.exit_code == 2
    assert "1 sequence id(s)" in result.output and "'b'" in result.output


def test_replay_of_other_tokens_is_refused(tmp_path):
    replay = small_table(completions=[[8, 9, 12], [11]])
    replay.kind = "replay"
    replay.channels = {"replay": replay.channels.pop("rollout")}
    replay_path = write_table(replay, tmp_path / "replay.parquet")
    result, _ = _compare_exit(tmp_path, small_table(), replay_path)
    assert result.exit_code == 2
    assert (
        "sequence 'a' completion position 2 holds token 12 where the fixture has 10"
        in result.output
    )


def test_ingest_maps_framework_fields(tmp_path):
    dump = tmp_path / "dump.jsonl"
    rows = [
        {
            "uid": "x1",
            "prompt_ids": [1, 4],
            "response_ids": [5, 6],
            "rollout_log_probs": [-0.1, -0.2],
            "loss_mask": [1, 0],
            "weight_version": 7,
        },
        {
            "uid": "x2",
            "prompt_ids": [1],
            "response_ids": [9],
            "rollout_log_probs": [-1.5],
            "loss_mask": [1],
            "weight_version": 8,
        },
    ]
    dump.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out = tmp_path / "f.parquet"
    result = run_lpx(
        "ingest",
        dump,
        "--out",
        out,
        "--field",
        "sequence_id=uid",
        "--field",
        "mask=loss_mask",
        "--field",
        "weight_version=weight_version",
        "--engine-name",
        "vllm",
        "--dtype",
        "bf16",
    )
    assert result.exit_code == 0, result.output
    table = read_table(out)
    assert table.sequence_ids == ["x1", "x2"]
    assert table.completion_mask.tolist() == [True, False, True]
    assert table.weight_versions.tolist() == ["7", "7", "8"]
    assert table.metadata["dtype"] == "bfloat16"


def test_ingest_slime_preset_splits_tokens(tmp_path):
    dump = tmp_path / "slime.jsonl"
    dump.write_text(
        json.dumps(
            {
                "tokens": [1, 2, 3, 4, 5],
                "response_length": 2,
                "rollout_log_probs": [-0.1, -0.3],
                "loss_mask": [1, 1],
                "weight_versions": ["v1", "v2"],
            }
        )
        + "\n"
    )
    result = run_lpx("ingest", dump, "--preset", "slime", "--out", tmp_path / "f.parquet")
    assert result.exit_code == 0, result.output
    table = read_table(tmp_path / "f.parquet")
    assert table.prompt_ids.tolist() == [1, 2, 3] and table.completion_ids.tolist() == [4, 5]
    assert table.weight_versions.tolist() == ["v1", "v2"]


def test_ingest_errors_name_the_line(tmp_path):
    dump = tmp_path / "dump.jsonl"
    dump.write_text(
        json.dumps({"prompt_ids": [1], "response_ids": [5, 6], "rollout_log_probs": [-0.1]})
        + "\n{oops\n"
    )
    result = run_lpx("ingest", dump, "--out", tmp_path / "f.parquet")
    assert result.exit_code == 2
    assert (
        f"{dump} line 1: field 'rollout_log_probs' has 1 values for 2 completion tokens"
        in result.output
    )
    assert not (tmp_path / "f.parquet").exists()


def test_comparing_nothing_is_never_a_pass(run_dir, tmp_path):
    from pipeline.fixture.io import read_table, write_table
    from support.helpers import run_lpx

    fixture = read_table(run_dir / "fixture.parquet", expect_kind="fixture")
    fixture.completion_mask[:] = False  # every token masked out
    masked = write_table(fixture, tmp_path / "masked.parquet")
    result = run_lpx("compare", masked, run_dir / "replay-float32.parquet", "--out", tmp_path / "c")
    assert result.exit_code == 2
    assert "no active completion tokens" in result.output and "never a pass" in result.output
    assert not (tmp_path / "c").exists()


def test_a_sequence_id_cannot_inject_markdown_into_the_summary(run_dir, tmp_path):
    """Nor clear or recolour the terminal (ESC) or reverse the text after it (U+202E)."""
    from pipeline.fixture.io import read_table, write_table
    from support.helpers import run_lpx

    hostile = "0-0\n# PASS <script>alert(1)</script> | **bold** \x1b[2J\u202e"
    paths = {}
    for name in ("fixture", "replay-bfloat16"):
        table = read_table(run_dir / f"{name}.parquet")
        table.sequence_ids = [hostile if s == "0-1" else s for s in table.sequence_ids]
        paths[name] = write_table(table, tmp_path / f"{name}.parquet")
    result = run_lpx("compare", paths["fixture"], paths["replay-bfloat16"], "--out", tmp_path / "c")
    summary = (tmp_path / "c" / "summary.md").read_text()
    assert "\n# PASS" not in summary and "<script>" not in summary and "**bold**" not in summary
    escaped = r"0-0\x0a\# PASS \<script\>alert(1)\</script\> \| \*\*bold\*\* \x1b\[2J\u202e"
    assert escaped in summary
    for shown in (result.output, run_lpx("fixture", "show", paths["fixture"]).output):
        assert "\x1b" not in shown and "\u202e" not in shown and "\\x1b" in shown


def test_a_failed_rewrite_never_leaves_the_old_verdict_beside_new_files(
    run_dir, tmp_path, monkeypatch
):
    import pipeline.compare.outputs as outputs
    from pipeline.compare.run import compare_files

    out = tmp_path / "out"
    outputs.write_outputs(
        compare_files(run_dir / "fixture.parquet", run_dir / "replay-float32.parquet"), out
    )
    assert (out / "report.json").is_file()

    def crash(report):
        raise RuntimeError("disk full")

    monkeypatch.setattr(outputs, "render_summary", crash)
    again = compare_files(run_dir / "fixture.parquet", run_dir / "replay-bfloat16.parquet")
    with pytest.raises(RuntimeError):
        outputs.write_outputs(again, out)
    assert not (out / "report.json").exists()  # no stale PASS beside the new tokens
    assert [p.name for p in out.iterdir() if ".tmp-" in p.name] == []


def test_two_writers_into_one_out_directory_fail_clearly(run_dir, tmp_path):
    import subprocess
    import sys
    import time

    from support.helpers import run_lpx

    out = tmp_path / "out"
    out.mkdir()
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from filelock import FileLock; "
            "lock = FileLock(sys.argv[1]); lock.acquire(); print('held', flush=True); time.sleep(30)",
            str(out / ".lpx-lock"),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        result = run_lpx(
            "compare", run_dir / "fixture.parquet", run_dir / "replay-float32.parquet", "--out", out
        )
        assert result.exit_code == 2 and "another lpx process is writing" in result.output
        assert not (out / "report.json").exists()
    finally:
        holder.kill()
        holder.wait()
    time.sleep(0.1)
    assert (
        run_lpx(
            "compare",
            run_dir / "fixture.parquet",
            run_dir / "replay-float32.parquet",
            "--out",
            out,
            "--quiet",
        ).exit_code
        == 0
    )
