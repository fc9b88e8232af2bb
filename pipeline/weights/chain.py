"""Reading a version back: tensors resolved through the parent chain and checked against
their sha256, and the whole version written out as a Hugging Face model directory."""

from __future__ import annotations

import json
from pathlib import Path

from pipeline.errors import BadInput
from pipeline.fingerprint import tensor_fingerprint
from pipeline.weights.layout import (
    MANIFEST,
    TENSORS,
    VERSIONS,
    copy_hashing,
    load_manifest,
)
from pipeline.weights.tensors import (
    SafetensorsFile,
    TensorFileError,
    TensorSpec,
    as_torch,
    byte_blob,
    sha256_hex,
    write_safetensors,
    xor_decompress,
)

PULLED_WEIGHTS = "model.safetensors"
CACHE_MARKER = ".lpx-weights.json"


class Resolver:
    """Any version's tensors as raw bytes: `parent` entries are followed down the chain and
    `xor-zlib` blobs applied on the way back up, each step checked against its sha256."""

    def __init__(self, store: Path):
        self.store = store
        self._manifests: dict[str, dict] = {}
        self._files: dict[str, SafetensorsFile] = {}

    def tensor(self, version: str, tensor: str) -> bytes | memoryview:
        layers = []  # (version, its entry, its xor-zlib blob), newest first
        holder = version
        while True:
            entry = self._entry(holder, tensor)
            if entry["stored"] == "parent":
                holder = self._parent(holder, tensor)
                continue
            data = self._stored(holder, tensor, entry)
            if entry["stored"] == "full":
                break
            layers.append((holder, entry, data))
            holder = self._parent(holder, tensor)
        self._check(holder, tensor, entry, data)
        for layer, entry, blob in reversed(layers):
            try:
                data = xor_decompress(blob, data)
            except ValueError as error:
                raise BadInput(self._damaged(layer, tensor, str(error))) from None
            self._check(layer, tensor, entry, data)
        if entry["sha256"] != self._entry(version, tensor)["sha256"]:
            what = "its manifest says unchanged from an older version whose sha256 differs"
            raise BadInput(self._damaged(version, tensor, what))
        return data

    def _entry(self, version: str, tensor: str) -> dict:
        if version not in self._manifests:
            self._manifests[version] = load_manifest(self.store, version)
        entry = self._manifests[version]["tensors"].get(tensor)
        if entry is None:
            raise BadInput(
                f"{self.store}: version {version} has no tensor {tensor!r} in its manifest, "
                "though a newer version takes it from there; the chain is damaged: pull "
                "another version or publish a full one."
            )
        return entry

    def _parent(self, version: str, tensor: str) -> str:
        parent = self._manifests[version]["parent"]
        if parent is None or not (self.store / VERSIONS / parent / MANIFEST).is_file():
            raise BadInput(
                f"{self.store}: version {version} takes tensor {tensor!r} from its parent "
                f"{parent}, which is not in the store (deleted by hand?); the chain is broken: "
                "pull a version whose chain is complete (lpx weights ls) or publish a full one."
            )
        return parent

    def _stored(self, version: str, tensor: str, entry: dict) -> memoryview:
        path = self.store / VERSIONS / version / TENSORS
        if version not in self._files:
            try:
                self._files[version] = SafetensorsFile(path)
            except FileNotFoundError:
                raise BadInput(
                    f"{path}: missing; version {version} is incomplete: pull another version "
                    "or publish it again."
                ) from None
            except TensorFileError as error:
                raise BadInput(self._damaged(version, tensor, str(error))) from None
        stored = self._files[version].specs.get(tensor)
        if stored is None:
            raise BadInput(
                f"{path}: has no tensor {tensor!r}, which version {version}'s manifest stores "
                "there; the version is incomplete: pull another version or publish it again."
            )
        if entry["stored"] == "xor-zlib":
            expected = byte_blob(tensor, stored.nbytes)
        else:
            expected = TensorSpec(tensor, entry["dtype"], tuple(entry["shape"]))
        if stored != expected:
            raise BadInput(
                self._damaged(version, tensor, "its dtype or shape is not the manifest's")
            )
        return self._files[version].raw(tensor)

    def _check(self, version: str, tensor: str, entry: dict, data) -> None:
        if sha256_hex(data) != entry["sha256"]:
            raise BadInput(
                self._damaged(version, tensor, "its bytes do not match the manifest's sha256")
            )

    def _damaged(self, version: str, tensor: str, what: str) -> str:
        return (
            f"{self.store / VERSIONS / version / TENSORS}: tensor {tensor!r}: {what} (changed or "
            "damaged after publishing); pull another version, or publish these weights again."
        )


def write_model_dir(store: Path, name: str, out: Path, marker: dict | None = None) -> None:
    manifest = load_manifest(store, name)
    resolver = Resolver(store)
    out.mkdir()
    specs = [TensorSpec(t, e["dtype"], tuple(e["shape"])) for t, e in manifest["tensors"].items()]
    write_safetensors(
        out / PULLED_WEIGHTS,
        specs,
        lambda spec: resolver.tensor(name, spec.name),
        metadata={"format": "pt"},  # transformers refuses safetensors without it
        progress=f"pulling version {name}",
    )
    version_dir = store / VERSIONS / name
    for file, digest in manifest["files"].items():
        if not (version_dir / file).is_file():
            raise BadInput(
                f"{version_dir / file}: missing; version {name} is incomplete: pull another "
                "version or publish it again."
            )
        if copy_hashing(version_dir / file, out / file) != digest:
            raise BadInput(
                f"{version_dir / file}: does not match the sha256 in version {name}'s manifest "
                "(changed or damaged after publishing); pull another version, or publish it again."
            )
    written = SafetensorsFile(out / PULLED_WEIGHTS)
    fingerprint = tensor_fingerprint(
        (tensor, as_torch(spec, written.raw(tensor))) for tensor, spec in written.specs.items()
    )
    if fingerprint != manifest["fingerprint"]:
        raise BadInput(
            f"{version_dir / MANIFEST}: the pulled weights' fingerprint {fingerprint[:19]} is "
            f"not the manifest's {manifest['fingerprint'][:19]}; the version is damaged: pull "
            "another version, or publish it again."
        )
    if marker:
        (out / CACHE_MARKER).write_text(json.dumps(marker) + "\n", encoding="utf-8")
