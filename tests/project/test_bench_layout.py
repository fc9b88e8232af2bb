"""bench/'s layout, read from the source (ast): every module imports the one bootstrap first
and none reaches into tests/ or edits sys.path itself; `lpx` runs only through the one
runner (bench/_commands.py); what tests and bench share lives in support/, never shipped."""

from __future__ import annotations

import ast
import tomllib
from itertools import pairwise
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
BOOTSTRAP, RUNNER = "_bootstrap", "_commands"


def _modules() -> dict[str, ast.Module]:
    return {path.stem: ast.parse(path.read_text(encoding="utf-8")) for path in BENCH.glob("*.py")}


def _imported(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom) and not node.level:
        return [node.module or ""]
    return []


def imports_of_tests(tree: ast.Module) -> list[str]:
    """Every import of tests/ (lazy ones in function bodies included)."""
    names = [name for node in ast.walk(tree) for name in _imported(node)]
    return [name for name in names if name == "tests" or name.startswith("tests.")]


def bootstrap_problem(tree: ast.Module) -> str | None:
    """Why the module's top-level imports do not start with the bootstrap, or None."""
    for node in tree.body:
        for name in _imported(node):
            if name == BOOTSTRAP:
                return None
            if name.split(".")[0] in ("pipeline", "support"):
                return f"imports {name} before {BOOTSTRAP}"
    return f"never imports {BOOTSTRAP}"


def sys_path_edits(tree: ast.Module) -> list[int]:
    """Lines that change sys.path (insert, append, ...)."""
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and ast.unparse(node.func.value) == "sys.path"
    ]


def lpx_launches(tree: ast.Module) -> list[int]:
    """Lines that build an `lpx` command line: `-m pipeline`, `pipeline.entry`, or the
    console script beside an interpreter."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.List | ast.Tuple):
            values = [e.value if isinstance(e, ast.Constant) else None for e in node.elts]
            if any(a == "-m" and b == "pipeline" for a, b in pairwise(values)):
                found.append(node.lineno)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if "pipeline.entry" in node.value:
                found.append(node.lineno)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr == "with_name" and any(
                isinstance(a, ast.Constant) and a.value == "lpx" for a in node.args
            ):
                found.append(node.lineno)
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            right, left = node.right, ast.unparse(node.left)
            if isinstance(right, ast.Constant) and right.value == "lpx":
                if "bin" in left or "executable" in left:
                    found.append(node.lineno)
    return found


@pytest.fixture(scope="module")
def modules() -> dict[str, ast.Module]:
    return _modules()


def test_no_bench_module_imports_tests(modules):
    found = {name: imports_of_tests(tree) for name, tree in modules.items()}
    assert {name: hits for name, hits in found.items() if hits} == {}


def test_every_bench_module_imports_the_bootstrap_first(modules):
    problems = {
        name: bootstrap_problem(tree) for name, tree in modules.items() if name != BOOTSTRAP
    }
    assert {name: why for name, why in problems.items() if why} == {}


def test_only_the_bootstrap_changes_sys_path(modules):
    edits = {name: sys_path_edits(tree) for name, tree in modules.items() if name != BOOTSTRAP}
    assert {name: lines for name, lines in edits.items() if lines} == {}


def test_lpx_runs_only_through_the_runner(modules):
    launches = {name: lpx_launches(tree) for name, tree in modules.items() if name != RUNNER}
    assert {name: lines for name, lines in launches.items() if lines} == {}
    assert lpx_launches(modules[RUNNER]), "the runner's own command line is no longer seen"


def test_the_checks_see_each_breach():
    breach = ast.parse(
        "import sys\n"
        "from pipeline.fixture.io import read_table\n"
        "import _bootstrap\n"
        "sys.path.insert(0, '..')\n"
        "def f():\n"
        "    from tests.engine_like import generated_rollout\n"
        "    subprocess.run([sys.executable, '-m', 'pipeline', 'compare'])\n"
        "    subprocess.run([Path(sys.executable).with_name('lpx'), 'gate'])\n"
        "    subprocess.run([ROOT / '.venv' / 'bin' / 'lpx', 'bisect'])\n"
        "    subprocess.run([sys.executable, '-c', 'from pipeline.entry import main; main()'])\n"
    )
    assert imports_of_tests(breach) == ["tests.engine_like"]
    assert bootstrap_problem(breach) == "imports pipeline.fixture.io before _bootstrap"
    assert bootstrap_problem(ast.parse("import numpy\n")) == "never imports _bootstrap"
    assert sys_path_edits(breach) == [4]
    assert sorted(lpx_launches(breach)) == [7, 8, 9, 10]
    assert lpx_launches(ast.parse("CACHE = Path.home() / '.cache' / 'lpx'\n")) == []


def test_support_is_shared_by_tests_and_bench_but_never_shipped():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    shipped = config["tool"]["setuptools"]["packages"]
    assert not [name for name in shipped if name.split(".")[0] in ("support", "tests", "bench")]
    sources = {path.name: ast.parse(path.read_text()) for path in (ROOT / "support").glob("*.py")}
    assert "__init__.py" in sources
    assert {
        name: imports_of_tests(tree) for name, tree in sources.items() if imports_of_tests(tree)
    } == {}
