"""A launcher that refuses its arguments is reported by the one sentence that says why
(argparse's "error: ...", a traceback's last line, else its last line that is not usage
text), never by the usage text printed before it. The real SGLang server refusing an
argument is in test_engines_sglang.py."""

from __future__ import annotations

import stat
import sys

import pytest

from pipeline.engines.launch_failure import MAX_CHARS, launch_failure_reason
from support.helpers import run_lpx

USAGE = (
    "usage: sglang serve [-h] --model-path MODEL_PATH\n"
    "                    [--tokenizer-path TOKENIZER_PATH]\n"
    "                    [--attention-backend {triton,torch_native}]\n"
    "                    [--tool-call-parser {auto,llama3,qwen}]\n"
)


@pytest.mark.parametrize(
    "output, sentence",
    [
        ("$ python -m x --attention-backend nonsense\n# lpx: server pid 1\n"
         "x.py:53: UserWarning: Only CUDA supports AWQ.\n" + USAGE +
         "sglang serve: error: argument --attention-backend: invalid choice: 'nonsense' "
         "(choose from 'triton', 'torch_native')\n",
         "error: argument --attention-backend: invalid choice: 'nonsense' (choose from "
         "'triton', 'torch_native')"),
        (USAGE + "launch_server.py: error: unrecognized arguments: --no-such-flag\n",
         "error: unrecognized arguments: --no-such-flag"),
        ("Traceback (most recent call last):\n  File \"a.py\", line 1, in <module>\n"
         "    import sglang\nModuleNotFoundError: No module named 'sglang'\n",
         "ModuleNotFoundError: No module named 'sglang'"),
        ("loading\nTraceback (most recent call last):\n  File \"s.py\", line 9\n"
         "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n"
         "[2026-01-01 10:00:00] Received sigquit from a child process. It usually means the "
         "child failed.\n",
         "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"),
        ("$ launcher --flag\n" + USAGE + "\nthe model directory has no config.json\n"
         "/x/warnings.py:1: FutureWarning: soon\n",
         "the model directory has no config.json"),
        (USAGE, "usage: sglang serve [-h] --model-path MODEL_PATH"),
        ("", ""),
    ],
)  # fmt: skip
def test_the_sentence_that_says_why_is_found_past_the_usage_text(output, sentence):
    assert launch_failure_reason(output) == sentence


def test_a_long_sentence_is_cut_at_its_limit():
    said = launch_failure_reason("p: error: invalid choice: 'x' (choose from " + "'a', " * 400)
    assert len(said) == MAX_CHARS and said.startswith("error: invalid choice: 'x'")
    assert said.endswith("...")


# Stands in for SGLang's interpreter: a real argparse parser with SGLang's habit of a long
# usage text, refusing an attention backend it does not know, as `sglang serve` does.
REFUSING_LAUNCHER = """#!{python}
import argparse, sys
parser = argparse.ArgumentParser(prog="sglang serve")
for i in range(80):
    parser.add_argument(f"--option-number-{{i}}", choices=["one", "two", "three"])
parser.add_argument("--attention-backend", choices=["triton", "torch_native"])
parser.parse_known_args(sys.argv[3:])
"""


def test_a_server_that_refuses_its_arguments_is_one_line_with_its_reason(tiny_model, tmp_path):
    launcher = tmp_path / "python"
    launcher.write_text(REFUSING_LAUNCHER.format(python=sys.executable))
    launcher.chmod(launcher.stat().st_mode | stat.S_IEXEC)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hello\n")
    result = run_lpx(
        "rollout", "--engine", "sglang", "--model", tiny_model, "--prompts", prompts,
        "--set", f"python={launcher}", "--set", "server_args=--attention-backend nonsense",
        "--out", tmp_path / "f.parquet",
    )  # fmt: skip
    assert result.exit_code == 2, result.output
    (line,) = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert line.startswith(
        "Error: SGLang's server exited (2) before it was ready: error: argument "
        "--attention-backend: invalid choice: 'nonsense' (choose from 'triton', 'torch_native') "
        "(its log: "
    )
    assert "usage:" not in result.output and "--option-number" not in result.output
    assert not (tmp_path / "f.parquet").exists()
