"""Faults to prove localisation on, each committed in one engine the way a real bug would be.

A fault is a knob of a capture adapter (`fault=KIND`, `fault_layer=N`): the adapter loads the
model with the fault in place and runs its own forward. `EXPECTED` says which boundary the
localiser must name for it, so the benchmark can score exactness.
"""

from __future__ import annotations

# kind -> (the boundary it must be localised at, "{L}" = fault_layer; the real bug)
FAULTS = {
    "rms_eps": ("layers.0.input_norm", "RMSNorm eps 1e-5 where the checkpoint says 1e-6"),
    "rope_theta": ("layers.0.q", "rope_theta 500000 where the checkpoint says 10000"),
    "stale_layer": (
        "layers.{L}.mlp_out",
        "one layer's MLP weights one optimiser step stale (a missed weight sync)",
    ),
    "lm_head_bf16": ("logits", "the lm_head left in bf16 (weights and matmul) in an fp32 engine"),
    "attn_mask": ("layers.0.attn_out", "a causal mask off by one: each token sees the next one"),
    "position_ids": (
        "layers.0.q",
        "position ids offset by +16 from the middle of the sequence (a cache-reuse bug)",
    ),
    "tp_allreduce_bf16": (
        "layers.0.attn_out",
        "TP=2 row-parallel all-reduce (o_proj, down_proj) summed in bf16",
    ),
    "moe_routing_flip": (
        "layers.{L}.experts",
        "one layer's top-k routing flipped at near ties (bf16 router probabilities)",
    ),
}

EPS_WRONG = 1e-5
ROPE_THETA_WRONG = 500000.0
POSITION_OFFSET = 16
STALE_STEP = 0.02  # the optimiser step, relative to each weight matrix's RMS
FLIP_FRACTION = 0.15  # the share of tokens, closest to a tie, whose k-th expert is flipped


def expected_boundary(kind: str, layer: int) -> str:
    return FAULTS[kind][0].replace("{L}", str(layer))


def configure(config, kind: str | None) -> None:
    """Faults that live in the model's config, applied before it is built."""
    if kind == "rms_eps":
        config.rms_norm_eps = EPS_WRONG
    elif kind == "rope_theta":
        params = dict(getattr(config, "rope_parameters", None) or {})
        params["rope_theta"] = ROPE_THETA_WRONG
        params.setdefault("rope_type", "default")
        config.rope_parameters = params
        if hasattr(config, "rope_theta"):
            config.rope_theta = ROPE_THETA_WRONG


def apply(model, kind: str | None, layer: int, size: float | None = None) -> None:
    """Faults that live in the weights or the forward, applied to a loaded model (`size`:
    stale_layer's step, default STALE_STEP)."""
    import torch

    if kind == "stale_layer":
        generator = torch.Generator().manual_seed(1234 + layer)
        with torch.no_grad():
            for parameter in model.model.layers[layer].mlp.parameters():
                step = torch.randn(parameter.shape, generator=generator).sign().to(parameter.device)
                scale = parameter.float().pow(2).mean().sqrt() * (size or STALE_STEP)
                parameter.add_((step * scale).to(parameter.dtype))
    elif kind == "lm_head_bf16":
        _run_in_bfloat16(model.lm_head)
    elif kind == "tp_allreduce_bf16":
        for decoder in model.model.layers:
            _row_parallel_bf16(decoder.self_attn.o_proj)
            down = getattr(decoder.mlp, "down_proj", None)
            if down is not None:
                _row_parallel_bf16(down)


def position_ids(lengths: list[int], width: int, kind: str | None):
    """Position ids for a right-padded batch (None = the model's own 0..T-1)."""
    import torch

    if kind != "position_ids":
        return None
    positions = torch.arange(width).repeat(len(lengths), 1)
    for row, length in enumerate(lengths):
        positions[row, length // 2 :] += POSITION_OFFSET
    return positions


def attention_mask(length: int, kind: str | None, device):
    """A boolean [1, 1, T, T] mask for the attention kernel (None = causal)."""
    import torch

    if kind != "attn_mask":
        return None
    return torch.ones(length, length, dtype=torch.bool, device=device).tril(diagonal=1)[None, None]


def flip_routing(logits, indices, top_k: int):
    """Swap each token's k-th and (k+1)-th expert where the two are closest to a tie."""
    import torch

    probs = torch.softmax(logits.float(), dim=-1)
    ranked = torch.argsort(probs, dim=-1, descending=True)
    top = torch.gather(probs, -1, ranked)
    gap = top[:, top_k - 1] - top[:, top_k]
    flipped = gap <= torch.quantile(gap, FLIP_FRACTION)
    indices = indices.clone()
    chosen = ranked[:, :top_k].clone()
    chosen[:, top_k - 1] = ranked[:, top_k]
    indices[flipped] = chosen[flipped].to(indices.dtype)
    return indices


def _run_in_bfloat16(linear) -> None:
    import torch

    linear.to(torch.bfloat16)
    linear.register_forward_pre_hook(lambda module, args: (args[0].to(torch.bfloat16),))
    linear.register_forward_hook(lambda module, args, output: output.float())


def _row_parallel_bf16(linear, ranks: int = 2) -> None:
    """The linear as TP row-parallel ranks whose partial sums are all-reduced in bf16."""
    import torch

    def forward(x):
        shards = torch.chunk(x, ranks, dim=-1)
        weights = torch.chunk(linear.weight, ranks, dim=-1)
        total = None
        for shard, weight in zip(shards, weights, strict=True):
            partial = torch.nn.functional.linear(shard, weight).to(torch.bfloat16)
            total = partial if total is None else total + partial
        out = total.to(x.dtype)
        return out if linear.bias is None else out + linear.bias

    linear.forward = forward
