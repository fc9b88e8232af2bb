"""A weight-version store: a trainer publishes each policy weight version (whole, or as a
delta on the one before) and advances `latest`; rollout fleets, lpx replay and lpx serve
pull versions from it. Layout and guarantees: docs/weight-sync.md."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from datetime import UTC, datetime
from fnmatch import fnmatch
from pathlib import Path

from pipeline.errors import BadInput
from pipeline.fingerprint import WEIGHT_PATTERNS, tensor_fingerprint
from pipeline.paths import SAFE_NAME
from pipeline.progress import progress_bar
from pipeline.weights.chain import CACHE_MARKER, Resolver, write_model_dir
from pipeline.weights.layout import (
    LATEST,
    MANIFEST,
    STAGING,
    STORE_FILE,
    TENSORS,
    VERSION_FILE,
    VERSIONS,
    check_store,
    copy_hashing,
    create_store,
    discard,
    file_sha256,
    fsync_dir,
    fsync_file,
    load_manifest,
    point_latest,
    publish_lock,
    read_latest,
    scan_versions,
    tensor_bytes,
)
from pipeline.weights.tensors import (
    SafetensorsFile,
    TensorFileError,
    TensorSpec,
    as_torch,
    byte_blob,
    sha256_hex,
    write_safetensors,
    xor_compress,
)


def publish(
    model_dir: Path,
    store: Path,
    *,
    delta: bool = False,
    compress: bool = False,
    name: str | None = None,
    keep: int | None = None,
) -> dict:
    """Publish the weights in ``model_dir`` as the store's next version and make it `latest`.

    ``delta`` stores only the tensors whose bytes differ from the latest version's;
    ``compress`` (implies ``delta``) stores each changed tensor as zlib(new XOR old) when that
    is smaller. A delta with nothing to take it from (no version yet, other tensor names,
    shapes or dtypes) is published full and says why in ``full_reason``. ``keep`` deletes
    versions beyond the newest ``keep``, except those a kept delta needs.

    The version is built in STORE/.staging and renamed into versions/ complete, then `latest`
    is replaced atomically, so a reader never sees half a version and a publisher killed at
    any point leaves `latest` where it was. Returns the version's manifest plus ``removed``:
    the versions ``keep`` deleted.
    """
    model_dir, store = Path(model_dir), Path(store)
    if keep is not None and keep < 1:
        raise BadInput(f"keep {keep}: keep at least 1 version (the latest is never deleted).")
    if name is not None and (not SAFE_NAME.fullmatch(name) or ".." in name or name == LATEST):
        raise BadInput(
            f"version name {name!r}: use letters, digits, '_', '.' and '-', starting with a "
            "letter or digit (it names a directory in the store), and not 'latest'."
        )
    source = _Source(model_dir)
    create_store(store)
    with publish_lock(store):
        _remove_leftovers(store)
        parent = _latest_manifest(store)
        number = parent["number"] + 1 if parent else 1
        name = name or str(number)
        if (store / VERSIONS / name).exists():
            raise BadInput(
                f"{store}: version {name!r} already exists; publish under another --name "
                "(a published version is never replaced)."
            )
        staging = store / STAGING / f"{name}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
        try:
            manifest = _stage(
                source, store, staging, name, number, parent, delta or compress, compress
            )
            os.rename(staging, store / VERSIONS / name)
        except Exception:  # an error, not a kill: leave nothing for the next publish to clean
            shutil.rmtree(staging, ignore_errors=True)
            raise
        fsync_dir(store / VERSIONS)
        point_latest(store, name)
        removed = _retain(store, keep) if keep else []
    return {**manifest, "removed": removed}


def pull(store: Path, version: str | None = None, *, into: Path) -> Path:
    """Write ``version`` (default: latest) of the store into ``into`` as an ordinary Hugging
    Face model directory: its files, one ``model.safetensors`` and WEIGHT_VERSION. Every
    tensor and file is checked against the manifest's sha256 and the weights against its
    fingerprint; ``into`` (new or empty) appears complete or not at all."""
    store, into = Path(store), Path(into)
    name = _version_name(store, version)
    if into.exists() and (not into.is_dir() or any(into.iterdir())):
        raise BadInput(f"{into}: exists and is not an empty directory; pull into a new one.")
    into.parent.mkdir(parents=True, exist_ok=True)
    temp = into.parent / f".{into.name}.pulling-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        write_model_dir(store, name, temp)
        try:
            os.rename(temp, into)
        except OSError as error:
            raise BadInput(f"{into}: {error.strerror}; pull into a new directory.") from None
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    return into


def materialize(store: Path, version: str | None = None) -> Path:
    """``version`` (default: latest) as a model directory in lpx's cache ($LPX_CACHE, else
    ~/.cache/lpx, under weights/), pulled on first use and reused after, so replay and serve
    may ask for it repeatedly."""
    store = Path(store)
    name = _version_name(store, version)
    manifest = load_manifest(store, name)
    key = hashlib.sha256(str(store.resolve()).encode()).hexdigest()[:16]
    target = _cache_root() / "weights" / key / name
    if _is_cached(target, manifest):
        return target
    if target.exists():
        if not (target / CACHE_MARKER).is_file():
            raise BadInput(
                f"{target}: exists and was not written by lpx; move it away or set LPX_CACHE "
                "to another directory. lpx never deletes what it did not create."
            )
        discard(target, target.parent)  # a stale copy: the store's version was replaced
    target.parent.mkdir(parents=True, exist_ok=True)
    temp = target.parent / f".{name}.pulling-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    marker = {
        "store": str(store.resolve()),
        "version": name,
        "fingerprint": manifest["fingerprint"],
    }
    try:
        write_model_dir(store, name, temp, marker)
        try:
            os.rename(temp, target)
        except OSError:
            if not _is_cached(target, manifest):  # another process cached it first: fine
                raise
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    return target


def list_versions(store: Path) -> list[dict]:
    """The announced versions (up to `latest`), oldest first, one summary dict each."""
    store = Path(store)
    latest = latest_name(store)
    if latest is None:
        return []
    newest = load_manifest(store, latest)["number"]
    rows = [
        {
            "name": manifest["name"],
            "number": manifest["number"],
            "kind": manifest["kind"],
            "parent": manifest["parent"],
            "stored_bytes": manifest["stored_bytes"],
            "tensor_bytes": tensor_bytes(manifest),
            "tensors_stored": sum(e["stored"] != "parent" for e in manifest["tensors"].values()),
            "tensors_total": len(manifest["tensors"]),
            "fingerprint": manifest["fingerprint"],
            "created": manifest["created"],
            "is_latest": manifest["name"] == latest,
        }
        for manifest in scan_versions(store)[0]
        if manifest["number"] <= newest
    ]
    return sorted(rows, key=lambda row: row["number"])


def damaged_versions(store: Path) -> dict[str, str]:
    """Version directories whose manifest cannot be read: name -> what is wrong."""
    return scan_versions(Path(store))[1]


def latest_name(store: Path) -> str | None:
    """The name `latest` holds; None before the first version is announced."""
    store = Path(store)
    check_store(store)
    return read_latest(store)


def read_manifest(store: Path, name: str) -> dict:
    """Version ``name``'s manifest.json, checked for the fields lpx relies on."""
    store = Path(store)
    check_store(store)
    return load_manifest(store, name)


