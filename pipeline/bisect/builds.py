"""Builds: what an engine stage runs in, and the builds that lie between a good and a bad one.

Three kinds, written the way `--good`, `--bad` and a `--builds` file say them:

* ``pip:transformers==5.18.0`` (or a bare ``NAME==VERSION``): an environment layered on
  lpx's own with that requirement pinned (pipeline/environments.py), from a wheelhouse
  when one is given; builds between two versions are the package's releases between them;
* ``image:vllm/vllm-openai:v0.33.0``: a container image (``--runner docker``); builds
  between two images come from a ``--builds`` file, in order;
* ``git:REVISION``: a revision of an engine's source tree (``--source DIR``), built into
  an environment by a command (default: pip install of the tree, no dependencies); builds
  between two revisions are ``git rev-list --first-parent``.

A ``--builds`` file is YAML: a list of builds in order, each a string as above or a mapping
``{name, pip: [lines] | image: REF | git: REV, patch: FILE}``; a patch is applied to what a
pip build installed (a fault seeded into a real release, or a fix tried before it ships).
"""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from packaging.version import InvalidVersion, Version

from pipeline.errors import BadInput
from pipeline.yaml_text import parse_yaml

KINDS = ("pip", "image", "git")
PINNED = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*==\s*([^\s;,]+)\s*$")


@dataclass(frozen=True)
class Build:
    name: str
    kind: str  # pip | image | git
    requirements: tuple[str, ...] = ()  # pip
    image: str | None = None  # image
    revision: str | None = None  # git
    patch: Path | None = None

    def describe(self) -> dict:
        said = {"name": self.name, "kind": self.kind}
        if self.requirements:
            said["requirements"] = list(self.requirements)
        for key in ("image", "revision"):
            if getattr(self, key):
                said[key] = getattr(self, key)
        if self.patch:
            said["patch"] = str(self.patch)
        return said


def parse_build(text: str, where: str = "") -> Build:
    """One build as the command line or a builds file writes it."""
    text = str(text).strip()
    kind, sep, rest = text.partition(":")
    if sep and kind in KINDS and rest.strip():
        rest = rest.strip()
        if kind == "pip":
            lines = tuple(part.strip() for part in rest.split(";") if part.strip())
            return Build(text, "pip", requirements=lines)
        if kind == "image":
            return Build(text, "image", image=rest)
        return Build(text, "git", revision=rest)
    if PINNED.match(text):
        return Build(f"pip:{text}", "pip", requirements=(text,))
    raise BadInput(
        f"{where}build {text!r}: say its kind, e.g. pip:transformers==5.18.0, "
        "image:vllm/vllm-openai:v0.33.0 or git:<revision> (docs/bisect.md)."
    )


def load_builds(path: Path) -> list[Build]:
    """The builds of a --builds file, in order; a patch path is relative to the file."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise BadInput(f"--builds {path}: not UTF-8 text; save it as UTF-8 YAML.") from None
    except OSError as error:
        raise BadInput(f"--builds {path}: cannot read it ({error.strerror}).") from None
    data = parse_yaml(text, f"--builds {path}")
    if not isinstance(data, list) or not data:
        raise BadInput(f"--builds {path}: write a YAML list of builds, oldest first.")
    builds = [_entry(item, Path(path), number) for number, item in enumerate(data, 1)]
    names = [b.name for b in builds]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise BadInput(f"--builds {path}: build names must differ; {', '.join(twice)} repeats.")
    return builds


def _entry(item, path: Path, number: int) -> Build:
    where = f"--builds {path}: entry {number}: "
    if isinstance(item, str):
        return parse_build(item, where)
    if not isinstance(item, dict):
        raise BadInput(f"{where}a build is a string or a mapping.")
    unknown = sorted(set(item) - {"name", "patch", *KINDS})
    kinds = [k for k in KINDS if k in item]
    if unknown or len(kinds) != 1:
        raise BadInput(
            f"{where}give exactly one of pip, image, git (and optionally name, patch)"
            + (f"; unknown: {', '.join(unknown)}" if unknown else "")
            + "."
        )
    kind = kinds[0]
    value = item[kind]
    patch = (path.parent / item["patch"]).resolve() if item.get("patch") else None
    if patch is not None and not patch.is_file():
        raise BadInput(f"{where}patch {patch}: no such file.")
    if patch is not None and kind != "pip":
        raise BadInput(f"{where}a patch applies to a pip build's installed packages only.")
    if kind == "pip":
        lines = tuple([value] if isinstance(value, str) else [str(v) for v in value])
        built = Build("", "pip", requirements=lines, patch=patch)
    elif kind == "image":
        built = Build("", "image", image=str(value))
    else:
        built = Build("", "git", revision=str(value))
    default = parse_build(f"{kind}:{';'.join(lines) if kind == 'pip' else value}").name
    return Build(**{**built.__dict__, "name": str(item.get("name") or default)})


def between(
    good: str,
    bad: str,
    builds_file: Path | None = None,
    wheelhouse: Path | None = None,
    source: Path | None = None,
) -> list[Build]:
    """Every build from good to bad, both included, oldest first."""
    if builds_file is not None:
        return _slice(load_builds(builds_file), good, bad, builds_file)
    first, last = parse_build(good, "--good "), parse_build(bad, "--bad ")
    if first.kind != last.kind:
        raise BadInput(
            f"--good is a {first.kind} build and --bad a {last.kind} build; bisect one kind."
        )
    if first.kind == "pip":
        return _releases(first, last, wheelhouse)
    if first.kind == "git":
        return _revisions(first, last, source)
    raise BadInput(
        "images have no order lpx can read: list them, oldest first, in --builds FILE "
        "(docs/bisect.md)."
    )


def _slice(builds: list[Build], good: str, bad: str, path: Path) -> list[Build]:
    def find(text: str, option: str) -> int:
        for index, build in enumerate(builds):
            if text in (build.name, build.image, build.revision) or (
                build.requirements
                and text in (";".join(build.requirements), f"pip:{build.requirements[0]}")
            ):
                return index
        names = ", ".join(b.name for b in builds)
        raise BadInput(f"{option} {text!r} is not a build of {path}; its builds: {names}.")

    start, end = find(good, "--good"), find(bad, "--bad")
    if start >= end:
        raise BadInput(f"--good {good!r} must come before --bad {bad!r} in {path} (oldest first).")
    return builds[start : end + 1]


def _releases(first: Build, last: Build, wheelhouse: Path | None) -> list[Build]:
    """The package's releases from good to bad: the wheelhouse's when one is given (offline),
    else the package index's."""
    if len(first.requirements) != 1 or len(last.requirements) != 1:
        raise BadInput(
            "--good and --bad pin one package each (pip:NAME==VERSION); list more in --builds."
        )
    (name_a, version_a), (name_b, version_b) = (_pinned(b.requirements[0]) for b in (first, last))
    if _canonical(name_a) != _canonical(name_b):
        raise BadInput(f"--good pins {name_a} and --bad {name_b}: bisect one package's releases.")
    low, high = _version(version_a, "--good"), _version(version_b, "--bad")
    if low >= high:
        raise BadInput(f"--good {version_a} must be older than --bad {version_b}.")
    found = _wheelhouse_versions(wheelhouse, name_a) if wheelhouse else _index_versions(name_a)
    found |= {low, high}
    pre = low.is_prerelease or high.is_prerelease
    chosen = sorted(v for v in found if low <= v <= high and (pre or not v.is_prerelease))
    return [parse_build(f"pip:{name_a}=={v}") for v in chosen]


