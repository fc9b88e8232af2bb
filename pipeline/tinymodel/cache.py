"""Tiny models already built, kept by what makes them: the same build again is a copy.

A build is a pure function of the architecture, the seed, lpx's builder and families, and the
library versions that train and save it (build.py: same inputs, same bytes), so its bytes are
kept under that key in ``$LPX_MODEL_CACHE`` (default ``$LPX_CACHE/models/built``, else
``~/.cache/lpx/models/built``; ``off`` builds every time). A kept build is checked against
the digests it was stored with before it is copied; one that does not match is built anew.
Concurrent builders of one key take turns (a file lock), so the key is built once.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path

import pipeline

DIGESTS = "lpx-digests.json"
# What the bytes of a build depend on besides the arch and seed.
LIBRARIES = ("torch", "transformers", "tokenizers", "safetensors", "numpy")


def cache_root() -> Path | None:
    """Where built models are kept; None when LPX_MODEL_CACHE=off."""
    setting = os.environ.get("LPX_MODEL_CACHE", "")
    if setting.lower() == "off":
        return None
    if setting:
        return Path(setting)
    return Path(os.environ.get("LPX_CACHE", Path.home() / ".cache" / "lpx")) / "models" / "built"


def build_key(arch: str, seed: int) -> str:
    """The arch and seed, then a digest of the builder's sources and the libraries."""
    digest = hashlib.sha256()
    package = Path(pipeline.__file__).parent
    sources = [
        p for folder in ("tinymodel", "families") for p in sorted((package / folder).glob("*"))
    ]
    sources.append(package / "trajectory" / "template.py")  # the chat template it saves
    for source in sources:
        if source.is_file() and source.suffix in (".py", ".txt"):
            digest.update(source.name.encode() + b"\0" + source.read_bytes())
    for library in LIBRARIES:
        try:
            digest.update(f"{library}=={metadata.version(library)}".encode())
        except metadata.PackageNotFoundError:
            digest.update(f"{library} missing".encode())
    return f"{arch}-seed{seed}-{digest.hexdigest()[:16]}"


@contextmanager
def one_builder(arch: str, seed: int) -> Iterator[Path | None]:
    """The key's folder in the cache (None without a cache), held by this process alone, so
    that a second builder of the same key waits and then copies."""
    root = cache_root()
    if root is None:
        yield None
        return
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError:  # a cache that cannot be made is no cache: build as without one
        yield None
        return
    from filelock import FileLock

    key = build_key(arch, seed)
    with FileLock(str(root / f"{key}.lock")):
        yield root / key


def copy_kept(entry: Path | None, into: Path) -> bool:
    """Copy a kept build into ``into`` (a new folder); False when there is none, or when its
    files no longer match the digests they were kept with."""
    if entry is None or not (entry / DIGESTS).is_file():
        return False
    try:
        digests = json.loads((entry / DIGESTS).read_text())
        into.mkdir(parents=True, exist_ok=True)
        for name, want in digests.items():
            shutil.copyfile(entry / name, into / name)
            if _sha256(into / name) != want:
                raise ValueError(name)
    except (OSError, ValueError):
        shutil.rmtree(into, ignore_errors=True)
        return False
    return True


def keep(built: Path, entry: Path | None) -> None:
    """Keep a copy of a finished build under its key (whole, or not at all)."""
    if entry is None:
        return
    staging = entry.with_name(f".{entry.name}.{uuid.uuid4().hex[:8]}")
    try:
        shutil.copytree(built, staging)
        digests = {p.name: _sha256(p) for p in sorted(staging.iterdir()) if p.is_file()}
        (staging / DIGESTS).write_text(json.dumps(digests, indent=1) + "\n")
        if entry.exists():  # a damaged one: set aside first
            shutil.rmtree(entry, ignore_errors=True)
        staging.rename(entry)
    except OSError:
        pass  # a full or read-only cache costs the next build, nothing else
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()
