"""One plug-in table (pipeline/plugins.py) for every entry-point group, equal to what
pyproject.toml registers, each built-in pointing at a real object, and a registered name
winning over a built-in one."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest

from pipeline import plugins

ROOT = Path(__file__).resolve().parents[2]


def _declared() -> dict[str, dict[str, str]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return project["entry-points"]


def test_the_builtin_table_is_what_pyproject_registers():
    declared = _declared()
    assert sorted(declared) == sorted(plugins.BUILTIN)
    for group, table in plugins.BUILTIN.items():
        assert declared[group] == table, group
    assert "logprob-server" in plugins.BUILTIN[plugins.SCORING]  # the one that had drifted


@pytest.mark.parametrize("group", sorted(plugins.BUILTIN))
def test_every_builtin_names_an_object_its_module_defines(group):
    """Read from the source, so no engine is imported to check it."""
    for name, where in plugins.BUILTIN[group].items():
        module, _, attribute = where.partition(":")
        path = ROOT / Path(*module.split(".")).with_suffix(".py")
        assert path.is_file(), (group, name, path)
        tree = ast.parse(path.read_text(encoding="utf-8"))
        defined = {
            node.name
            for node in tree.body
            if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        }
        assert attribute in defined, (group, name, where)


def test_names_and_load_cover_builtins_and_unknowns():
    assert plugins.names(plugins.ROLLOUT) == ["hf", "http", "sglang", "vllm"]
    assert plugins.load(plugins.SCORING, "no-such-engine") is None
    from pipeline.engines.hf.replay import HFScoringEngine

    assert plugins.load(plugins.SCORING, "hf") is HFScoringEngine


def test_each_builtin_engine_lives_in_its_own_folder():
    """Adding an engine is one folder: every built-in rollout and scoring adapter of an engine
    sits under pipeline/engines/<engine>/ (a dash in the name is an underscore there)."""
    for group in (plugins.ROLLOUT, plugins.SCORING):
        for name, where in plugins.BUILTIN[group].items():
            module = where.partition(":")[0]
            assert module.startswith(f"pipeline.engines.{name.replace('-', '_')}."), (name, where)
    folders = {p.name for p in (ROOT / "pipeline" / "engines").iterdir() if p.is_dir()} - {
        "__pycache__"
    }
    engines = set(plugins.BUILTIN[plugins.ROLLOUT]) | set(plugins.BUILTIN[plugins.SCORING])
    assert folders == {name.replace("-", "_") for name in engines}