def _revisions(first: Build, last: Build, source: Path | None) -> list[Build]:
    if source is None:
        raise BadInput("git builds need --source DIR: the engine's source tree (a git clone).")
    revs = _git(
        source, "rev-list", "--reverse", "--first-parent", f"{first.revision}..{last.revision}"
    )
    good = _git(source, "rev-parse", f"{first.revision}^{{commit}}").strip()
    commits = [good, *revs.split()]
    if len(commits) < 2:
        raise BadInput(
            f"--source {source}: no commits from {first.revision} to {last.revision} on the "
            "first-parent line; is --good an ancestor of --bad?"
        )
    return [Build(f"git:{c[:12]}", "git", revision=c) for c in commits]


def _git(source: Path, *argv: str) -> str:
    result = subprocess.run(["git", "-C", str(source), *argv], capture_output=True, text=True)
    if result.returncode != 0:
        raise BadInput(f"--source {source}: git {argv[0]} failed ({result.stderr.strip()[:300]}).")
    return result.stdout


def _pinned(line: str) -> tuple[str, str]:
    match = PINNED.match(line)
    if not match:
        raise BadInput(f"{line!r}: pin one version (NAME==VERSION) to bisect a package's releases.")
    return match.group(1), match.group(2)


def _version(text: str, option: str) -> Version:
    try:
        return Version(text)
    except InvalidVersion:
        raise BadInput(f"{option}: {text!r} is not a version pip understands.") from None


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _wheelhouse_versions(wheelhouse: Path, name: str) -> set[Version]:
    if not Path(wheelhouse).is_dir():
        raise BadInput(f"--wheelhouse {wheelhouse}: not a directory of wheels.")
    versions = set()
    for wheel in Path(wheelhouse).glob("*.whl"):
        project, _, rest = wheel.name.partition("-")
        if _canonical(project) == _canonical(name):
            try:
                versions.add(Version(rest.split("-")[0]))
            except InvalidVersion:
                continue
    return versions


def _index_versions(name: str) -> set[Version]:
    """The releases the package index lists (`pip index versions`, which needs the network)."""
    result = subprocess.run(
        [sys.executable, "-m", "pip", "index", "versions", name, "--disable-pip-version-check"],
        capture_output=True,
        text=True,
    )
    listed = re.search(r"Available versions:\s*(.+)", result.stdout)
    if result.returncode != 0 or not listed:
        raise BadInput(
            f"the package index did not list {name}'s releases ({result.stderr.strip()[:200]}); "
            "give --wheelhouse DIR or list the builds in --builds FILE."
        )
    versions = set()
    for text in listed.group(1).split(","):
        try:
            versions.add(Version(text.strip()))
        except InvalidVersion:
            continue
    return versions
