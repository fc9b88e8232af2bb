"""What every engine records of the model it ran and the software it ran with: the model's
identity (weights, tokenizer, chat template), the config it read (and from which files), its generation defaults, and the
versions of the packages that can change a logprob.
"""

from __future__ import annotations

import json
import platform
from pathlib import Path

from pipeline.engines.model_dir import check_model_dir
from pipeline.fingerprint import (
    chat_template_fingerprint,
    tokenizer_fingerprint,
    weights_fingerprint,
)
from pipeline.model_config import (
    config_files,
    numerics_config,
    read_config_file,
    with_overrides,
)


def model_metadata(model_dir: Path, resolved=None) -> dict:
    """What identifies the model: path, architecture, vocabulary, fingerprints of its weight,
    tokenizer and config files, and the config the engine computed with (``resolved``: the
    engine's own config object or dict after its overrides and defaults; else the file's,
    said so in ``config_read_from``)."""
    config = check_model_dir(model_dir)
    built = Path(model_dir) / "lpx-model.json"
    return {
        "path": str(Path(model_dir).resolve()),
        "revision": _built_by_lpx(built),
        "architecture": (config.get("architectures") or ["unknown"])[0],
        "vocab_size": config.get("vocab_size"),
        "weights_fingerprint": weights_fingerprint(model_dir),
        "tokenizer_fingerprint": tokenizer_fingerprint(model_dir),
        "chat_template_fingerprint": chat_template_fingerprint(model_dir),
        # what an engine applies where the request leaves a sampling field unset
        "generation_config": generation_sampling(model_dir),
        "config_files": config_files(model_dir),
        "config": numerics_config(
            file_config_resolved(model_dir) if resolved is None else resolved, config
        ),
        "config_read_from": "file" if resolved is None else "engine",
    }


def file_config_resolved(model_dir: Path, overrides: dict | None = None) -> dict:
    """config.json (with an engine's ``overrides`` merged in) as transformers resolves it:
    its config class fills the defaults and derives what it derives (a Qwen3's layer types
    from ``use_sliding_window`` and ``max_window_layers``, RoPE's parameters from
    ``rope_theta``), so a side read from its file and one read from its engine compare alike.
    The file as it is where transformers does not know the model type."""
    raw = with_overrides(read_config_file(model_dir), overrides or {})
    try:
        from transformers import AutoConfig

        fields = {k: v for k, v in raw.items() if k != "model_type"}
        return AutoConfig.for_model(str(raw.get("model_type")), **fields).to_dict()
    except Exception:  # noqa: BLE001 - an unknown or odd config: the file itself is the record
        return raw


# The fields of generation_config.json that change a logprob when an engine applies them
GENERATION_SAMPLING = (
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
)


def generation_sampling(model_dir) -> dict:
    """The sampling fields a model's generation_config.json sets: what vLLM and SGLang apply
    where a request leaves them unset (vLLM's `--generation-config auto`, SGLang's chat API).
    Empty when there is no such file, or it does not sample (do_sample false)."""
    path = Path(model_dir) / "generation_config.json"
    if not model_dir or not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(config, dict) or config.get("do_sample") is False:
        return {}
    return {k: config[k] for k in GENERATION_SAMPLING if isinstance(config.get(k), int | float)}


def _built_by_lpx(path: Path) -> dict | None:
    """lpx-model.json of a model lpx built, or None (also when it is not a JSON object)."""
    try:
        revision = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return revision if isinstance(revision, dict) else None


def software_versions(device: str = "cpu") -> dict:
    """lpx and the stack it scored with; on a GPU also CUDA, cuDNN, NCCL and the driver."""
    import numpy
    import torch
    import transformers

    from pipeline import __version__
    from pipeline.devices import stack_versions

    return {
        "lpx": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "numpy": numpy.__version__,
        **{name: value for name, value in stack_versions(device).items() if value},
    }
