"""The reduced-precision numerics a vLLM engine actually runs, read from its worker's layers
(not from the config it was given): which linear layers hold FP8 or INT8 weights, at what
granularity their weights and activations are scaled (vLLM's own quant keys), whether the
kernel quantizes the activations at all (a W8A16 kernel does not), and the dtype and scales
of each attention layer's KV cache, with the cache tensor's own dtype (a release that falls
back to a bf16 cache under chunked prefill or prefix caching says so only there).

`read_numerics` runs in the worker (`collective_rpc`); `numerics_of` turns its answer into
lpx's `Numerics` (pipeline/contracts/numerics.py) on the driver.
"""

from __future__ import annotations

import re

from pipeline.contracts.numerics import (
    KVCacheQuantization,
    LinearQuantization,
    Numerics,
)

# vLLM's GroupShape (rows, columns) of a scale -> lpx's granularity
WEIGHT_SHAPES = {(-1, -1): "tensor", (-1, 1): "channel", (128, 128): "block128", (1, 32): "mx32"}
ACTIVATION_SHAPES = {(-1, -1): "tensor", (1, -1): "token", (1, 128): "group128", (1, 32): "mx32"}
_LAYER = re.compile(r"\blayers\.(\d+)\.")
# FP4 quantization methods (ModelOpt's NVFP4, OCP MXFP4: their weights packed two to a
# byte) by what their class names hold, lowercased -> the block granularity
FP4_METHODS = {"nvfp4": "nv16", "mxfp4": "mx32"}


def read_numerics(worker) -> dict:
    """In the worker: what its model's layers compute with (plain values only)."""
    model = worker.model_runner.model
    layers: dict[int, bool] = {}
    linear, head, embeddings, router = None, False, False, False
    parts: set[str] = set()  # which kinds of layer hold quantized weights
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if method is None:
            continue
        quantized = "Unquantized" not in type(method).__name__
        kind = type(module).__name__
        if "LMHead" in kind:
            head = quantized
            continue
        if "Embedding" in kind:
            embeddings = quantized
            continue
        if name.rsplit(".", 1)[-1] == "gate" and "mlp" in name:
            router = router or quantized
            continue
        match = _LAYER.search(name)
        if match is None or "Linear" not in kind and "MoE" not in kind:
            continue
        index = int(match.group(1))
        layers[index] = layers.get(index, False) or quantized
        if quantized:
            parts.add("experts" if "MoE" in kind else "attention" if "attn" in name else "mlp")
        if quantized and linear is None:
            linear = _linear(module, method)
    return {
        "linear": linear,
        "layers": {str(k): v for k, v in sorted(layers.items())},
        "lm_head": head,
        "embeddings": embeddings,
        "router": router,
        "parts": sorted(parts),
        "kv_cache": _kv_caches(worker),
    }


def _linear(module, method) -> dict:
    kernel = getattr(method, "fp8_linear", None) or getattr(method, "kernel", None)
    weight = getattr(module, "weight", None)
    return {
        "method": type(method).__name__,
        "kernel": type(kernel).__name__ if kernel is not None else None,
        "weight_dtype": str(getattr(weight, "dtype", "")).removeprefix("torch."),
        "weights": _shape(getattr(method, "weight_quant_key", None)),
        "activations": _shape(getattr(method, "activation_quant_key", None)),
        # a W8A16 kernel (vLLM-CPU's AMX block kernel, Marlin) takes the activations as they are
        "quantizes_input": bool(getattr(kernel, "apply_input_quant", True)),
    }


def _shape(key) -> list[int] | None:
    scale = getattr(key, "scale", None)
    shape = getattr(scale, "group_shape", None)
    return None if shape is None else [int(shape[0]), int(shape[1])]


def _kv_caches(worker) -> list[dict]:
    context = worker.model_runner.vllm_config.compilation_config.static_forward_context
    found = []
    for name, layer in context.items():
        if not hasattr(layer, "kv_cache_dtype"):
            continue
        cache = layer.kv_cache
        cache = cache[0] if isinstance(cache, list | tuple) else cache
        found.append(
            {
                "layer": name,
                "dtype": str(layer.kv_cache_dtype),
                "tensor": str(getattr(cache, "dtype", "")).removeprefix("torch."),
                "k_scale": float(getattr(layer, "_k_scale_float", 1.0)),
                "v_scale": float(getattr(layer, "_v_scale_float", 1.0)),
            }
        )
    return found


def numerics_of(read: dict, model_dtype: str, device: str = "cuda") -> Numerics:
    """lpx's numerics for what the worker read (the first worker's: ranks agree). vLLM's CPU
    attention stores its FP8 KV cache by cutting the mantissa (csrc/cpu/cpu_attn_fp8.hpp;
    measured: every stored byte of 0.32.0 agrees), its CUDA kernels round to nearest."""
    rounding = "toward_zero" if device == "cpu" else "nearest"
    return Numerics(_linear_numerics(read), _kv_numerics(read, model_dtype, rounding))


def _linear_numerics(read: dict) -> LinearQuantization | None:
    linear = read.get("linear")
    if not linear:
        return None
    element = {"float8_e4m3fn": "fp8_e4m3", "float8_e5m2": "fp8_e5m2", "int8": "int8"}.get(
        linear["weight_dtype"]
    )
    weights = WEIGHT_SHAPES.get(tuple(linear["weights"] or (-1, -1)))
    activations = ACTIVATION_SHAPES.get(tuple(linear["activations"] or (-1, -1)))
    fp4 = next((g for key, g in FP4_METHODS.items() if key in linear["method"].lower()), None)
    if fp4 is not None:  # packed E2M1 (uint8 storage): the method names the block format
        element, weights, activations = "fp4_e2m1", fp4, fp4
    if element is None or weights is None or activations is None:
        raise ValueError(
            f"vLLM runs {linear['method']} ({linear['weight_dtype']} weights, weight scale "
            f"groups {linear['weights']}, activation groups {linear['activations']}), which "
            "lpx cannot name"
        )
    if not linear["quantizes_input"]:
        activations = "none"
    layers = [read["layers"][k] for k in sorted(read["layers"], key=int)]
    keep_first = next((i for i, q in enumerate(layers) if q), len(layers))
    keep_last = next((i for i, q in enumerate(reversed(layers)) if q), 0)
    too = tuple(name for name in ("lm_head", "embeddings", "router") if read.get(name))
    parts = set(read.get("parts") or ())
    # attention kept (MLPs, dense or experts, quantized), or the routed experts alone
    only = ""
    if parts == {"experts"}:
        only = "experts"
    elif parts and "attention" not in parts:
        only = "mlp"
    return LinearQuantization(
        element, weights, activations, "ue8m0" if "mx32" in (weights, activations) else "float",
        keep_first, keep_last, too, only,
    )  # fmt: skip


def _kv_numerics(read: dict, model_dtype: str, rounding: str) -> KVCacheQuantization | None:
    caches = read.get("kv_cache") or []
    stored = [c for c in caches if c["dtype"].startswith("fp8") and c["tensor"] != model_dtype]
    if not stored:
        return None
    first = stored[0]
    element = "fp8_e5m2" if first["dtype"] == "fp8_e5m2" else "fp8_e4m3"
    return KVCacheQuantization(element, first["k_scale"], first["v_scale"], rounding)
