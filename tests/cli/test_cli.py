"""The command line as users meet it: help with examples, the smoke, clean errors."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.cli import cli
from support.cpu import has_avx512
from support.helpers import read_report, run_lpx

ROOT = Path(__file__).resolve().parents[2]

COMMANDS = [
    [],
    ["make-model"],
    ["rollout"],
    ["replay"],
    ["compare"],
    ["sweep"],
    ["fixture", "show"],
    ["ingest"],
    ["inject"],
    ["smoke"],
    ["record"],
    ["report"],
    ["history"],
    ["gate"],
    ["ack"],
    ["annotate"],
    ["weights"],
    ["weights", "publish"],
    ["weights", "pull"],
    ["weights", "ls"],
    ["weights", "hot-load"],
]


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c) or "lpx")
def test_every_help_shows_an_example(command):
    result = run_lpx(*command, "--help")
    assert result.exit_code == 0
    assert "Example" in result.output and "lpx " in result.output.split("Example", 1)[1]


def test_every_command_is_listed_in_the_readme():
    readme = (__import__("pathlib").Path(__file__).parents[2] / "README.md").read_text()
    for name in cli.commands:
        assert f"lpx {name}" in readme, name


def test_ci_runs_exactly_the_readme_test_command():
    lines = readme_quickstart_lines()
    assert len(lines) == 2
    ci = [
        line
        for line in (ROOT / ".ci" / "run").read_text().splitlines()
        if line and not line.startswith(("#", "set ", "cd "))
    ]
    assert ci == [lines[1]]


def readme_quickstart_lines() -> list[str]:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    block = readme.split("## Quickstart", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    return [line for line in block.strip().splitlines() if line.strip()]


def test_smoke_end_to_end_as_a_user_runs_it(tmp_path):
    """The README's first line as written (`./scripts/setup && .venv/bin/lpx smoke --out
    runs/smoke`), and what the README and compare.md quote of its output. It runs in a folder
    of its own that holds the checkout's scripts, pyproject.toml and .venv (setup is then the
    no-op it is on a machine already set up), so its runs/ is not the checkout's."""
    for name in ("scripts", "pyproject.toml", ".venv"):
        (tmp_path / name).symlink_to(ROOT / name)
    first = readme_quickstart_lines()[0]
    assert first == "./scripts/setup && .venv/bin/lpx smoke --out runs/smoke"
    out = tmp_path / "runs" / "smoke"
    result = subprocess.run(
        ["bash", "-c", first],
        capture_output=True,
        text=True,
        env={**os.environ, "CI": "true"},
        timeout=600,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "smoke: PASS" in result.stdout
    assert "\r" not in result.stderr  # no progress bars in CI logs
    verdicts = json.loads((out / "smoke.json").read_text())
    assert {d: v["verdict"] for d, v in verdicts.items()} == {"float32": "pass", "bfloat16": "pass"}
    for dtype in ("float32", "bfloat16"):
        compare_dir = out / f"compare-hf-{dtype}"
        report = read_report(compare_dir)
        assert set(report) >= {
            "verdict",
            "metrics",
            "sequences",
            "worst",
            "diagnosis",
            "policy",
            "metadata",
        }
        assert len(report["sequences"]) == 16 and len(report["worst"]) == 20
        assert report["sequence_table"] == {"file": "sequences.parquet", "rows": 16}
        assert report["metadata"]["replay"]["knobs"]["dtype"] == dtype
        assert (compare_dir / "tokens.parquet").stat().st_size > 0
        assert "# lpx compare: PASS" in (compare_dir / "summary.md").read_text()
    fp32 = json.loads((out / "compare-hf-float32" / "report.json").read_text())
    assert fp32["metrics"]["max_abs_diff"] < 1e-5
    assert_quote_is_what_it_printed(readme_smoke_quote(), result.stdout.splitlines())
    for label, dtype in (("HF fp32 replay", "float32"), ("HF bf16 replay", "bfloat16")):
        metrics = read_report(out / f"compare-hf-{dtype}")["metrics"]
        assert_nemo_row_is_what_it_measured(compare_md_nemo_row(label), metrics)


# The README quotes the smoke's output, and compare.md its NeMo-RL statistics. The tiny model
# is deterministic, but its drift is not the same bits everywhere: fp32's order of reduction
# follows the OpenMP thread count (max |d| 3.58e-06 at one thread, 5.48e-06 at two, same AMD
# EPYC; mean |d| 2.47e-07 and 2.58e-07) and bf16's kernels the CPU (max |d| 0.0701 on an
# Intel Xeon, 0.0761 on an AMD EPYC). So the drift figures are held within a factor (2 for
# maxima, k3 and exp(|d|) - 1; 25 % for mean |d|) and the fraction of tokens above 1.1
# within 2 of 512 tokens; every other word and number of the quote is what the smoke prints.
WITHIN = {"max|d|": 2.0, "mean|d|": 1.25, "k3": 2.0}
DRIFT = re.compile(r"(max\|d\||mean\|d\||k3) (\S+)")


def test_the_quote_check_allows_the_drift_figures_a_factor_and_nothing_else():
    quote = ["hf vs hf float32   PASS  max|d| 5.48e-06  mean|d| 2.58e-07  k3 1.9e-13", "a -> .../x"]
    same = ["hf vs hf float32   PASS  max|d| 3.58e-06  mean|d| 2.47e-07  k3 1.7e-13", "a -> /t/x"]
    assert_quote_is_what_it_printed(quote, same)
    for wrong in (
        ["hf vs hf float32   PASS  max|d| 1.2e-05  mean|d| 2.58e-07  k3 1.9e-13", "a -> /t/x"],
        ["hf vs hf float32   PASS  max|d| 5.48e-06  mean|d| 3.3e-07  k3 1.9e-13", "a -> /t/x"],
        ["hf vs hf float32   FAIL  max|d| 5.48e-06  mean|d| 2.58e-07  k3 1.9e-13", "a -> /t/x"],
        ["hf vs hf float32   PASS  max|d| 5.48e-06  mean|d| 2.58e-07  k3 1.9e-13", "b -> /t/x"],
    ):
        with pytest.raises(AssertionError):
            assert_quote_is_what_it_printed(quote, wrong)


def readme_smoke_quote() -> list[str]:
    """The README's quote of the smoke; on a CPU without AVX-512, its bf16 line as the README
    gives it for AVX2-only CPUs (torch's bf16 kernels round otherwise there)."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    quote = readme.split("**The first line**", 1)[1].split("```\n", 2)[1].splitlines()
    if not has_avx512():
        avx2 = readme.split("AVX2 only", 1)[1].split("`", 2)[1]
        quote = [avx2 if line.startswith("hf vs hf bfloat16") else line for line in quote]
    return quote


