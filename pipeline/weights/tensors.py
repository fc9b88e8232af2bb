"""Tensors as raw bytes: a small safetensors reader and streaming writer, hashing, the
xor-zlib delta encoding and the torch view the weights fingerprint is taken over."""

from __future__ import annotations

import hashlib
import json
import math
import mmap
import struct
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from pipeline.progress import progress_bar

ITEM_SIZES = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U64": 8,
    "U32": 4,
    "U16": 2,
    "U8": 1,
    "BOOL": 1,
}
HEADER_LIMIT = 100 << 20  # safetensors' own cap on the JSON header
ZLIB_LEVEL = 1  # the XOR's random low bytes compress at no level: 6 saves <1 % more, 3x slower


class TensorFileError(ValueError):
    """A safetensors file that cannot be read as one; callers say which file and what to do."""


@dataclass(frozen=True)
class TensorSpec:
    """A tensor's place in a safetensors file: name, dtype (safetensors' spelling), shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return ITEM_SIZES[self.dtype] * math.prod(self.shape)


def byte_blob(name: str, size: int) -> TensorSpec:
    """A 1-D uint8 tensor that holds an encoded blob (xor-zlib)."""
    return TensorSpec(name, "U8", (size,))


class SafetensorsFile:
    """A safetensors file mapped into memory: each tensor's spec and its raw bytes, no copy."""

    def __init__(self, path: Path):
        self.path = Path(path)
        with open(self.path, "rb") as handle:
            prefix = handle.read(8)
            if len(prefix) < 8:
                raise TensorFileError("shorter than a safetensors header")
            (header_size,) = struct.unpack("<Q", prefix)
            if header_size > HEADER_LIMIT:
                raise TensorFileError(f"header claims {header_size} bytes")
            try:
                header = json.loads(handle.read(header_size))
            except (UnicodeDecodeError, json.JSONDecodeError) as error:
                raise TensorFileError(f"header is not JSON ({error})") from None
            size = handle.seek(0, 2)
            # A private mapping is writable, so torch.frombuffer views it without a warning;
            # nothing ever writes to it.
            self._map = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)
        if not isinstance(header, dict):
            raise TensorFileError("header is not a JSON object")
        self.metadata = header.pop("__metadata__", None) or {}
        start = 8 + header_size
        self.specs: dict[str, TensorSpec] = {}
        self._ranges: dict[str, tuple[int, int]] = {}
        for name, entry in header.items():
            try:
                spec = TensorSpec(name, entry["dtype"], tuple(int(d) for d in entry["shape"]))
                begin, end = (int(o) for o in entry["data_offsets"])
            except (KeyError, TypeError, ValueError):
                raise TensorFileError(f"tensor {name!r} has a malformed header entry") from None
            if spec.dtype not in ITEM_SIZES:
                raise TensorFileError(f"tensor {name!r} has unsupported dtype {spec.dtype!r}")
            if not 0 <= begin <= end or start + end > size or end - begin != spec.nbytes:
                raise TensorFileError(
                    f"tensor {name!r}: its bytes [{begin}, {end}) do not fit the file or its "
                    f"{spec.dtype} {list(spec.shape)} shape (truncated?)"
                )
            self.specs[name] = spec
            self._ranges[name] = (start + begin, start + end)

    def raw(self, name: str) -> memoryview:
        begin, end = self._ranges[name]
        return memoryview(self._map)[begin:end]


def write_safetensors(
    path: Path,
    specs: Iterable[TensorSpec],
    data_for: Callable[[TensorSpec], bytes | memoryview],
    metadata: dict[str, str] | None = None,
    progress: str | None = None,
) -> int:
    """Write a safetensors file tensor by tensor: ``data_for(spec)`` gives each tensor's raw
    bytes when it is written, so only one tensor is held at a time. Returns the file's size.
    Tensors go widest dtype first, then by name, so every tensor is aligned to its item size
    (what the safetensors library does too)."""
    ordered = sorted(specs, key=lambda s: (-ITEM_SIZES[s.dtype], s.name))
    header: dict = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for spec in ordered:
        header[spec.name] = {
            "dtype": spec.dtype,
            "shape": list(spec.shape),
            "data_offsets": [offset, offset + spec.nbytes],
        }
        offset += spec.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    with open(path, "wb") as handle:
        handle.write(struct.pack("<Q", len(encoded)) + encoded)
        for spec in progress_bar(ordered, progress or "", unit="tensor") if progress else ordered:
            data = data_for(spec)
            if len(data) != spec.nbytes:
                raise TensorFileError(
                    f"tensor {spec.name!r}: got {len(data)} bytes for {spec.dtype} "
                    f"{list(spec.shape)} ({spec.nbytes} bytes)"
                )
            handle.write(data)
        handle.flush()
        return handle.tell()


def sha256_hex(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def xor_compress(new: bytes | memoryview, old: bytes | memoryview) -> bytes:
    """zlib(new XOR old): a small update leaves sign and exponent bytes equal, so the XOR is
    mostly zero bytes there and compresses; exactly reversible by :func:`xor_decompress`."""
    import numpy as np

    flipped = np.bitwise_xor(np.frombuffer(new, np.uint8), np.frombuffer(old, np.uint8))
    return zlib.compress(flipped, ZLIB_LEVEL)


def xor_decompress(blob: bytes | memoryview, old: bytes | memoryview) -> bytes:
    """The new bytes from an xor-zlib blob and the old bytes; ValueError if it is damaged."""
    import numpy as np

    try:
        flipped = zlib.decompress(blob)
    except zlib.error as error:
        raise ValueError(f"the blob does not decompress ({error})") from None
    if len(flipped) != len(old):
        raise ValueError(f"the blob holds {len(flipped)} bytes, the tensor {len(old)}")
    return np.bitwise_xor(np.frombuffer(flipped, np.uint8), np.frombuffer(old, np.uint8)).tobytes()


def as_torch(spec: TensorSpec, data: bytes | memoryview):
    """A torch tensor over ``data`` (no copy when the bytes are aligned to the item size)."""
    import torch

    dtype = _torch_dtype(spec.dtype)
    if spec.nbytes == 0:
        return torch.empty(spec.shape, dtype=dtype)
    view = memoryview(data)
    if not view.readonly and _address(view) % ITEM_SIZES[spec.dtype] == 0:
        return torch.frombuffer(view, dtype=dtype).reshape(spec.shape)
    return torch.frombuffer(bytearray(view), dtype=dtype).reshape(spec.shape)


def _address(view: memoryview) -> int:
    import numpy as np

    return np.frombuffer(view, np.uint8).ctypes.data


def _torch_dtype(name: str):
    import torch

    return {
        "F64": torch.float64,
        "F32": torch.float32,
        "F16": torch.float16,
        "BF16": torch.bfloat16,
        "F8_E4M3": torch.float8_e4m3fn,
        "F8_E5M2": torch.float8_e5m2,
        "I64": torch.int64,
        "I32": torch.int32,
        "I16": torch.int16,
        "I8": torch.int8,
        "U64": torch.uint64,
        "U32": torch.uint32,
        "U16": torch.uint16,
        "U8": torch.uint8,
        "BOOL": torch.bool,
    }[name]
