"""The docs name only what exists: every link, anchor, repo path, module, `lpx` option and
LPX_ setting that README.md, docs/*.md, bench/README.md and the example plans' comments write
is checked against the tree and the click commands, and the policy page shows the bundled
default policy and every cause."""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path

import click
import pytest

from pipeline.cli import cli
from pipeline.contracts.causes import Cause

ROOT = Path(__file__).resolve().parents[2]

# The top of the tree a doc's path may start with; a path starting anywhere else
# (`runs/smoke/`, `run/fixture.parquet`, `models/policy`) is the user's, not the repo's.
REPO_DIRS = (
    "pipeline",
    "tests",
    "scripts",
    "examples",
    "bench",
    "docs",
    "docker",
    "db",
    "templates",
    "support",
    ".github",
    ".ci",
)
# The files at the top a doc may name by themselves (`Dockerfile.megatron`, `compose.yaml`).
TOP_FILE = re.compile(r"Dockerfile(?:\.[a-z]+)?|compose\.ya?ml|pyproject\.toml")
# Installed under these names (pyproject's package-dir), kept at the top in the tree.
MAPPED_PACKAGES = {"pipeline.db": ROOT / "db", "pipeline.templates": ROOT / "templates"}

# What lpx writes into a user's run directory (`DIR/summary.md`), never a file of the repo.
OUTPUT_NAMES = {"summary.md"}

# Inline code that starts with `lpx ` but is a value lpx writes, not a command line.
NOT_COMMANDS = {
    "lpx emulation",  # fixture-schema.md: what `computed_by` says when lpx's emulation computed
}

# docs/cli.md is generated from every command's --help (tests/cli/test_cli_reference.py holds
# it equal): its options are the CLI's by construction, its paths are the help's examples.
GENERATED = {"docs/cli.md"}


def doc_pages() -> list[Path]:
    pages = [ROOT / "README.md", ROOT / "bench" / "README.md"]
    pages += sorted((ROOT / "docs").glob("*.md"))
    return [p for p in pages if p.relative_to(ROOT).as_posix() not in GENERATED]