def is_store(path: Path) -> bool:
    """Whether ``path`` is a weight store (has lpx-weights-store.json)."""
    return (Path(path) / STORE_FILE).is_file()


class _Source:
    """The model directory being published: its tensors, from every *.safetensors (shards
    too), and its other files, which are copied whole."""

    def __init__(self, model_dir: Path):
        if not (model_dir / "config.json").is_file():
            raise BadInput(
                f"{model_dir}: not a model directory (no config.json); publish the directory "
                "save_pretrained wrote."
            )
        weight_files = sorted(model_dir.glob("*.safetensors"))
        if not weight_files:
            raise BadInput(
                f"{model_dir}: no *.safetensors weights; save the model with "
                "save_pretrained(..., safe_serialization=True) and publish again."
            )
        self.model_dir = model_dir
        self.tensors: dict[str, tuple[SafetensorsFile, TensorSpec]] = {}
        for path in weight_files:
            try:
                weights = SafetensorsFile(path)
            except TensorFileError as error:
                raise BadInput(
                    f"{path}: not a readable safetensors file ({error}); save the model again."
                ) from None
            for tensor, spec in weights.specs.items():
                if tensor in self.tensors:
                    raise BadInput(
                        f"{path}: tensor {tensor!r} is also in "
                        f"{self.tensors[tensor][0].path.name}; leave one copy and publish again."
                    )
                self.tensors[tensor] = (weights, spec)
        self.files = sorted(
            p
            for p in model_dir.iterdir()
            if p.is_file() and not p.name.startswith(".") and not _is_weights(p.name)
        )


