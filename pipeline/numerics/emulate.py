"""A Hugging Face model made to compute with reduced-precision numerics, as an engine does:
its linear layers' weights and inputs quantized (`formats.py`), its KV cache stored in FP8.

What a quantized linear computes: y = Q(x) @ Q(W)^T (+ b), the products summed in float32 and
the result cast to the model's dtype, which is what an FP8 or INT8 GEMM with float32
accumulation and scales applied to the accumulator gives; weight-only (``a=none``, W8A16)
multiplies the activations as they are by the dequantized weights in the model's dtype. Where
an engine fuses layers (q, k and v into one qkv matrix; gate and up into one), a per-tensor
scale is shared by the fused layers, as quantizing the fused matrix gives.

Which layers: every linear layer of the decoder layers outside ``keep_first``/``keep_last``
(attention, MLP, MoE experts, shared experts), and the LM head, the embeddings and the MoE
routers only where the spec names them (engines keep them; vLLM quantizes Qwen3-MoE's router
unless told not to). A router module of its own (transformers' TopKRouter) has its weight
quantized only: its input stays as it is. Norms are never quantized.

The KV cache: keys (after the rotary embedding) and values are rounded to FP8 under their
scales where attention reads them; every key and value a token attends to has been through
the cache, so a teacher-forced prefill computes what decoding from the cache does. The
parameters are not changed (but a router's weight, which `remove_numerics` puts back): the
quantized forward holds its own dequantized copy (a tied LM head and embedding stay tied).
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from pipeline.contracts.numerics import KVCacheQuantization, LinearQuantization, Numerics
from pipeline.numerics.formats import (
    float_scale,
    quantize_dequantize,
    round_to_element,
    truncate_to_element,
)

# Linear layers an engine fuses into one matrix (one per-tensor scale for the group)
FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
ROUTER_NAMES = ("gate", "router", "shared_expert_gate")
KV_ATTENTION = {"sdpa": "lpx_kv_sdpa", "eager": "lpx_kv_eager"}


def apply_numerics(model, numerics: Numerics | None):
    """``model`` computing with ``numerics`` (in place; returned for chaining). Call it after
    the model is in its dtype and on its device: the quantized copies are made from there."""
    if not numerics:
        return model
    if numerics.linear is not None:
        _quantize_linear_layers(model, numerics.linear)
    if numerics.kv_cache is not None:
        _quantize_kv_cache(model, numerics.kv_cache)
    model.lpx_numerics = numerics
    return model


def remove_numerics(model):
    """``model`` computing in its plain dtype again (what `apply_numerics` patched, undone)."""
    numerics = getattr(model, "lpx_numerics", None)
    if not numerics:
        return model
    for module in model.modules():
        if isinstance(module.__dict__.get("forward"), _QuantizedLinear | _QuantizedEmbedding
                      | _QuantizedExperts):  # fmt: skip
            del module.forward
        if "lpx_kv_cache" in module.__dict__:
            del module.lpx_kv_cache
        if "lpx_original_weight" in module.__dict__:
            module.weight.data = module.lpx_original_weight
            del module.lpx_original_weight
    current = model.config._attn_implementation
    base = next((b for b, name in KV_ATTENTION.items() if name == current), current)
    if base != current:
        model.set_attn_implementation(base)
    del model.lpx_numerics
    return model


def set_attention(model, base: str) -> None:
    """Switch ``model`` to attention ``base`` (sdpa, eager), keeping its FP8 KV cache."""
    quantized = getattr(getattr(model, "lpx_numerics", None), "kv_cache", None) is not None
    model.set_attn_implementation(KV_ATTENTION[base] if quantized else base)


def numerics_of_model(model) -> Numerics | None:
    return getattr(model, "lpx_numerics", None)


# --- linear layers --------------------------------------------------------------------------


def _quantize_linear_layers(model, spec: LinearQuantization) -> None:
    layers = decoder_layers(model)
    kept = set(range(spec.keep_first)) | set(range(len(layers) - spec.keep_last, len(layers)))
    for index, layer in enumerate(layers):
        if index in kept:
            continue
        for parent in layer.modules():
            if spec.only == "mlp" and _is_attention(parent):
                continue
            _quantize_children(parent, spec, "router" in spec.quantized_too)
    if "lm_head" in spec.quantized_too:
        head = model.get_output_embeddings()
        head.forward = _QuantizedLinear(head, spec, _weight_amax([head]))
    if "embeddings" in spec.quantized_too:
        embeddings = model.get_input_embeddings()
        embeddings.forward = _QuantizedEmbedding(embeddings, spec)


def _quantize_children(parent: nn.Module, spec: LinearQuantization, routers: bool) -> None:
    """The direct children of ``parent`` that multiply by a weight matrix, quantized; a
    per-tensor scale shared by the children an engine fuses."""
    children = dict(parent.named_children())
    shared = {}
    if spec.weights == "tensor":
        for group in FUSED:
            members = [
                children[name] for name in group if isinstance(children.get(name), nn.Linear)
            ]
            if len(members) > 1:
                amax = _weight_amax(members)
                shared.update({id(m): amax for m in members})
    for name, child in children.items():
        router = name in ROUTER_NAMES and _is_router(parent, child)
        if router and not routers:
            continue
        if spec.only == "experts" and not _is_fused_experts(child):
            continue  # routed experts only: the rest (shared experts too) as computed
        if isinstance(child, nn.Linear):
            child.forward = _QuantizedLinear(child, spec, shared.get(id(child)))
        elif router and _has_matrix(child):
            _quantize_router_weight(child, spec)
        elif _is_fused_experts(child):
            child.forward = _QuantizedExperts(child, spec)


def _quantize_router_weight(router: nn.Module, spec: LinearQuantization) -> None:
    """A router module of its own (transformers' TopKRouter computes its logits, softmax
    and top-k in one forward): its weight quantized where it is held, weight-only, the
    original kept to be put back (`remove_numerics`)."""
    router.lpx_original_weight = router.weight.data
    router.weight.data = _quantized_weight(router.weight.detach(), spec).to(router.weight.dtype)


def _is_attention(module: nn.Module) -> bool:
    return hasattr(module, "k_proj") and hasattr(module, "v_proj")


def _is_router(parent: nn.Module, child: nn.Module) -> bool:
    """A MoE router: the gate of a block that holds experts (a dense MLP's gate_proj is not)."""
    return hasattr(parent, "experts") or "router" in type(child).__name__.lower()


def _has_matrix(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return isinstance(weight, torch.Tensor) and weight.dim() == 2


def _is_fused_experts(module: nn.Module) -> bool:
    """transformers' MoE experts held as 3-D tensors [experts, out, in]."""
    return all(
        isinstance(getattr(module, name, None), torch.Tensor) and getattr(module, name).dim() == 3
        for name in ("gate_up_proj", "down_proj")
    )


def _weight_amax(modules) -> torch.Tensor:
    return torch.stack([m.weight.detach().float().abs().amax() for m in modules]).amax()


def _quantized_weight(weight: torch.Tensor, spec: LinearQuantization, amax=None) -> torch.Tensor:
    """A weight matrix (or a stack of them) dequantized after quantization, float32."""
    if amax is not None:  # one per-tensor scale shared with the layers fused with it
        scale = float_scale(amax, spec.element, spec.scales)
        return round_to_element(weight.float() / scale, spec.element) * scale
    if spec.weights in ("tensor", "nv16") and weight.dim() == 3:  # one scale per expert
        return torch.stack([_quantized_weight(w, spec) for w in weight])
    granularity = "channel" if spec.weights == "channel" else spec.weights
    return quantize_dequantize(weight.detach(), spec.element, granularity, spec.scales)


def _quantized_input(x: torch.Tensor, spec: LinearQuantization) -> torch.Tensor:
    return quantize_dequantize(x, spec.element, spec.activations, spec.scales)


class _QuantizedLinear:
    """A linear layer's forward under ``spec`` (its module's parameters untouched)."""

    def __init__(self, module: nn.Module, spec: LinearQuantization, amax=None):
        self.spec = spec
        self.dtype = module.weight.dtype
        self.weight = _quantized_weight(module.weight.detach(), spec, amax)
        bias = getattr(module, "bias", None)
        self.bias = None if bias is None else bias.detach().float()
        if _in_model_dtype(spec):  # W8A16, or dequantized operands: a GEMM in the dtype
            self.weight = self.weight.to(self.dtype)
            self.bias = None if bias is None else bias.detach()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.spec.activations == "none":
            return nn.functional.linear(x, self.weight, self.bias)
        if self.spec.gemm == "dequantized":
            return nn.functional.linear(_quantized_input(x, self.spec).to(x.dtype), self.weight,
                                        self.bias)  # fmt: skip
        y = nn.functional.linear(_quantized_input(x, self.spec), self.weight, self.bias)
        return y.to(x.dtype)


def _in_model_dtype(spec: LinearQuantization) -> bool:
    """The GEMM multiplies operands in the model's dtype: weight-only, or where the spec
    says the engine dequantizes both operands first (``gemm=dequantized``)."""
    return spec.activations == "none" or spec.gemm == "dequantized"


class _QuantizedEmbedding:
    """An embedding table quantized as a weight matrix [vocabulary, hidden] (weight-only:
    a lookup multiplies nothing)."""

    def __init__(self, module: nn.Embedding, spec: LinearQuantization):
        self.module = module
        self.weight = _quantized_weight(module.weight.detach(), spec).to(module.weight.dtype)

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        return nn.functional.embedding(ids, self.weight, self.module.padding_idx)


class _QuantizedExperts:
    """transformers' fused MoE experts (gate_up_proj [E, 2I, H], down_proj [E, H, I]) with
    each expert's two matmuls quantized; the router's choice and weights come in as given."""

    def __init__(self, module: nn.Module, spec: LinearQuantization):
        self.module, self.spec = module, spec
        self.gate_up = _quantized_weight(module.gate_up_proj.detach(), spec)
        self.down = _quantized_weight(module.down_proj.detach(), spec)
        if _in_model_dtype(spec):
            self.gate_up = self.gate_up.to(module.gate_up_proj.dtype)
            self.down = self.down.to(module.down_proj.dtype)

    def __call__(self, hidden, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden)
        experts = self.module.gate_up_proj.shape[0]
        for expert in torch.unique(top_k_index).tolist():
            if expert < 0 or expert >= experts:
                continue
            token, slot = torch.where(top_k_index == expert)
            state = hidden[token]
            gate, up = self._linear(state, self.gate_up[expert]).chunk(2, dim=-1)
            moved = self._linear(self.module.act_fn(gate) * up, self.down[expert])
            moved = moved * top_k_weights[token, slot, None]
            out.index_add_(0, token, moved.to(out.dtype))
        return out

    def _linear(self, x, weight):
        if self.spec.activations == "none":
            return nn.functional.linear(x, weight)
        if self.spec.gemm == "dequantized":
            return nn.functional.linear(_quantized_input(x, self.spec).to(x.dtype), weight)
        return nn.functional.linear(_quantized_input(x, self.spec), weight).to(x.dtype)


def decoder_layers(model) -> nn.ModuleList:
    """The model's decoder layers, in order: the module list as long as its config's
    ``num_hidden_layers``."""
    count = getattr(model.config, "num_hidden_layers", None)
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) == count:
            return module
    raise ValueError(f"{type(model).__name__}: no list of {count} decoder layers found to quantize")


# --- the KV cache ---------------------------------------------------------------------------


def _quantize_kv_cache(model, spec: KVCacheQuantization) -> None:
    _register_attention()
    for module in model.modules():
        if hasattr(module, "k_proj") and hasattr(module, "v_proj"):
            module.lpx_kv_cache = spec
    current = model.config._attn_implementation
    base = next((b for b, name in KV_ATTENTION.items() if name == current), current)
    model.set_attn_implementation(KV_ATTENTION.get(base, KV_ATTENTION["sdpa"]))


def kv_rounded(
    states: torch.Tensor, element: str, scale: float, rounding: str = "nearest"
) -> torch.Tensor:
    """Keys or values as attention reads them from a reduced-precision cache: states / scale
    rounded to the element (to nearest, or toward zero), times the scale, in the states'
    dtype. An FP4 cache (NVFP4) is block-scaled along the head dimension, 16 values a block,
    under the scale as its tensor scale."""
    if element == "fp4_e2m1":
        return (quantize_dequantize(states.float() / scale, element, "nv16") * scale).to(
            states.dtype
        )
    rounded = truncate_to_element if rounding == "toward_zero" else round_to_element
    return (rounded(states.float() / scale, element) * scale).to(states.dtype)


def _kv_attention(base: str):
    def attention(module, query, key, value, attention_mask, **kwargs):
        spec = getattr(module, "lpx_kv_cache", None)
        forward = _base_attention(module, base)
        if spec is None:
            return forward(module, query, key, value, attention_mask, **kwargs)
        rounded_key = kv_rounded(key, spec.element, spec.k_scale, spec.rounding)
        rounded_value = kv_rounded(value, spec.element, spec.v_scale, spec.rounding)
        out = forward(module, query, rounded_key, rounded_value, attention_mask, **kwargs)
        first = _first_rounded_query(query, key, spec.from_position)
        if first == 0:
            return out
        # the queries before the onset read K/V as computed (a prefill kernel's bf16 path)
        plain = forward(module, query, key, value, attention_mask, **kwargs)
        output = torch.cat([plain[0][:, :first], out[0][:, first:]], dim=1)
        return output, out[1]

    return attention


def _first_rounded_query(query: torch.Tensor, key: torch.Tensor, from_position: int) -> int:
    """The index of the first query that reads the rounded cache. The queries are the last
    of the keys' positions (a prefill from 0: all of them; a decode step: the newest), so
    query i sits at position keys - queries + i: unpadded or right-padded sequences (lpx's
    scoring default); a left-padded batch would shift the onset by its padding."""
    queries, keys = query.shape[-2], key.shape[-2]
    return int(min(max(from_position - (keys - queries), 0), queries))


def _base_attention(module, base: str):
    if base == "sdpa":
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward
    # eager: the model's own (some families add sinks or a soft-cap to it)
    return sys.modules[type(module).__module__].eager_attention_forward


_REGISTERED = False


def _register_attention() -> None:
    global _REGISTERED
    if _REGISTERED:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    for base, name in KV_ATTENTION.items():
        AttentionInterface.register(name, _kv_attention(base))
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[base])
    _REGISTERED = True
