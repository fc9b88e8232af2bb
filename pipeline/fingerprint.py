"""Fingerprints that tell whether two runs used the same weights, tokenizer and prompts."""

from __future__ import annotations

import hashlib
import json
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


def chat_template_fingerprint(model_dir: Path) -> str:
    """sha256 over the model's chat templates, by name, wherever its tokenizer keeps them:
    ``chat_template.jinja`` and ``additional_chat_templates/`` (transformers 5) or the
    ``chat_template`` key of tokenizer_config.json (earlier releases). The same templates give
    the same fingerprint in either layout. Apart from the tokenizer's: a template decides what
    ids an agent loop renders, not how ids score, so only agent-loop series are keyed by it."""
    templates = _chat_templates(Path(model_dir))
    if not templates:
        return "none"
    encoded = json.dumps(sorted(templates.items()), ensure_ascii=False).encode()
    return "sha256:" + hashlib.sha256(encoded).hexdigest()


def _chat_templates(model_dir: Path) -> dict[str, str]:
    templates: dict[str, str] = {}
    try:
        config = json.loads((model_dir / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        config = {}
    kept = config.get("chat_template") if isinstance(config, dict) else None
    if isinstance(kept, str):
        templates["default"] = kept
    elif isinstance(kept, list):  # [{"name": ..., "template": ...}]
        for entry in kept:
            if isinstance(entry, dict) and isinstance(entry.get("template"), str):
                templates[str(entry.get("name", "default"))] = entry["template"]
    if (model_dir / "chat_template.jinja").is_file():
        templates["default"] = (model_dir / "chat_template.jinja").read_text()
    for extra in sorted((model_dir / "additional_chat_templates").glob("*.jinja")):
        templates[extra.stem] = extra.read_text()
    return templates


def _hash_files(files: list[Path]) -> str:
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.name.encode())
        with open(path, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
    return "sha256:" + digest.hexdigest()


def tensor_fingerprint(named_tensors) -> str:
    """sha256 over (name, shape, float32 values) in name order: the same for the same weights
    however they were stored, sharded or cast on the way (an fp32 copy of bf16 is exact)."""
    import numpy as np

    digest = hashlib.sha256()
    for name, tensor in sorted(named_tensors, key=lambda item: item[0]):
        values = tensor.detach().float().cpu().numpy()
        digest.update(name.encode())
        digest.update(np.asarray(values.shape, dtype=np.int64).tobytes())
        digest.update(np.ascontiguousarray(values).tobytes())
    return "sha256:" + digest.hexdigest()


def prompt_set_fingerprint(table) -> str:
    """sha256 over a token table's prompts (offsets, then ids, as int64) in sequence order:
    the run history's prompt set. Compare records it in report.json and `lpx localize
    --report` checks a fixture against it (belonging.py), so both must read the same bytes."""
    import numpy as np

    digest = hashlib.sha256(np.asarray(table.prompt_offsets, dtype=np.int64).tobytes())
    digest.update(np.asarray(table.prompt_ids, dtype=np.int64).tobytes())
    return "sha256:" + digest.hexdigest()
