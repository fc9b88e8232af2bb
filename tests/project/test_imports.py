"""The import graph of `pipeline/`, read from the source (ast, every import, lazy ones in
function bodies included): no cycle between modules or between packages, no import of the
CLI (`pipeline.commands`) outside the face, and the design's layering (shared/design.md:
compare/, fixture/, history/, report/ and orchestrator/ never import engines/; engines/
never imports the CLI, compare/ or localize/)."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "pipeline"
FACE = ("pipeline.cli", "pipeline.commands", "pipeline.__main__", "pipeline.entry")
NEVER = {
    "pipeline.compare": ("pipeline.engines",),
    "pipeline.fixture": ("pipeline.engines",),
    "pipeline.history": ("pipeline.engines",),
    "pipeline.report": ("pipeline.engines",),
    "pipeline.orchestrator": ("pipeline.engines",),
    "pipeline.engines": ("pipeline.commands", "pipeline.compare", "pipeline.localize"),
}


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        found[name.removesuffix(".__init__")] = path
    return found


def _graph() -> dict[str, set[str]]:
    """Module -> the modules it imports. `from pkg import sub` is an import of pkg.sub only:
    a parent package is initialised by any import of its children, so that edge says nothing."""
    modules = _modules()
    graph: dict[str, set[str]] = defaultdict(set)
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([node.module] if node.module else []))
                subs = [f"{base}.{alias.name}" for alias in node.names]
                targets = [s for s in subs if s in modules] or [base]
            else:
                continue
            graph[name] |= {t for t in targets if t in modules and t != name}
    return graph


def _package(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 and (PACKAGE / parts[1]).is_dir() else module


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in list(graph):
        if node not in index:
            visit(node)
    return found


@pytest.fixture(scope="module")
def graph():
    return _graph()


def test_no_module_imports_itself_back(graph):
    assert _cycles(graph) == []


def test_no_package_imports_itself_back(graph):
    packages: dict[str, set[str]] = defaultdict(set)
    for module, imported in graph.items():
        packages[_package(module)] |= {_package(m) for m in imported} - {_package(module)}
    assert _cycles(packages) == []


def test_only_the_face_imports_the_cli(graph):
    outside = sorted(
        f"{module} -> {target}"
        for module, imported in graph.items()
        for target in imported
        if target.startswith("pipeline.commands") and not module.startswith(FACE)
    )
    assert outside == []


def test_the_layers_never_import_what_the_design_forbids(graph):
    broken = sorted(
        f"{module} -> {target}"
        for module, imported in graph.items()
        for layer, forbidden in NEVER.items()
        if module == layer or module.startswith(layer + ".")
        for target in imported
        if target.startswith(forbidden)
    )
    assert broken == []


def test_the_contracts_stand_on_the_ground_alone(graph):
    """Every stage, the history and the report read pipeline/contracts/: it imports nothing
    of lpx's but the ground (text) and itself, so it can never pull a stage in."""
    allowed = ("pipeline.contracts", "pipeline.text")
    reaching = sorted(
        f"{module} -> {target}"
        for module, imported in graph.items()
        if module.startswith("pipeline.contracts")
        for target in imported
        if not target.startswith(allowed)
    )
    assert reaching == []


def test_the_report_reads_the_history_through_its_queries_only():
    """pipeline/report/ never queries the database itself (no sqlalchemy, no ORM models at
    run time): every query is a function of history/queries.py, written once."""
    reaching = []
    for path in sorted((PACKAGE / "report").glob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        checked = {id(n) for n in ast.walk(tree) if isinstance(n, ast.If)
                   and getattr(n.test, "id", "") == "TYPE_CHECKING" for n in ast.walk(n)}  # fmt: skip
        for node in ast.walk(tree):
            if id(node) in checked or not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
            reaching += [
                f"{path.name} -> {name}"
                for name in names
                if name and (name.split(".")[0] == "sqlalchemy" or name.startswith("pipeline.db"))
            ]
    assert reaching == []


def test_the_checker_sees_a_cycle_and_a_lazy_import():
    """The rule itself: a circle of three is found; a lazy import counts like any other."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    graph = _graph()
    # pipeline.verify.flow imports the registry of families lazily or not: it is an edge
    assert "pipeline.verify.families" in graph["pipeline.verify.flow"]


# The package root's one deliberate import-time act: SGLang's torchvision must be stopped
# before anything imports it (pipeline/torchvision_guard.py), so it runs on `import pipeline`.
ROOT_INIT_CALLS = {"torchvision_guard.install"}
MODULE_LINES_LIMIT = 500  # a module over it holds more than one thing (issue 54)


def _init_code(tree: ast.Module) -> list[str]:
    """What an __init__.py does besides a docstring, imports and naming its exports."""
    found = []
    for node in tree.body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            continue
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue  # the docstring
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] in (
            ["__all__"],
            ["__version__"],
        ):
            continue
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
            if ast.unparse(node.value.func) in ROOT_INIT_CALLS:
                continue
        found.append(f"line {node.lineno}: {ast.unparse(node).splitlines()[0]}")
    return found


def test_every_init_only_re_exports():
    holding = {
        str(path.relative_to(ROOT)): code
        for path in PACKAGE.rglob("__init__.py")
        if (code := _init_code(ast.parse(path.read_text(encoding="utf-8"))))
    }
    assert holding == {}


def test_the_init_check_sees_code():
    assert _init_code(ast.parse("def registry():\n    pass\nX = 1\n")) == [
        "line 1: def registry():",
        "line 3: X = 1",
    ]


def test_no_module_is_over_the_line_limit():
    long = {
        str(path.relative_to(ROOT)): lines
        for path in PACKAGE.rglob("*.py")
        if (lines := len(path.read_text(encoding="utf-8").splitlines())) > MODULE_LINES_LIMIT
    }
    assert long == {}