def assert_quote_is_what_it_printed(quote: list[str], printed: list[str]) -> None:
    """Line by line: the quote's text exactly (whitespace aside, `...` eliding), its drift
    figures within WITHIN of what was printed."""
    assert len(quote) == len(printed), (quote, printed)
    for quoted, line in zip(quote, printed, strict=True):
        pattern = ""
        for part in re.split(r"(\.\.\.|(?:max\|d\||mean\|d\||k3) \S+)", " ".join(quoted.split())):
            drift = DRIFT.fullmatch(part)
            if part == "...":
                pattern += ".*?"
            elif drift:
                pattern += re.escape(drift[1]) + r" (\S+)"
            else:
                pattern += re.escape(part)
        found = re.fullmatch(pattern, " ".join(line.split()))
        assert found, f"README quotes {quoted!r}; the smoke printed {line!r}"
        for (name, figure), value in zip(DRIFT.findall(quoted), found.groups(), strict=True):
            assert within(float(figure), float(value), WITHIN[name]), (name, figure, value, line)


def compare_md_nemo_row(label: str) -> list[float]:
    text = (ROOT / "docs" / "compare.md").read_text(encoding="utf-8")
    section = text.split("### NeMo-RL's gates", 1)[1].split("\n#", 1)[0]
    row = next(line for line in section.splitlines() if line.startswith(f"| {label} |"))
    return [float(cell) for cell in row.strip("|").split("|")[1:]]


def assert_nemo_row_is_what_it_measured(row: list[float], metrics: dict) -> None:
    mean, median, trimmed, above = row
    for quoted, name in (
        (mean, "token_mult_prob_error"),
        (median, "token_mult_prob_error_median"),
        (trimmed, "token_mult_prob_error_trimmed_mean"),
    ):
        assert within(quoted - 1, metrics[name] - 1, 2.0), (name, quoted, metrics[name])
    assert abs(above - metrics["token_mult_prob_error_frac_above_1_1"]) <= 2 / 512


def within(quoted: float, measured: float, factor: float) -> bool:
    if quoted == measured:
        return True
    low, high = sorted((abs(quoted), abs(measured)))
    return low > 0 and (quoted > 0) == (measured > 0) and high / low <= factor


def test_bad_input_is_one_line_without_traceback(tmp_path):
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"PAR1 not really")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipeline",
            "compare",
            str(broken),
            str(broken),
            "--out",
            str(tmp_path / "o"),
        ],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().startswith("Error: ") and str(broken) in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_unknown_engine_and_knob_are_clear(run_dir, tmp_path):
    result = run_lpx(
        "replay", run_dir / "fixture.parquet", "--engine", "nope", "--out", tmp_path / "r.parquet"
    )
    assert result.exit_code == 2
    assert (
        "Invalid value for '--engine': 'nope' is not one of 'deepspeed', 'fsdp', 'hf', "
        "'logprob-server', 'megatron', 'sglang', 'vllm'." in result.output
    )
    result = run_lpx(
        "replay",
        run_dir / "fixture.parquet",
        "--set",
        "padding=left",
        "--out",
        tmp_path / "r.parquet",
    )
    assert result.exit_code == 2 and "unknown hf replay knob(s) padding" in result.output


def test_missing_engine_package_names_the_extra(monkeypatch):
    from pipeline import engines, names, plugins
    from pipeline.errors import EngineNotInstalled

    monkeypatch.setitem(
        plugins.BUILTIN[plugins.SCORING], "absent", "pipeline.engines.absent_adapter:X"
    )
    monkeypatch.setitem(names.EXTRA_FOR_ENGINE, "absent", "absent-extra")
    with pytest.raises(EngineNotInstalled, match=r"pip install -e '\.\[absent-extra\]'"):
        engines.scoring_engine("absent")


def test_policy_file_errors_and_custom_limits(run_dir, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("version: 1\nprofiles: [1, 2\n")
    result = run_lpx(
        "compare",
        run_dir / "fixture.parquet",
        run_dir / "replay-float32.parquet",
        "--policy",
        bad,
        "--out",
        tmp_path / "o",
    )
    assert result.exit_code == 2 and f"{bad} line" in result.output
    strict = tmp_path / "strict.yaml"
    strict.write_text(
        "version: 1\nprofiles:\n  float32:\n    tau: 1.0e-9\n    limits: {max_abs_diff: 1.0e-9}\n"
    )
    result = run_lpx(
        "compare",
        run_dir / "fixture.parquet",
        run_dir / "replay-float32.parquet",
        "--policy",
        strict,
        "--out",
        tmp_path / "o",
    )
    assert result.exit_code == 1 and "max_abs_diff" in result.output


def test_fixture_show_lists_and_details(run_dir):
    result = run_lpx("fixture", "show", run_dir / "fixture.parquet")
    assert result.exit_code == 0
    assert "sequences  16, completion tokens 384" in result.output
    assert "channels   rollout, rollout_processed" in result.output
    result = run_lpx("fixture", "show", run_dir / "fixture.parquet", "--sequence", "0-0")
    assert result.exit_code == 0
    token_rows = [
        line.split()
        for line in result.output.splitlines()
        if line.startswith("  ") and line.split()[0].isdigit()
    ]
    assert [int(row[0]) for row in token_rows] == list(range(24))
    assert all(row[3] == row[4] for row in token_rows)  # raw == processed at temperature 1


def test_rollout_and_replay_commands_write_files(tiny_model, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt_ids": [1, 40, 41]}\n{"text": "The fox"}\nThe harbor\n')
    fixture = tmp_path / "fixture.parquet"
    result = run_lpx(
        "rollout",
        "--model",
        tiny_model,
        "--prompts",
        prompts,
        "--max-tokens",
        6,
        "--ignore-eos",
        "-n",
        2,
        "--out",
        fixture,
    )
    assert result.exit_code == 0, result.output
    assert "6 sequences, 36 completion tokens" in result.output
    replay = tmp_path / "replay.parquet"
    result = run_lpx("replay", fixture, "--dtype", "fp16", "--set", "packing=true", "--out", replay)
    assert result.exit_code == 0, result.output
    result = run_lpx("compare", fixture, replay, "--out", tmp_path / "cmp", "--quiet")
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "cmp" / "report.json").read_text())
    assert report["policy"]["profile"] == "float16"
    assert 0 < report["metrics"]["max_abs_diff"] < 0.05


