"""Reduced-precision rollouts computed the way engines and recipes compute them, written apart
from lpx's emulation (pipeline/numerics/): each format by its own definition (tiles walked
one by one, FP4 by its table of values, a KV cache rounded where it is stored), so a test
that asks lpx to name one checks lpx against arithmetic it did not write.

- ``fp8_blocks_keeping(first, last)``: verl/NeMo-RL's FP8 recipe (E4M3, 128 x 128 weight
  tiles, 1 x 128 activation groups) on every decoder layer but the first and last ones;
- ``int8_dequantized()``: INT8 W8A8 (per-channel weights, per-token activations) whose
  operands are dequantized into bf16 and multiplied in bf16, as weight-only kernels hold them;
- ``nvfp4_experts()``: NVFP4 (E2M1 in blocks of 16, E4M3 block scales under an FP32 tensor
  scale) on the routed experts of a MoE only, weights and activations;
- ``kv_from(position, scales)``: an E4M3 KV cache that only the queries from ``position`` on
  read (the prefill before it ran on bf16 K/V), stored under ``scales``.

Each returns ``score(model, prompt, completion) -> logprobs`` for a bf16 model
(`engine_scored`).
"""

from __future__ import annotations

import copy
import math

import numpy as np
import torch
from torch import nn

E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def engine_scored(model_dir, fixture, rows, score, dtype=torch.bfloat16):
    """A copy of ``fixture`` whose rollout logprobs of ``rows`` are ``score(model, prompt,
    completion)``, the model loaded in ``dtype``; the other rows as they were."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    values = fixture.channels["rollout"].copy()
    with torch.no_grad():
        for row in rows:
            prompt = np.asarray(fixture.prompt_of(row), dtype=np.int64)
            completion = np.asarray(fixture.completion_of(row), dtype=np.int64)
            values[fixture.completion_slice(row)] = score(model, prompt, completion)
    out = copy.copy(fixture)
    out.channels = {**fixture.channels, "rollout": values}
    return out


def _logprobs(logits, ids, start: int) -> np.ndarray:
    """The logprobs of ids[start:] from logits of the positions before them."""
    logprobs = torch.log_softmax(logits[0, start - 1 : len(ids) - 1].float(), dim=-1)
    picked = logprobs.gather(-1, torch.as_tensor(ids[start:])[:, None])[:, 0]
    return picked.double().numpy()


def _patched(edit):
    """A score function that patches the model with ``edit`` for one forward."""

    def score(model, prompt, completion):
        ids = np.concatenate([prompt, completion])
        undo = edit(model)
        try:
            logits = model(input_ids=torch.as_tensor(ids)[None]).logits
        finally:
            undo()
        return _logprobs(logits, ids, len(prompt))

    return score


# --- the formats, each by its definition ------------------------------------------------


def _e4m3(values: torch.Tensor) -> torch.Tensor:
    return values.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float()


def fp8_tiles(weight: torch.Tensor) -> torch.Tensor:
    """A weight rounded to E4M3 one 128 x 128 tile at a time, each tile under amax / 448."""
    w = weight.float()
    out = torch.empty_like(w)
    for r in range(0, w.shape[0], 128):
        for c in range(0, w.shape[1], 128):
            tile = w[r : r + 128, c : c + 128]
            scale = tile.abs().max().clamp(min=1e-12) / 448.0
            out[r : r + 128, c : c + 128] = _e4m3(tile / scale) * scale
    return out


def fp8_groups(x: torch.Tensor) -> torch.Tensor:
    """Activations rounded to E4M3 per 1 x 128 group of each row."""
    x = x.float()
    pieces = []
    for c in range(0, x.shape[-1], 128):
        group = x[..., c : c + 128]
        scale = group.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / 448.0
        pieces.append(_e4m3(group / scale) * scale)
    return torch.cat(pieces, dim=-1)


def e2m1(values: torch.Tensor) -> torch.Tensor:
    """Each value replaced by the nearest of E2M1's table (sign kept, saturating at 6)."""
    magnitude = values.abs().clamp(max=6.0)
    nearest = (magnitude[..., None] - E2M1_VALUES).abs().argmin(dim=-1)
    return E2M1_VALUES[nearest] * values.sign()


def nvfp4(x: torch.Tensor) -> torch.Tensor:
    """NVFP4 by NVIDIA's recipe: a global scale amax / (6 x 448), each 16 values' scale
    amax_block / 6 divided by it and stored as E4M3, the values as E2M1."""
    flat = x.float().reshape(-1, x.shape[-1])
    global_scale = flat.abs().max().clamp(min=1e-12) / (6.0 * 448.0)
    width = flat.shape[-1]
    blocks = flat.reshape(flat.shape[0], math.ceil(width / 16), 16)
    block_scale = _e4m3(blocks.abs().amax(dim=-1, keepdim=True) / 6.0 / global_scale) * global_scale
    safe = torch.where(block_scale > 0, block_scale, torch.ones_like(block_scale))
    out = e2m1(blocks / safe) * block_scale
    return out.reshape(x.shape)


# --- recipes ----------------------------------------------------------------------------


def _layers(model):
    return model.model.layers


def _patch_linears(modules, forward_of):
    undo = []
    for module in modules:
        module.forward = forward_of(module)
        undo.append(module)
    return lambda: [m.__dict__.pop("forward", None) for m in undo]