@pytest.mark.parametrize("page", doc_pages(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_link_path_module_and_option_a_page_names_exists(page):
    assert problems(page, page.read_text(encoding="utf-8")) == []


@pytest.mark.parametrize(
    "plan", sorted((ROOT / "examples").glob("*.yaml")), ids=lambda p: p.relative_to(ROOT).as_posix()
)
def test_every_path_and_lpx_option_an_example_plans_comments_name_exists(plan):
    assert comment_problems(plan.read_text(encoding="utf-8")) == []


def test_the_checker_reports_what_does_not_exist():
    page = ROOT / "docs" / "made-up.md"
    text = "\n".join(
        [
            "# A page",
            "## Its second heading",
            "See [compare](compare.md#sign-convention), [here](#its-second-heading), and",
            "[gone](nowhere.md), [no anchor](compare.md#no-such-heading), [self](#nope).",
            "`pipeline/compare/run.py`, `pipeline/compare/nothing.py`, tests/cli/nope.py,",
            "`Dockerfile.vllm`, `Dockerfile.tpu` and",
            "`runs/smoke/` (a user's path); `pipeline.compare.run` and `pipeline.compare.gone`,",
            "`pipeline.nosuch.thing`,",
            "`pipeline.faults.register(kind)` and `pipeline.faults.unregister(kind)`; `verify/judge.py`",
            "and `verify/nothing.py`; `lpx compare --exact`, `lpx compare --exactly`, `lpx nosuch`,",
            "`lpx weights publish --delta` and `lpx weights publish --nope`, `LPX_COMPARE_POLICY`",
            "and `LPX_COMPARE_POLICE`, `LPX_CACHE` and `LPX_NOBODY_READS`; verl's",
            "[`docs/algo/rollout_corr.md`](https://github.com/volcengine/verl) is theirs.",
            "```bash",
            "lpx replay run/fixture.parquet --dtype bf16 \\",
            "    --no-such-flag --out run/r.parquet",
            "lpx annotate 3 --change 41",
            "lpx annotate 3 --change 41 --reason 'a new kernel'; lpx ack 2 ...",
            "# a comment is not a heading: lpx  nosuch",
            "```",
        ]
    )
    found = problems(page, text)
    assert found == [
        "link nowhere.md: no such file",
        "link compare.md#no-such-heading: no heading with that anchor",
        "link #nope: no heading with that anchor",
        "path pipeline/compare/nothing.py: not in the repository",
        "path tests/cli/nope.py: not in the repository",
        "path Dockerfile.tpu: not in the repository",
        "path verify/nothing.py: no file of the repository ends so",
        "module pipeline.compare.gone: pipeline/compare/__init__.py has no gone",
        "module pipeline.nosuch.thing: no such module",
        "module pipeline.faults.unregister: pipeline/faults/__init__.py has no unregister",
        "option lpx compare --exactly: no such option",
        "command lpx nosuch: no such command",
        "option lpx weights publish --nope: no such option",
        "option lpx replay --no-such-flag: no such option",
        "option lpx annotate --reason: required, not given",
        "option LPX_COMPARE_POLICE: lpx compare has no --police",
        "setting LPX_NOBODY_READS: nothing in the repository reads it",
    ], found


def test_the_comment_checker_reports_what_does_not_exist():
    text = "# lpx run examples/smoke.yaml --runner docker; lpx starts a server\n"
    text += "# lpx run examples/nope.yaml --runnr docker\nmodel: tiny  # not a comment's path\n"
    assert comment_problems(text) == [
        "path examples/nope.yaml: not in the repository",
        "option lpx run --runnr: no such option",
    ]


def test_headings_anchor_as_github_writes_them():
    text = "# `lpx compare`: metrics\n## NeMo-RL's gates, ready to copy\n## A\n## A\n"
    assert anchors(text) == {"lpx-compare-metrics", "nemo-rls-gates-ready-to-copy", "a", "a-1"}


def test_policy_md_shows_the_bundled_default_policy():
    """The README calls it the default: the YAML block that opens policy.md is the file
    `lpx compare` loads when no --policy is given (pipeline/compare/policy.py)."""
    text = (ROOT / "docs" / "policy.md").read_text(encoding="utf-8")
    shown = next(body for lang, body in code_blocks(text) if lang == "yaml")
    bundled = ROOT / "pipeline" / "compare" / "policies" / "default.yaml"
    assert shown == bundled.read_text(encoding="utf-8")
    assert "policies/default.yaml" in (ROOT / "pipeline" / "compare" / "policy.py").read_text()


def test_policy_md_lists_every_cause_a_policy_may_name():
    text = (ROOT / "docs" / "policy.md").read_text(encoding="utf-8")
    bullet = text.split("- **fail_on_findings**", 1)[1].split("\n- **", 1)[0]
    named = set(re.findall(r"`([a-z_]+)`", bullet))
    assert named >= {cause.value for cause in Cause}, {c.value for c in Cause} - named


# The checker -----------------------------------------------------------------------------


@dataclass
class Segment:
    code: bool
    lang: str
    text: str


def segments(text: str) -> list[Segment]:
    """The page cut at its fenced code blocks."""
    parts: list[Segment] = []
    prose: list[str] = []
    fence: str | None = None
    lang = ""
    block: list[str] = []
    for line in text.splitlines():
        stripped = line.strip()
        if fence is None and stripped.startswith(("```", "~~~")):
            fence, lang = stripped[:3], stripped[3:].strip()
            parts.append(Segment(False, "", "\n".join(prose)))
            prose, block = [], []
        elif fence is not None and stripped.startswith(fence):
            parts.append(Segment(True, lang, "\n".join(block) + "\n"))
            fence = None
        elif fence is not None:
            block.append(line)
        else:
            prose.append(line)
    parts.append(Segment(False, "", "\n".join(prose)))
    return parts


def code_blocks(text: str) -> list[tuple[str, str]]:
    return [(s.lang, s.text) for s in segments(text) if s.code]


def anchors(text: str) -> set[str]:
    """The anchors GitHub gives a page's headings: the heading's text, lower case, with
    everything but letters, digits, `_`, `-` and spaces dropped and spaces made `-`; a
    repeated anchor gets `-1`, `-2`, ..."""
    seen: dict[str, int] = {}
    found = set()
    for part in segments(text):
        if part.code:
            continue
        for line in part.text.splitlines():
            heading = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
            if not heading:
                continue
            words = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.group(1))
            words = words.replace("`", "").replace("*", "").lower()
            slug = re.sub(r"[^\w\- ]", "", words).replace(" ", "-")
            count = seen.get(slug, 0)
            seen[slug] = count + 1
            found.add(slug if count == 0 else f"{slug}-{count}")
    return found


EXTERNAL_LINK = re.compile(r"\[[^\]]*\]\([a-z]+:[^)]*\)")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
REPO_PATH = re.compile(
    r"(?<![\w./~:@-])((?:" + "|".join(re.escape(d) for d in REPO_DIRS) + r")/[\w./<>{}*-]*)"
)
INLINE_CODE = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
# a module written from its package down (`verify/judge.py`), or another page (`x/y.md`)
SHORT_PATH = re.compile(r"^(?:[\w.-]+/)*[\w-]+\.py$|^(?:[\w.-]+/)+[\w-]+\.md$")
MODULE = re.compile(r"(?<![\w./])(pipeline(?:\.[A-Za-z_]\w*)+)")
COMMAND_START = re.compile(
    r"(?:^|[;&|]\s*|\$\(|\$\s+)(?:[A-Z_]+=\S+\s+)*(?:\S*/)?lpx(?=\s|$)((?:\s+[^\s;&|]+)*)"
)
ENVIRONMENT = re.compile(r"\bLPX_([A-Z][A-Z0-9_]*[A-Z0-9])\b")


def problems(page: Path, text: str) -> list[str]:
    """Everything the page names that does not exist, one line each, in the order: links,
    repo paths, modules, then commands and options as they come."""
    found: list[str] = []
    found += _links(page, text)
    found += _paths(text)
    found += _modules(text)
    found += _commands(text)
    return found


def comment_problems(text: str) -> list[str]:
    """An example plan's comments: repo paths, modules, and the options of each `lpx COMMAND`
    they write (a comment's `lpx` may begin a sentence, so only known commands are read)."""
    comments = "\n".join(
        line.split("#", 1)[1] for line in text.splitlines() if line.lstrip().startswith("#")
    )
    found = _paths(comments) + _modules(comments)
    for match in re.finditer(r"\blpx((?:[ \t]+[^\s;&|()`]+)+)", comments):
        words = match.group(1).split()
        if words[0] in cli.commands:
            found += _command_line(words, whole=False)
    return found


def _links(page: Path, text: str) -> list[str]:
    found = []
    prose = "\n".join(s.text for s in segments(text) if not s.code)
    for target in LINK.findall(prose):
        if re.match(r"[a-z]+:", target):
            continue
        where, _, anchor = target.partition("#")
        file = (page.parent / where).resolve() if where else page
        if where and not file.exists():
            found.append(f"link {target}: no such file")
        elif anchor and file.suffix == ".md":
            headings = anchors(text if file == page else file.read_text(encoding="utf-8"))
            if anchor not in headings:
                found.append(f"link {target}: no heading with that anchor")
    return found


def _paths(text: str) -> list[str]:
    """Repo paths anywhere, and short ones (`verify/judge.py`) in inline code. Another
    project's path is written as a link to it, whose text is not checked."""
    text = EXTERNAL_LINK.sub("", text)
    found = []
    for raw in REPO_PATH.findall(text):
        path = raw.rstrip(".")
        checked = re.split(r"[<{*]", path)[0]
        if checked != path and not checked.endswith("/"):
            continue
        if not (ROOT / checked).exists():
            found.append(f"path {path}: not in the repository")
    for code in INLINE_CODE.findall(text):
        if TOP_FILE.fullmatch(code) and not (ROOT / code).is_file():
            found.append(f"path {code}: not in the repository")
        code = code.split(":")[0]
        if not SHORT_PATH.match(code) or code.split("/")[0] in REPO_DIRS:
            continue
        if code.rsplit("/", 1)[-1] in OUTPUT_NAMES:
            continue
        if not any(f == code or f.endswith("/" + code) for f in _repo_files()):
            found.append(f"path {code}: no file of the repository ends so")
    return found


def _modules(text: str) -> list[str]:
    found = []
    for name in dict.fromkeys(MODULE.findall(text)):
        parts = name.split(".")
        for cut in range(len(parts), 1, -1):
            source = _module_file(parts[:cut])
            if source is not None:
                break
        else:
            found.append(f"module {name}: no such module")
            continue
        rest = parts[cut:]
        if len(rest) > 1 or (rest and not re.search(rf"\b{rest[0]}\b", source.read_text())):
            shown = source.relative_to(ROOT).as_posix()
            found.append(f"module {name}: {shown} has no {'.'.join(rest)}")
    return found


def _module_file(parts: list[str]) -> Path | None:
    name = ".".join(parts)
    for package, folder in MAPPED_PACKAGES.items():
        if name == package or name.startswith(package + "."):
            base = folder.joinpath(*name[len(package) :].split(".")[1:])
            break
    else:
        base = ROOT.joinpath(*parts)
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return base if base.is_dir() and name in MAPPED_PACKAGES else None


def _commands(text: str) -> list[str]:
    """`lpx COMMAND [SUBCOMMAND] --option` in code blocks (a line starting a command, a
    backslash continuing it) and in inline code starting with `lpx`; `LPX_COMMAND_OPTION`
    wherever it is written."""
    lines = []
    for part in segments(text):
        if part.code and part.lang in ("", "bash", "sh", "shell", "console"):
            joined = part.text.replace("\\\n", " ").splitlines()
            lines += [(line.split(" #")[0], True) for line in joined]
        elif not part.code:
            spans = INLINE_CODE.findall(part.text)
            lines += [(code, False) for code in spans if code not in NOT_COMMANDS]
    found = []
    for line, whole in lines:
        for match in COMMAND_START.finditer(line.strip()):
            found += _command_line(match.group(1).split(), whole and "..." not in line)
    for name in dict.fromkeys(ENVIRONMENT.findall(text)):
        found += _environment(name)
    return found


def _command_line(words: list[str], whole: bool) -> list[str]:
    """One `lpx ...` line: its command exists and has each option given; a whole line (a code
    block's, nothing elided) also gives the options the command requires."""
    command: click.Command = cli
    path = ["lpx"]
    given = set()
    for word in words:
        if word.startswith("-"):
            option = word.split("=")[0]
            if option not in _options(command):
                return [f"option {' '.join(path)} {option}: no such option"]
            given.add(option)
        elif isinstance(command, click.Group) and re.fullmatch(r"[a-z][a-z-]*", word):
            sub = command.commands.get(word)
            if sub is None:
                return [f"command {' '.join(path)} {word}: no such command"]
            command, path = sub, [*path, word]
        elif isinstance(command, click.Group) and command is cli:
            return []  # `lpx` in a sentence, not a command line
    if not whole or given & {"--help", "-h"} or isinstance(command, click.Group):
        return []
    required = [
        p.opts[0]
        for p in command.params
        if isinstance(p, click.Option) and p.required and not given & set(p.opts)
    ]
    return [f"option lpx {' '.join(path[1:])} {o}: required, not given" for o in required]


def _options(command: click.Command) -> set[str]:
    names = {"--help", "-h"}
    for param in command.params:
        names.update(o for o in param.opts + param.secondary_opts if o.startswith("-"))
    return names


def _environment(name: str) -> list[str]:
    """LPX_COMPARE_POLICY is `lpx compare --policy` (click's auto_envvar_prefix); any other
    LPX_ name (LPX_DB, LPX_CACHE, LPX_SMOKE_PLANS) must be read somewhere in the repository's
    code, scripts or configuration."""
    if f"LPX_{name}" in _code_text():
        return []
    command: click.Command = cli
    path = ["lpx"]
    words = name.lower().split("_")
    while isinstance(command, click.Group):
        for size in range(len(words) - 1, 0, -1):
            sub = command.commands.get("-".join(words[:size]))
            if sub is not None:
                command, path, words = sub, [*path, "-".join(words[:size])], words[size:]
                break
        else:
            break
    if command is cli:
        return [f"setting LPX_{name}: nothing in the repository reads it"]
    option = "--" + "-".join(words)
    if option in _options(command):
        return []
    return [f"option LPX_{name}: {' '.join(path)} has no {option}"]


@functools.cache
def _repo_files() -> tuple[str, ...]:
    skip = {".venv", "__pycache__", ".git"}
    return tuple(
        p.relative_to(ROOT).as_posix()
        for p in ROOT.rglob("*")
        if p.is_file() and not skip & set(p.relative_to(ROOT).parts)
    )


@functools.cache
def _code_text() -> str:
    """Every file of the repository but the docs (and this test's made-up names): where a
    setting is read."""
    texts = []
    this = Path(__file__).resolve().relative_to(ROOT).as_posix()
    for name in _repo_files():
        if (
            name != this
            and not name.endswith((".md", ".parquet", ".png", ".db"))
            and "/img/" not in name
        ):
            try:
                texts.append((ROOT / name).read_text(encoding="utf-8"))
            except (UnicodeDecodeError, OSError):
                continue
    return "\n".join(texts)
