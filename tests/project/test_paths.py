"""Names never become paths unchecked, and an output never replaces an input (issue 8)."""

import shutil

import pytest

from support.helpers import run_lpx


def sweep(model, tmp_path, *settings):
    """`lpx sweep` with hf on one prompt; each setting is a --setting value."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hello\n")
    pairs = [arg for setting in settings for arg in ("--setting", setting)]
    return run_lpx(
        "sweep",
        "--engine",
        "hf",
        "--model",
        model,
        "--prompts",
        prompts,
        "--out",
        tmp_path / "sweep",
        *pairs,
    )


@pytest.mark.parametrize("name", ["../x", "..", "a/b", "/abs", ".hidden", "x y", "a..b"])
def test_a_sweep_setting_name_is_never_a_path(name, tiny_model, tmp_path):
    result = sweep(tiny_model, tmp_path, "base:", f"{name}:batch_size=1")
    assert result.exit_code == 2 and "--setting name" in result.output, result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prompts.txt"]


def test_sweep_setting_names_must_differ(tiny_model, tmp_path):
    result = sweep(tiny_model, tmp_path, "a:", "a:batch_size=1")
    assert result.exit_code == 2 and "a given more than once" in result.output


def test_outputs_never_replace_inputs(run_dir, tiny_model, tmp_path):
    fixture = shutil.copy(run_dir / "fixture.parquet", tmp_path / "fixture.parquet")
    before = (tmp_path / "fixture.parquet").read_bytes()
    dump = tmp_path / "d.jsonl"
    dump.write_text('{"prompt_ids": [1, 2], "response_ids": [3], "rollout_log_probs": [-0.5]}\n')
    compare_out = tmp_path / "cmp"
    compare_out.mkdir()
    replay_inside = shutil.copy(run_dir / "replay-float32.parquet", compare_out / "tokens.parquet")
    cases = [
        ("replay", fixture, "--model", tiny_model, "--out", fixture),
        ("inject", fixture, "--kind", "mask", "--sequence", "0-0", "--out", fixture),
        ("ingest", dump, "--model", tiny_model, "--engine-name", "vllm", "--out", dump),
        ("compare", fixture, replay_inside, "--out", compare_out),
    ]
    for command, *args in cases:
        result = run_lpx(command, *args)
        assert result.exit_code == 2, (command, result.output)
        # A dump is refused before that: it is not an lpx file (next test).
        assert ("is also an input" in result.output and "never replaces" in result.output) or (
            command == "ingest" and "not an lpx file" in result.output
        )
    assert (tmp_path / "fixture.parquet").read_bytes() == before
    assert dump.read_text().startswith('{"prompt_ids"')


def test_an_output_never_replaces_a_file_lpx_did_not_write(run_dir, tmp_path):
    """Found by the fuzz suite's long profile: `ingest a.jsonl --out b.jsonl` replaced the
    user's other dump. lpx replaces only files it wrote (Parquet with its header)."""
    dump = tmp_path / "d.jsonl"
    dump.write_text('{"prompt_ids": [1, 2], "response_ids": [3], "rollout_log_probs": [-0.5]}\n')
    theirs = tmp_path / "theirs.parquet"
    theirs.write_bytes(b"someone else's data")
    notes = tmp_path / "notes.jsonl"
    notes.write_text("keep me\n")
    for out in (theirs, notes):
        result = run_lpx("ingest", dump, "--out", out)
        assert result.exit_code == 2 and "is not an lpx file" in result.output
    assert theirs.read_bytes() == b"someone else's data" and notes.read_text() == "keep me\n"
    ours = shutil.copy(run_dir / "fixture.parquet", tmp_path / "ours.parquet")
    assert run_lpx("ingest", dump, "--out", ours).exit_code == 0  # an lpx file: replaced


def test_an_output_under_a_file_is_one_line(tmp_path):
    """Found by the fuzz suite's long profile: `report --out FILE/x` was a NotADirectoryError."""
    from datetime import datetime

    from support.synthetic_runs import pair_report, write_run

    (tmp_path / "afile").write_text("x")
    run = write_run(tmp_path / "run", {"c": pair_report()}, started_at=datetime(2026, 1, 1))
    assert run_lpx("record", run, "--db", tmp_path / "h.db").exit_code == 0  # a history to show
    result = run_lpx("report", "--db", tmp_path / "h.db", "--out", tmp_path / "afile" / "site")
    assert result.exit_code == 2 and "Not a directory" in result.output
    assert len(result.output.strip().splitlines()) == 1 and (tmp_path / "afile").read_text() == "x"


