"""The capture wire format shared by `lpx serve`'s /capture and localize's server adapter: an
array as JSON (dtype, shape, base64 row-major little-endian bytes). Here, in localize, so
that serve imports localize and never the other way round."""

from __future__ import annotations

import base64

import numpy as np

ARRAY_DTYPES = ("float32", "float64", "int64")


def encode_rows(rows: np.ndarray) -> dict:
    """An array as JSON: dtype, shape and base64 little-endian bytes."""
    dtype = np.dtype(rows.dtype)
    name = "int64" if dtype.kind in "iu" else "float64" if dtype == np.float64 else "float32"
    array = np.ascontiguousarray(rows, dtype=np.dtype(name).newbyteorder("<"))
    return {
        "dtype": name,
        "shape": list(array.shape),
        "data": base64.b64encode(array.tobytes()).decode("ascii"),
    }


def decode_rows(value: dict) -> np.ndarray:
    """The array `encode_rows` wrote; ValueError saying what does not fit."""
    dtype, shape = value["dtype"], tuple(int(n) for n in value["shape"])
    if dtype not in ARRAY_DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {', '.join(ARRAY_DTYPES)}")
    raw = base64.b64decode(value["data"], validate=True)
    expected = int(np.prod(shape)) * np.dtype(dtype).itemsize
    if len(raw) != expected:
        raise ValueError(f"{len(raw)} bytes of data; shape {list(shape)} of {dtype} is {expected}")
    return np.frombuffer(raw, dtype=np.dtype(dtype).newbyteorder("<")).astype(dtype).reshape(shape)