@pytest.mark.parametrize("command", ["history", "gate", "report", "record"])
def test_the_history_database_comes_from_lpx_db_or_the_commands_own_variable(command, tmp_path):
    from datetime import datetime

    from support.synthetic_runs import pair_report, write_run

    run = write_run(tmp_path / "run", {"c": pair_report()}, started_at=datetime(2026, 1, 1))
    args = {"history": [], "gate": [], "report": ["--out", tmp_path / "site"], "record": [run]}
    shared, own = tmp_path / "shared.db", tmp_path / "own.db"
    env = {**os.environ, "CI": "true", "LPX_DB": str(shared)}
    command_line = [sys.executable, "-m", "pipeline", command, *map(str, args[command])]

    def used(path) -> bool:
        """record creates the database; the read-only commands refuse a missing one by
        name and create nothing (issue 22)."""
        done = subprocess.run(command_line, env=env, capture_output=True, text=True, cwd=tmp_path)
        if command == "record":
            return path.is_file()
        return f"no lpx history at {path}" in done.stderr and not path.exists()

    assert used(shared) and not own.exists()
    env[f"LPX_{command.upper()}_DB"] = str(own)  # the command's own variable wins
    assert used(own)


def test_smoke_never_builds_into_or_deletes_a_model_dir_it_did_not_create(tmp_path):
    checkpoint = tmp_path / "my-checkpoint"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text("{}")
    (checkpoint / "tokenizer.model").write_bytes(b"sentencepiece")
    mistyped = tmp_path / "no-such-model"
    for model in (checkpoint, mistyped):
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "pipeline",
                "smoke",
                "--out",
                tmp_path / "out",
                "--model",
                model,
                "--no-history",
            ],
            capture_output=True,
            text=True,
            env={**os.environ, "CI": "true"},
            cwd=tmp_path,
        )
        assert result.returncode == 2, result.stderr
        assert f"--model {model}" in result.stderr and "Traceback" not in result.stderr
    assert sorted(p.name for p in checkpoint.iterdir()) == ["config.json", "tokenizer.model"]
    assert not mistyped.exists() and not (tmp_path / "out").exists()


def test_the_cached_tiny_model_never_replaces_a_foreign_directory(tmp_path, monkeypatch):
    from pipeline.errors import BadInput
    from pipeline.flows.smoke import default_model_dir, ensure_tiny_model

    monkeypatch.setenv("LPX_CACHE", str(tmp_path))
    target = default_model_dir()
    target.mkdir(parents=True)
    (target / "notes.txt").write_text("mine")
    with pytest.raises(BadInput, match="not a model lpx built"):
        ensure_tiny_model(target)
    assert [p.name for p in target.iterdir()] == ["notes.txt"]


def _options(command, prefix="LPX"):
    for param in command.params:
        if isinstance(param, __import__("click").Option) and "--help" not in param.opts:
            yield prefix, param
    for name, sub in getattr(command, "commands", {}).items():
        yield from _options(sub, f"{prefix}_{name.upper().replace('-', '_')}")


def test_every_option_reads_lpx_command_option_as_the_readme_says():
    checked = 0
    for prefix, param in _options(cli):
        longs = [o for o in param.opts if o.startswith("--")]
        expected = f"{prefix}_{longs[0][2:].upper().replace('-', '_')}"
        names = param.envvar if isinstance(param.envvar, list) else [param.envvar]
        assert expected in names, (expected, names)
        checked += 1
    assert checked > 60


def test_lpx_compare_policy_applies_a_strict_policy(run_dir, tmp_path):
    strict = tmp_path / "strict.yaml"
    strict.write_text(
        "version: 1\nprofiles:\n  bfloat16:\n    tau: 0.1\n    limits: {max_abs_diff: 1.0e-9}\n"
    )
    args = [
        sys.executable,
        "-m",
        "pipeline",
        "compare",
        run_dir / "fixture.parquet",
        run_dir / "replay-bfloat16.parquet",
        "--out",
        tmp_path / "c",
        "--quiet",
    ]
    default = subprocess.run(args, capture_output=True, text=True, env={**os.environ, "CI": "true"})
    assert default.returncode == 0, default.stderr
    env = {**os.environ, "CI": "true", "LPX_COMPARE_POLICY": str(strict)}
    strict_run = subprocess.run(args, capture_output=True, text=True, env=env)
    assert strict_run.returncode == 1 and "FAIL" in strict_run.stdout


@pytest.mark.parametrize("sig, code", [(2, 130), (15, 143)])
def test_an_interrupted_command_exits_128_plus_the_signal_not_1(sig, code, tmp_path):
    import signal as signals
    import time

    process = subprocess.Popen(
        [sys.executable, "-m", "pipeline", "make-model", tmp_path / "model"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # a cached build is a copy that ends before the signal: build it, as a new user would
        env={**os.environ, "CI": "true", "LPX_MODEL_CACHE": "off"},
    )
    time.sleep(3)  # imports done, training under way (it takes several seconds)
    process.send_signal(signals.Signals(sig))
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == code, stderr
    assert (
        stderr.strip().splitlines()[-1].startswith("Interrupted (SIG") and "Traceback" not in stderr
    )