@pytest.mark.parametrize(
    "command, args, named",
    [
        ("rollout", ["--max-tokens", "0"], "--max-tokens"),
        ("rollout", ["--max-tokens", "-1"], "--max-tokens"),
        ("rollout", ["-n", "0"], "--samples-per-prompt"),
        ("rollout", ["--temperature", "-1"], "--temperature"),
        ("rollout", ["--temperature", "nan"], "--temperature"),
        ("rollout", ["--temperature", "inf"], "--temperature"),
        ("rollout", ["--top-p", "0"], "--top-p"),
        ("rollout", ["--top-p", "nan"], "--top-p"),
        ("rollout", ["--top-k", "-1"], "--top-k"),
        ("rollout", ["--set", "batch_size=0"], "batch_size"),
        ("replay", ["--set", "micro_batch_size=0"], "micro_batch_size"),
        ("replay", ["--set", "top_k=-1"], "top_k"),
        ("replay", ["--set", "top_p=nan"], "top_p"),
        ("replay", ["--temperature", "0"], "--temperature"),
        ("replay", ["--micro-batch-size", "0"], "--micro-batch-size"),
    ],
)
def test_nonsense_options_are_refused_before_any_work(
    command, args, named, run_dir, tiny_model, tmp_path
):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hello\n")
    common = {
        "rollout": ["--model", tiny_model, "--prompts", prompts, "--out", tmp_path / "f.parquet"],
        "replay": [
            run_dir / "fixture.parquet",
            "--model",
            tiny_model,
            "--out",
            tmp_path / "r.parquet",
        ],
    }[command]
    result = run_lpx(command, *common, *args)
    assert result.exit_code == 2, result.output
    assert named in result.output and "Traceback" not in result.output
    assert not (tmp_path / "f.parquet").exists() and not (tmp_path / "r.parquet").exists()


@pytest.mark.parametrize(
    "line, expected",
    [
        ("null", "got null"),
        ("5", "got int"),
        ("[1, 2]", "got list"),
        ('"text"', "got str"),
        ('{"prompt_ids": "12", "response_ids": [3], "rollout_log_probs": [-1]}', "list of integer"),
        (
            '{"prompt_ids": [1], "response_ids": [3], "rollout_log_probs": ["x"]}',
            "must hold numbers",
        ),
        ('{"prompt_ids": [1], "response_ids": [3]}', "no field"),
        (
            '{"prompt_ids": [1], "response_ids": [4294967296], "rollout_log_probs": [-1]}',
            "would wrap",
        ),
        ('{"prompt_ids": [-1], "response_ids": [3], "rollout_log_probs": [-1]}', "outside [0,"),
        ('{"prompt_ids": [1], "response_ids": [3], "rollout_log_probs": [-1e39]}', "overflows"),
        ('{"prompt_ids": [1], "response_ids": [3], "rollout_log_probs": [true]}', "numbers"),
        ('{"prompt_ids": [1], "response_ids": [3], "rollout_log_probs": [-Infinity]}', "-inf"),
        ('{"prompt_ids": [1], "response_ids": [3.0], "rollout_log_probs": [-1]}', "integer"),
    ],
)
def test_hostile_dump_lines_are_one_line_errors_naming_the_line(
    line, expected, tiny_model, tmp_path
):
    _ingest_refuses(line, expected, tiny_model, tmp_path)


@pytest.mark.parametrize(
    "extra, expected",
    [
        (["--field", "mask=m"], "is a mask"),
        (["--field", "sequence_id=sid"], "sequence id) must be a string"),
        (["--preset", "slime", "--field", "response_length=n"], "does not fit"),
    ],
)
def test_hostile_mask_ids_and_lengths_are_refused(extra, expected, tiny_model, tmp_path):
    line = (
        '{"prompt_ids": [1], "response_ids": [3, 4], "rollout_log_probs": [-1, -2], '
        '"m": [1, 2], "sid": [1], "tokens": [1, 3, 4], "n": "2", "loss_mask": [1, 1], '
        '"weight_versions": 1}'
    )
    _ingest_refuses(line, expected, tiny_model, tmp_path, *extra)


def _ingest_refuses(line, expected, tiny_model, tmp_path, *extra):
    dump = tmp_path / "d.jsonl"
    dump.write_text(line + "\n")
    result = run_lpx(
        "ingest",
        dump,
        "--model",
        tiny_model,
        "--engine-name",
        "vllm",
        "--out",
        tmp_path / "f.parquet",
        *extra,
    )
    assert result.exit_code == 2, result.output
    # Lines are sequences (named by line number unless a sequence_id field is mapped).
    named = f"{dump} line 1" in result.output or f"{dump}: sequence '1'" in result.output
    assert named and expected in result.output, result.output
    assert "TypeError" not in result.output and not (tmp_path / "f.parquet").exists()


def test_a_full_disk_names_the_file_and_leaves_no_debris(tiny_model, small_volume):
    volume = small_volume(64)
    out = volume / "fixture.parquet"
    prompts = volume.parent / "prompts.txt"
    prompts.write_text("hello there\nanother prompt\n")
    args = ["--model", tiny_model, "--prompts", prompts, "--max-tokens", "200", "-n", "16"]
    result = run_lpx("rollout", "--engine", "hf", *args, "--out", out)
    assert result.exit_code == 2
    assert f"{out}: " in result.output and "No space left on device" in result.output
    assert "free space on its volume" in result.output and "Traceback" not in result.output
    assert list(volume.iterdir()) == []  # no half-written fixture, no temp file
