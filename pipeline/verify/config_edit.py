"""The reference model computing as if its config read otherwise: RoPE's theta and scaling,
a sliding window (its size and its layers), the norms' eps, attention and final-logit
soft-caps, a tied head. Each edit changes what an engine's reading of that key changes, on
the loaded model, and is undone after (`reading`).

Edits are given as `pipeline.model_config` records: {"rope": {...}, "sliding_window": W,
"windowed_layers": "0-27", "rms_norm_eps": e, "attn_logit_softcapping": c,
"final_logit_softcapping": c, "tie_word_embeddings": True}; a key not given keeps the
model's own reading. A window of W lets a query at position q attend keys k with q - k < W
(transformers' rule); a misread by one is W +- 1."""

from __future__ import annotations

import copy
import math
from contextlib import ExitStack, contextmanager

from pipeline.model_config import numerics_config

ATTENTION = "lpx_config_read"
EDITABLE = (
    "rope",
    "sliding_window",
    "windowed_layers",
    "rms_norm_eps",
    "attn_logit_softcapping",
    "final_logit_softcapping",
    "tie_word_embeddings",
)


def own_reading(model) -> dict:
    """The model's own config record (what the edits change)."""
    return numerics_config(model.config)


@contextmanager
def reading(model, edits: dict):
    """``model`` computing with ``edits`` to its config for the duration (ValueError for a
    rope that transformers cannot build, or a key it cannot edit)."""
    unknown = set(edits) - set(EDITABLE)
    if unknown:
        raise ValueError(f"cannot edit {', '.join(sorted(unknown))}")
    own = own_reading(model)
    with ExitStack() as undo:
        if "rope" in edits:
            undo.enter_context(_rope(model, edits["rope"]))
        if "rms_norm_eps" in edits:
            undo.enter_context(_eps(model, float(edits["rms_norm_eps"])))
        if edits.get("tie_word_embeddings") and not own["tie_word_embeddings"]:
            undo.enter_context(_tied(model))
        if "final_logit_softcapping" in edits:
            undo.enter_context(_final_cap(model, edits["final_logit_softcapping"]))
        attention_keys = ("sliding_window", "windowed_layers", "attn_logit_softcapping")
        if any(k in edits for k in attention_keys):
            merged = {**own, **{k: edits[k] for k in attention_keys if k in edits}}
            undo.enter_context(_attention(model, merged))
        yield model


@contextmanager
def _rope(model, rope: dict):
    edited = copy.deepcopy(model.config)
    parameters = {k: v for k, v in rope.items() if v is not None}
    edited.rope_parameters = parameters
    if "rope_theta" in parameters:
        edited.rope_theta = parameters["rope_theta"]
    saved = []
    for module in model.modules():
        if hasattr(module, "inv_freq") and hasattr(module, "attention_scaling"):
            rebuilt = type(module)(config=edited)
            saved.append((module, module.inv_freq, module.attention_scaling, module.rope_type))
            module.inv_freq = rebuilt.inv_freq.to(module.inv_freq.device)
            module.attention_scaling = rebuilt.attention_scaling
            module.rope_type = rebuilt.rope_type
    if not saved:
        raise ValueError("the model has no rotary embedding lpx can rebuild")
    try:
        yield
    finally:
        for module, inv_freq, scaling, rope_type in saved:
            module.inv_freq, module.attention_scaling, module.rope_type = (
                inv_freq,
                scaling,
                rope_type,
            )


@contextmanager
def _eps(model, eps: float):
    saved = []
    for module in model.modules():
        for name in ("variance_epsilon", "eps"):
            if isinstance(getattr(module, name, None), float) and "Norm" in type(module).__name__:
                saved.append((module, name, getattr(module, name)))
                setattr(module, name, eps)
    try:
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)


@contextmanager
def _tied(model):
    head, embeddings = model.get_output_embeddings(), model.get_input_embeddings()
    weight = head.weight
    head.weight = embeddings.weight
    try:
        yield
    finally:
        head.weight = weight


@contextmanager
def _final_cap(model, cap):
    """A final-logit soft-cap of ``cap`` (None: none). Where the model applies its own from
    its config (Gemma 2), the config's value is what changes."""
    config = model.config
    if getattr(config, "final_logit_softcapping", None) is not None:
        saved = config.final_logit_softcapping
        config.final_logit_softcapping = cap
        try:
            yield
        finally:
            config.final_logit_softcapping = saved
        return
    if not cap:
        yield
        return
    head = model.get_output_embeddings()
    forward = head.forward

    def capped(x):
        return cap * (forward(x) / cap).tanh()

    head.forward = capped
    try:
        yield
    finally:
        del head.forward


@contextmanager
def _attention(model, reading: dict):
    """Every decoder layer's attention through lpx's own (a window and a soft-cap per layer,
    as ``reading`` has them), the model's attention implementation restored after."""
    from pipeline.numerics.emulate import decoder_layers

    _register()
    windowed = _layers(reading.get("windowed_layers") or "")
    window = reading.get("sliding_window")
    cap = reading.get("attn_logit_softcapping")
    layers = decoder_layers(model)
    before = model.config._attn_implementation
    for index, layer in enumerate(layers):
        attention = layer.self_attn
        attention.lpx_window = int(window) if window and index in windowed else None
        attention.lpx_softcap = float(cap) if cap else None
    model.set_attn_implementation(ATTENTION)
    try:
        yield
    finally:
        model.set_attn_implementation(before)
        for layer in layers:
            del layer.self_attn.lpx_window, layer.self_attn.lpx_softcap


def _layers(text: str) -> set[int]:
    found = set()
    for part in filter(None, str(text).split(",")):
        first, _, last = part.partition("-")
        found.update(range(int(first), int(last or first) + 1))
    return found


def _attention_forward(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """Eager attention over one unpadded sequence (verification re-scores each alone): the
    causal mask, the module's window and soft-cap, an FP8 KV cache where the reference
    computes with one. [batch, heads, q, d] in, [batch, q, heads, d] out."""
    import torch

    spec = getattr(module, "lpx_kv_cache", None)
    if spec is not None:
        from pipeline.numerics.emulate import kv_rounded

        key = kv_rounded(key, spec.element, spec.k_scale, spec.rounding)
        value = kv_rounded(value, spec.element, spec.v_scale, spec.rounding)
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    scale = scaling if scaling is not None else 1.0 / math.sqrt(query.shape[-1])
    scores = torch.matmul(query, key.transpose(-1, -2)) * scale
    cap = getattr(module, "lpx_softcap", None)
    if cap:
        scores = cap * torch.tanh(scores / cap)
    q_len, k_len = scores.shape[-2:]
    queries = torch.arange(k_len - q_len, k_len, device=scores.device)[:, None]
    keys = torch.arange(k_len, device=scores.device)[None, :]
    allowed = keys <= queries
    window = getattr(module, "lpx_window", None)
    if window:
        allowed = allowed & (queries - keys < window)
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(query.dtype)
    out = torch.matmul(probs, value).transpose(1, 2).contiguous()
    return out, probs


_REGISTERED = False


def _register() -> None:
    global _REGISTERED
    if _REGISTERED:
        return
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, _attention_forward)
    _REGISTERED = True
