"""Loading a Hugging Face checkpoint and the logit processing shared by HF rollout and replay."""

from __future__ import annotations

from pathlib import Path

from pipeline.contracts.numerics import Numerics
from pipeline.engines.model_dir import check_model_dir
from pipeline.errors import BadInput

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