def _is_weights(name: str) -> bool:
    """Weight files and shard indexes: a pulled version has one model.safetensors instead."""
    return (
        any(fnmatch(name, pattern) for pattern in WEIGHT_PATTERNS)
        or name.endswith(".index.json")
        or name == VERSION_FILE
    )


def _stage(source, store, staging, name, number, parent, delta, compress) -> dict:
    """Build the version in ``staging``: tensors.safetensors, the files, manifest.json last."""
    staging.mkdir(parents=True)
    entries = {}
    for tensor, (weights, spec) in progress_bar(
        sorted(source.tensors.items()), "hashing", unit="tensor"
    ):
        digest = sha256_hex(weights.raw(tensor))
        entries[tensor] = {"dtype": spec.dtype, "shape": list(spec.shape), "sha256": digest}
    full_reason = None
    same_layout = parent is not None and _layout(parent["tensors"]) == _layout(entries)
    if delta and parent is None:
        full_reason = "there is no earlier version to take a delta from"
    elif delta and not same_layout:
        full_reason = (
            f"its tensor names, shapes or dtypes differ from version {parent['name']}'s "
            f"({_layout_difference(parent['tensors'], entries)})"
        )
    use_delta = delta and full_reason is None
    resolver = Resolver(store) if use_delta and compress else None
    stored: dict[str, tuple[TensorSpec, bytes | memoryview]] = {}
    for tensor, entry in entries.items():
        weights, spec = source.tensors[tensor]
        if use_delta and parent["tensors"][tensor]["sha256"] == entry["sha256"]:
            entry["stored"] = "parent"
            continue
        raw = weights.raw(tensor)
        if resolver is not None:
            blob = xor_compress(raw, resolver.tensor(parent["name"], tensor))
            if len(blob) < spec.nbytes:
                entry["stored"] = "xor-zlib"
                stored[tensor] = (byte_blob(tensor, len(blob)), blob)
                continue
        entry["stored"] = "full"
        stored[tensor] = (spec, raw)
    tensor_file_bytes = write_safetensors(
        staging / TENSORS, [spec for spec, _ in stored.values()], lambda s: stored[s.name][1]
    )
    fsync_file(staging / TENSORS)
    files, file_bytes = _stage_files(source, store, staging, name, parent)
    manifest = {
        "name": name,
        "number": number,
        "parent": parent["name"] if parent else None,
        "kind": "delta" if use_delta else "full",
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "fingerprint": tensor_fingerprint(
            (tensor, as_torch(spec, weights.raw(tensor)))
            for tensor, (weights, spec) in source.tensors.items()
        ),
        "tensors": entries,
        "files": files,
        "stored_bytes": tensor_file_bytes + file_bytes,
        "tensors_changed": (
            sum(parent["tensors"][t]["sha256"] != e["sha256"] for t, e in entries.items())
            if same_layout
            else None
        ),
        "full_reason": full_reason,
        "source": str(source.model_dir.resolve()),
    }
    (staging / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
    fsync_file(staging / MANIFEST)
    fsync_dir(staging)
    return manifest


def _stage_files(source, store, staging, name, parent) -> tuple[dict[str, str], int]:
    """Copy the non-weight files (hard-linking those equal to the parent's, which a delta
    would otherwise store again) and write WEIGHT_VERSION. Returns {file: sha256} and the
    bytes this version holds itself."""
    hashes, held = {}, 0
    for path in source.files:
        target = staging / path.name
        digest = file_sha256(path)
        if parent and parent["files"].get(path.name) == digest:
            try:
                os.link(store / VERSIONS / parent["name"] / path.name, target)
                hashes[path.name] = digest
                continue
            except OSError:  # no hard links on this file system, or the parent's copy is gone
                pass
        hashes[path.name] = copy_hashing(path, target)
        fsync_file(target)
        held += target.stat().st_size
    marker = (name + "\n").encode()
    (staging / VERSION_FILE).write_bytes(marker)
    hashes[VERSION_FILE] = sha256_hex(marker)
    return hashes, held + len(marker)


def _remove_leftovers(store: Path) -> None:
    """What killed publishers left: everything in .staging, and a version directory renamed
    into versions/ whose `latest` never moved (numbered beyond latest's)."""
    for leftover in (store / STAGING).iterdir():
        if leftover.is_dir() and not leftover.is_symlink():
            shutil.rmtree(leftover)
        else:
            leftover.unlink()
    for temp in store.glob(f".{LATEST}.*.tmp"):
        temp.unlink()
    latest = latest_name(store)
    newest = load_manifest(store, latest)["number"] if latest else 0
    unannounced = [m["name"] for m in scan_versions(store)[0] if m["number"] > newest]
    if len(unannounced) > 1:  # a killed publisher leaves one: `latest` was changed by hand
        raise BadInput(
            f"{store}: versions {', '.join(sorted(unannounced))} are all newer than latest "
            f"({latest or 'none'}), more than an interrupted publish leaves; write the newest "
            f"complete version's name into {store / LATEST} and publish again."
        )
    for name in unannounced:
        discard(store / VERSIONS / name, store / STAGING)


def _latest_manifest(store: Path) -> dict | None:
    latest = latest_name(store)
    return load_manifest(store, latest) if latest else None


def _retain(store: Path, keep: int) -> list[str]:
    """Delete versions beyond the newest ``keep``, except those a kept version needs: its
    parents down to a full version."""
    versions = list_versions(store)
    by_name = {v["name"]: v for v in versions}
    needed: set[str] = set()
    for row in versions[-keep:]:
        name = row["name"]
        while name in by_name and name not in needed:
            needed.add(name)
            if by_name[name]["kind"] == "full":
                break
            name = by_name[name]["parent"]
    removed = [v["name"] for v in versions if v["name"] not in needed]
    for name in removed:
        discard(store / VERSIONS / name, store / STAGING)
    return removed


def _version_name(store: Path, version: str | None) -> str:
    """The announced version ``version`` names (None or 'latest': the latest)."""
    latest = latest_name(store)
    if latest is None:
        raise BadInput(f"{store}: no version published yet; publish one with lpx weights publish.")
    if version is None or version == LATEST:
        return latest
    if SAFE_NAME.fullmatch(version) and ".." not in version:
        if (store / VERSIONS / version).is_dir():
            number = load_manifest(store, version)["number"]
            if number <= load_manifest(store, latest)["number"]:
                return version
    names = ", ".join(v["name"] for v in list_versions(store))
    raise BadInput(
        f"{store}: no version {version!r}; it has {names} (latest {latest}). See lpx weights ls."
    )


def _is_cached(target: Path, manifest: dict) -> bool:
    try:
        marker = json.loads((target / CACHE_MARKER).read_text(encoding="utf-8"))
        version = (target / VERSION_FILE).read_text(encoding="utf-8").strip()
    except (OSError, ValueError):
        return False
    return version == manifest["name"] and marker.get("fingerprint") == manifest["fingerprint"]


def _cache_root() -> Path:
    return Path(os.environ.get("LPX_CACHE", Path.home() / ".cache" / "lpx"))


def _layout(tensors: dict) -> dict:
    return {name: (entry["dtype"], list(entry["shape"])) for name, entry in tensors.items()}


def _layout_difference(old: dict, new: dict) -> str:
    before, after = _layout(old), _layout(new)
    for name in sorted(set(before) | set(after)):
        if name not in before:
            return f"{name} is new"
        if name not in after:
            return f"{name} is gone"
        if before[name] != after[name]:
            return f"{name} was {before[name][0]} {before[name][1]}, is {after[name][0]} {after[name][1]}"
    return "same"
