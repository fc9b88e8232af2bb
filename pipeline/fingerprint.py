"""Fingerprints that tell whether two runs used the same weights and tokenizer."""

from __future__ import annotations

import hashlib
from pathlib import Path

WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.pt")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
)


def weights_fingerprint(model_dir: Path) -> str:
    """sha256 over the weight files' names and bytes, in name order."""
    files = sorted({p for pattern in WEIGHT_PATTERNS for p in Path(model_dir).glob(pattern)})
    return _hash_files(files) if files else "none"


def tokenizer_fingerprint(model_dir: Path) -> str:
    files = [
        Path(model_dir) / name for name in TOKENIZER_FILES if (Path(model_dir) / name).is_file()
    ]
    return _hash_files(files) if files else "none"


def _hash_files(files: list[Path]) -> str:
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.name.encode())
        with open(path, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
    return "sha256:" + digest.hexdigest()