def fp8_blocks_keeping(first: int = 1, last: int = 1):
    """FP8 blocks on the decoder layers between the first ``first`` and last ``last``."""

    def forward_of(module):
        weight = fp8_tiles(module.weight.detach())

        def forward(x):
            return (fp8_groups(x) @ weight.T).to(x.dtype)

        return forward

    def edit(model):
        layers = _layers(model)
        chosen = [
            m
            for i, layer in enumerate(layers)
            if first <= i < len(layers) - last
            for m in layer.modules()
            if isinstance(m, nn.Linear)
        ]
        return _patch_linears(chosen, forward_of)

    return _patched(edit)


def int8_dequantized():
    """INT8 W8A8 with both operands dequantized into the model's dtype and multiplied there."""

    def forward_of(module):
        w = module.weight.detach().float()
        scale = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127.0
        weight = (torch.round(w / scale).clamp(-128, 127) * scale).to(module.weight.dtype)

        def forward(x):
            xs = x.float().abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / 127.0
            xq = (torch.round(x.float() / xs).clamp(-128, 127) * xs).to(x.dtype)
            return xq @ weight.T

        return forward

    def edit(model):
        chosen = [
            m for layer in _layers(model) for m in layer.modules() if isinstance(m, nn.Linear)
        ]
        return _patch_linears(chosen, forward_of)

    return _patched(edit)


def nvfp4_experts():
    """NVFP4 weights and activations on the routed experts of every MoE block, nothing else."""

    def forward_of(experts):
        gate_up = torch.stack([nvfp4(w) for w in experts.gate_up_proj.detach()])
        down = torch.stack([nvfp4(w) for w in experts.down_proj.detach()])

        def forward(hidden, top_k_index, top_k_weights):
            out = torch.zeros_like(hidden, dtype=torch.float32)
            for expert in range(gate_up.shape[0]):
                token, slot = torch.nonzero(top_k_index == expert, as_tuple=True)
                if len(token) == 0:
                    continue
                h = (nvfp4(hidden[token]) @ gate_up[expert].T).to(hidden.dtype)
                gate, up = h.chunk(2, dim=-1)
                inner = experts.act_fn(gate) * up
                moved = (nvfp4(inner) @ down[expert].T).to(hidden.dtype)
                out.index_add_(0, token, (moved * top_k_weights[token, slot, None]).float())
            return out.to(hidden.dtype)

        return forward

    def edit(model):
        chosen = [
            m for m in model.modules() if hasattr(m, "gate_up_proj") and m.gate_up_proj.dim() == 3
        ]
        return _patch_linears(chosen, forward_of)

    return _patched(edit)


def kv_from(position: int, k_scale: float = 1.0, v_scale: float = 1.0):
    """An E4M3 KV cache read by the queries from ``position`` on: the tokens before it are
    prefilled on bf16 K/V, their K/V then stored rounded under the scales; the rest extend
    the cache, each new K/V rounded as it is stored, and attend to the stored cache."""

    def stored(states, scale):
        return (_e4m3(states.float() / scale) * scale).to(states.dtype)

    def score(model, prompt, completion):
        from transformers import DynamicCache

        ids = np.concatenate([prompt, completion])
        cut = min(position, len(ids) - 1)
        cache = DynamicCache(config=model.config)
        rounding = {"on": False}
        for layer in cache.layers:
            plain = layer.update

            def update(key, value, *args, _plain=plain, **kwargs):
                if rounding["on"]:
                    key, value = stored(key, k_scale), stored(value, v_scale)
                return _plain(key, value, *args, **kwargs)

            layer.update = update
        logits = []
        if cut > 0:
            logits.append(
                model(input_ids=torch.as_tensor(ids[:cut])[None], past_key_values=cache).logits
            )
            for layer in cache.layers:  # the prefill's K/V as the decode steps read them
                layer.keys = stored(layer.keys, k_scale)
                layer.values = stored(layer.values, v_scale)
        rounding["on"] = True
        logits.append(
            model(input_ids=torch.as_tensor(ids[cut:])[None], past_key_values=cache).logits
        )
        return _logprobs(torch.cat(logits, dim=1), ids, len(prompt))

    return score


def with_large_kv(model_dir, out, factor: float):
    """A copy of a llama-like model computing the same function with its keys and values
    ``factor`` times larger (q and o scaled down to match): the K/V magnitudes of models whose
    FP8 KV cache needs calibrated scales, where a scale of 1.0 saturates at 448. Returns
    ``out`` and the calibrated K/V scales (amax / 448 over a forward of a few tokens)."""
    import shutil
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    out = Path(out)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        for layer in _layers(model):
            attention = layer.self_attn
            attention.q_proj.weight /= factor
            attention.k_proj.weight *= factor
            attention.v_proj.weight *= factor
            attention.o_proj.weight /= factor
    model.save_pretrained(out)
    for extra in Path(model_dir).iterdir():
        if extra.is_file() and not (out / extra.name).exists():
            shutil.copy(extra, out / extra.name)
    amax = {"k": 0.0, "v": 0.0}

    def hook(name):
        def record(module, args, output):
            amax[name] = max(amax[name], float(output.abs().max()))

        return record

    handles = [
        getattr(layer.self_attn, f"{name}_proj").register_forward_hook(hook(name))
        for layer in _layers(model)
        for name in ("k", "v")
    ]
    with torch.no_grad():
        model(input_ids=torch.arange(3, 67)[None])
    for handle in handles:
        handle.remove()
    return out, (amax["k"] / 448.0, amax["v"] / 448.0)
