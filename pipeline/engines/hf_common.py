"""Loading a Hugging Face checkpoint and the logit processing shared by HF rollout and replay."""

from __future__ import annotations

import json
import platform
from pathlib import Path

from pipeline.contracts.numerics import Numerics
from pipeline.engines.model_dir import check_model_dir
from pipeline.errors import BadInput
from pipeline.fingerprint import tokenizer_fingerprint, weights_fingerprint
from pipeline.model_config import (
    config_files,
    numerics_config,
    read_config_file,
    with_overrides,
)

ATTENTION_IMPLEMENTATIONS = ("sdpa", "eager")


def torch_dtype(name: str):
    import torch

    return {
        "float64": torch.float64,  # fp32's own reference (lpx calibrate), never an engine dtype
        "float32": torch.float32,
        "bfloat16": torch.bfloat16,
        "float16": torch.float16,
    }[name]


def load_model(
    model_dir: Path,
    dtype: str = "float32",
    attn_implementation: str = "sdpa",
    device: str = "cpu",
    numerics: Numerics | None = None,
):
    """Load a causal LM for inference from a local directory (never from a hub), on
    ``device`` (a resolved device: cpu or cuda:N), computing with reduced-precision
    ``numerics`` where given (pipeline/numerics/emulate.py)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    check_model_dir(model_dir)
    if attn_implementation not in ATTENTION_IMPLEMENTATIONS:
        raise BadInput(
            f"attention implementation {attn_implementation!r} is not available on this engine; "
            f"use one of {', '.join(ATTENTION_IMPLEMENTATIONS)}."
        )
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(model_dir),
            dtype=torch_dtype(dtype),
            attn_implementation=attn_implementation,
            local_files_only=True,
            # grouped-GEMM experts have no fp64 kernel; the fp64 reference loops over experts
            **({"experts_implementation": "eager"} if dtype == "float64" else {}),
        )
    except (OSError, ValueError, KeyError, TypeError, RuntimeError) as error:
        # The checks above passed, so the files are there but do not fit together (a config
        # for another architecture, weights of another shape, an unknown model_type).
        first = (str(error).strip().splitlines() or [type(error).__name__])[0][:300]
        raise BadInput(
            f"{model_dir}: transformers cannot load this model ({first}); check that config.json "
            "and the weight files belong to the same checkpoint."
        ) from None
    model.eval()
    model.requires_grad_(False)  # scoring never needs gradients
    model = model.to(device) if device != "cpu" else model
    if numerics:
        from pipeline.numerics.emulate import apply_numerics

        try:
            apply_numerics(model, numerics)
        except ValueError as error:
            raise BadInput(f"{model_dir}: cannot compute in {numerics.label}: {error}") from None
    return model


def numerics_from_knobs(engine: str, quantization: str, kv_cache_dtype: str, kv_scales: str):
    """The numerics an HF-built engine's knobs ask for (presets and texts:
    pipeline/contracts/numerics.py); BadInput naming the knob."""
    from pipeline.contracts.numerics import (
        Numerics,
        parse_kv_cache,
        parse_kv_scales,
        parse_quantization,
    )

    try:
        linear = parse_quantization(quantization)
    except ValueError as error:
        raise BadInput(f"{engine} knob quantization: {error}") from None
    try:
        k_scale, v_scale = (
            parse_kv_scales(kv_scales, f"{engine} knob kv_scales={kv_scales!r}")
            if str(kv_scales or "").strip()
            else (1.0, 1.0)
        )
    except ValueError as error:
        raise BadInput(str(error)) from None
    try:
        kv_cache = parse_kv_cache(kv_cache_dtype, k_scale, v_scale)
    except ValueError as error:
        raise BadInput(f"{engine} knob kv_cache_dtype/kv_scales: {error}") from None
    if kv_cache is None and str(kv_scales or "").strip():
        raise BadInput(f"{engine} knob kv_scales needs an FP8 kv_cache_dtype (fp8_e4m3, fp8_e5m2).")
    return Numerics(linear, kv_cache)


def numerics_metadata(model) -> dict:
    """What a side records of the numerics its model computed with (``metadata.numerics``),
    read from the model itself; empty for plain dtype arithmetic."""
    numerics = getattr(model, "lpx_numerics", None)
    if not numerics:
        return {}
    return {"numerics": {**numerics.as_dict(), "computed_by": "lpx emulation (pipeline/numerics)"}}


def model_device(model):
    """The device a (possibly sharded) model computes on: where its inputs must be made."""
    for parameter in model.parameters():
        return parameter.device
    import torch

    return torch.device("cpu")


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


def process_logits(logits, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0):
    """Apply temperature, then top-k, then top-p (vLLM's order) to fp32 logits [..., vocab]."""
    import torch

    if temperature != 1.0:
        logits = logits / temperature
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        # Keep a token while the mass before it is below top_p (the top token always stays).
        drop_sorted = (cumulative - sorted_logits.softmax(-1)) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits
