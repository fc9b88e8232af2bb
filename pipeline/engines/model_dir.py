"""A local model directory, checked before any engine loads it.

Engines fail on an incomplete or corrupt checkpoint with errors that do not name the file
(a KeyError in a config class, a safetensors deserialisation error, a shape mismatch), so
the parts every engine reads are checked here first: config.json, the weight files and,
where they are needed, the tokenizer files.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from pipeline.errors import BadInput

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
FIX = "pass a complete local Hugging Face model directory (build a tiny one with `lpx make-model DIR`)"


def check_model_dir(model_dir: Path, need_tokenizer: bool = False) -> dict:
    """Return the parsed config.json, or raise BadInput naming the file that is missing or bad."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise BadInput(f"{model_dir}: no such model directory; {FIX}.")
    config = _config(model_dir)
    weights = [p for p in sorted(model_dir.iterdir()) if p.suffix in WEIGHT_SUFFIXES]
    if not weights:
        raise BadInput(f"{model_dir}: no weight files (*.safetensors, *.bin); {FIX}.")
    for path in weights:
        if path.suffix == ".safetensors":
            _check_safetensors(path)
    if need_tokenizer and not any((model_dir / name).is_file() for name in TOKENIZER_FILES):
        raise BadInput(
            f"{model_dir}: no tokenizer ({', '.join(TOKENIZER_FILES)}); text prompts need one. "
            "Give prompts as token ids, or use a model directory with its tokenizer."
        )
    return config


def _config(model_dir: Path) -> dict:
    path = model_dir / "config.json"
    if not path.is_file():
        raise BadInput(f"{model_dir}: no config.json; {FIX}.")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError) as error:
        raise BadInput(
            f"{path}: not valid JSON ({error}); the model directory is corrupt."
        ) from None
    if not isinstance(config, dict):
        raise BadInput(f"{path}: not a JSON object; the model directory is corrupt.")
    vocab = config.get("vocab_size")
    if vocab is not None and (isinstance(vocab, bool) or not isinstance(vocab, int) or vocab <= 0):
        raise BadInput(f"{path}: vocab_size {vocab!r} is not a positive integer.")
    architectures = config.get("architectures")
    if architectures is not None and not (
        isinstance(architectures, list) and all(isinstance(a, str) for a in architectures)
    ):
        raise BadInput(f"{path}: architectures {architectures!r} is not a list of class names.")
    if not isinstance(config.get("model_type"), str):
        raise BadInput(f'{path}: no model_type (e.g. "llama"); {FIX}.')
    return config


def _check_safetensors(path: Path) -> None:
    """A safetensors file starts with an 8-byte header length and a JSON header; a truncated
    or overwritten file fails here with its name instead of deep inside a loader."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            if length > size - 8:
                raise ValueError("header longer than the file")
            header = json.loads(handle.read(length))
        end = max(
            (int(t["data_offsets"][1]) for n, t in header.items() if n != "__metadata__"),
            default=0,
        )
        if 8 + length + end > size:
            raise ValueError(f"tensor data ends at byte {8 + length + end} of {size}")
    except (struct.error, ValueError, TypeError, KeyError, IndexError, AttributeError) as error:
        raise BadInput(
            f"{path}: not a readable safetensors file ({error or 'too short'}); the download or "
            "copy is truncated or corrupt."
        ) from None
