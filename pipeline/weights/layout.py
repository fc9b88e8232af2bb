"""The weight store on disk: its names, the store header, manifests, the `latest` pointer,
the publish lock, and the file helpers that make each step durable."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import uuid
from contextlib import contextmanager
from pathlib import Path

from pipeline.errors import BadInput
from pipeline.paths import SAFE_NAME, write_text_atomic
from pipeline.weights.tensors import ITEM_SIZES, TensorSpec

STORE_FILE = "lpx-weights-store.json"
STORE_FORMAT = {"format": "lpx-weights-store", "format_version": 1}
LATEST = "latest"
VERSIONS = "versions"
STAGING = ".staging"
LOCK_FILE = ".publish.lock"
MANIFEST = "manifest.json"
TENSORS = "tensors.safetensors"
VERSION_FILE = "WEIGHT_VERSION"
STORED_MODES = ("full", "parent", "xor-zlib")


def read_latest(store: Path) -> str | None:
    """The name `latest` holds; None before the first version is announced."""
    try:
        name = (store / LATEST).read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        return None
    if not SAFE_NAME.fullmatch(name) or ".." in name:
        raise BadInput(
            f"{store / LATEST} holds {name[:40]!r}, not a version name; write the newest "
            "complete version's name into it."
        )
    return name


def check_store(store: Path) -> None:
    path = store / STORE_FILE
    if not path.is_file():
        raise BadInput(
            f"{store}: not a weight store (no {STORE_FILE}); give the directory "
            "`lpx weights publish --to` writes, or publish a version into it first."
        )
    try:
        header = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        header = {}
    if not isinstance(header, dict) or header.get("format") != STORE_FORMAT["format"]:
        raise BadInput(f"{path}: not an lpx weight store header; restore it or use another store.")
    if header.get("format_version") != STORE_FORMAT["format_version"]:
        raise BadInput(
            f"{path}: format_version {header.get('format_version')}, this lpx reads "
            f"{STORE_FORMAT['format_version']}; use the lpx that wrote the store."
        )


def create_store(store: Path) -> None:
    if (store / STORE_FILE).is_file():
        check_store(store)
    elif store.exists() and (not store.is_dir() or any(store.iterdir())):
        raise BadInput(
            f"{store}: exists and is not a weight store; publish into a new or empty directory."
        )
    else:
        store.mkdir(parents=True, exist_ok=True)
        write_text_atomic(store / STORE_FILE, json.dumps(STORE_FORMAT) + "\n")
    (store / VERSIONS).mkdir(exist_ok=True)
    (store / STAGING).mkdir(exist_ok=True)


@contextmanager
def publish_lock(store: Path):
    """One publisher at a time; a second waits. Readers never lock."""
    descriptor = os.open(store / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX)
        yield
    finally:
        os.close(descriptor)  # releases the lock


def point_latest(store: Path, name: str) -> None:
    temp = store / f".{LATEST}.{os.getpid()}.tmp"
    with open(temp, "w", encoding="utf-8") as handle:
        handle.write(name + "\n")
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temp, store / LATEST)
    fsync_dir(store)


def load_manifest(store: Path, name: str) -> dict:
    path = store / VERSIONS / name / MANIFEST
    if not path.parent.is_dir():
        raise BadInput(f"{store}: no version {name!r} (versions/{name} is missing).")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise BadInput(
            f"{path}: missing; version {name} is incomplete: pull another version, or publish "
            "it again."
        ) from None
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise BadInput(f"{path}: not JSON ({error}); the version is damaged.") from None
    problem = _manifest_problem(manifest, name)
    if problem:
        raise BadInput(f"{path}: {problem}; the version is damaged: publish it again.")
    return manifest


def _manifest_problem(manifest, name: str) -> str | None:
    required = ("name", "number", "parent", "kind", "fingerprint", "tensors", "files")
    if not isinstance(manifest, dict) or any(key not in manifest for key in required):
        return f"lacks one of {', '.join(required)}"
    if manifest["name"] != name:
        return f"names version {manifest['name']!r}, not {name!r}"
    if not isinstance(manifest["number"], int):
        return f"number {manifest['number']!r} is not an integer"
    if not isinstance(manifest["tensors"], dict) or not isinstance(manifest["files"], dict):
        return "its tensors or files are not a mapping"
    for tensor, entry in manifest["tensors"].items():
        if not isinstance(entry, dict) or not isinstance(entry.get("shape"), list):
            return f"tensor {tensor!r} has no shape"
        if not isinstance(entry.get("sha256"), str):
            return f"tensor {tensor!r} has no sha256"
        if entry.get("stored") not in STORED_MODES or entry.get("dtype") not in ITEM_SIZES:
            return f"tensor {tensor!r} has stored {entry.get('stored')!r}, dtype {entry.get('dtype')!r}"
        if not all(isinstance(d, int) and d >= 0 for d in entry["shape"]):
            return f"tensor {tensor!r} has shape {entry['shape']!r}"
    for file in manifest["files"]:
        if not SAFE_NAME.fullmatch(file) or ".." in file:
            return f"file name {file!r} is not a plain file name"
    return None


def scan_versions(store: Path) -> tuple[list[dict], dict[str, str]]:
    """Every readable manifest under versions/, and the directories that have none."""
    manifests, damaged = [], {}
    directory = store / VERSIONS
    for child in sorted(directory.iterdir()) if directory.is_dir() else []:
        try:
            manifests.append(load_manifest(store, child.name))
        except BadInput as error:
            if child.exists():  # not one a retention or cleanup just removed
                damaged[child.name] = error.message
    return manifests, damaged


def discard(directory: Path, beside: Path) -> None:
    """Rename a directory away, then delete it: a reader sees it whole or gone."""
    doomed = beside / f".removing-{directory.name}-{uuid.uuid4().hex[:8]}"
    os.rename(directory, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def tensor_bytes(manifest: dict) -> int:
    return sum(
        TensorSpec(t, e["dtype"], tuple(e["shape"])).nbytes for t, e in manifest["tensors"].items()
    )


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def copy_hashing(source: Path, target: Path) -> str:
    digest = hashlib.sha256()
    with open(source, "rb") as reader, open(target, "wb") as writer:
        for block in iter(lambda: reader.read(1 << 20), b""):
            digest.update(block)
            writer.write(block)
    return digest.hexdigest()


def fsync_file(path: Path) -> None:
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


def fsync_dir(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
