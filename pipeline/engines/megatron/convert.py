"""Hugging Face weights <-> megatron-core GPTModel shards, for every family lpx registers
(`pipeline.families`: Llama, Qwen2, Qwen3, Qwen2-MoE, Qwen3-MoE), with tensor parallelism
(TP) and, for MoE models, expert parallelism (EP).

Pure tensor functions (no process groups), so the layout rules can be tested on their own:
- `linear_qkv` interleaves per query group [q heads of the group, k, v], then each TP rank
  takes its contiguous run of groups (the same for the Qwen2 qkv bias);
- Qwen3's per-head q/k RMSNorms are `self_attention.q_layernorm` / `k_layernorm`, whole on
  every rank (one head_dim vector);
- `linear_fc1` is, per rank, cat(gate chunk, up chunk); `linear_proj` and `linear_fc2` split
  their input dimension (dim 1); word embeddings and the output layer split the vocabulary;
- MoE layers: the router (`mlp.router.weight`, [experts, hidden]) is whole on every rank;
  EP rank r holds experts r * E/ep .. (r + 1) * E/ep - 1 as `mlp.experts.local_experts.j`
  (megatron's SequentialMLP), each split over the expert-TP ranks like a dense MLP;
  Qwen2-MoE's shared expert is `mlp.shared_experts` (split over TP) and its sigmoid gate
  `mlp.shared_experts.gate_weight` ([1, hidden], whole).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pipeline.errors import BadInput

CONVERSION = (
    "hf -> mcore GPTModel (local spec): qkv interleaved per query group, fc1 = [gate; up] per "
    "rank, q/k layernorm per head, experts split over EP ranks (SequentialMLP)"
)


@dataclass(frozen=True)
class Parallel:
    """How one model is split: TP ranks, EP ranks, and expert-TP ranks (megatron's default:
    the experts split like the dense layers, `etp` = `tp`)."""

    tp: int = 1
    ep: int = 1
    etp: int | None = None

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp


@dataclass(frozen=True)
class Place:
    """Where one rank sits: its TP rank, EP rank and expert-TP rank."""

    tp: int = 0
    ep: int = 0
    etp: int = 0


@dataclass(frozen=True)
class Shape:
    num_layers: int
    hidden_size: int
    num_heads: int
    num_query_groups: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    tied: bool
    qkv_bias: bool
    family: str = "llama"
    qk_norm: bool = False
    routing: object = None  # pipeline.families.Routing for a MoE model, else None

    @classmethod
    def from_hf_config(cls, config: dict, source: str = "config.json") -> Shape:
        from pipeline.families import routing

        family = convertible_family(config, source)
        heads = config["num_attention_heads"]
        return cls(
            num_layers=config["num_hidden_layers"],
            hidden_size=config["hidden_size"],
            num_heads=heads,
            num_query_groups=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            ffn_hidden_size=config["intermediate_size"],
            vocab_size=config["vocab_size"],
            tied=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=family.qkv_bias,
            family=family.name,
            qk_norm=family.qk_norm,
            routing=routing(config) if family.moe else None,
        )

    def moe_layer(self, index: int) -> bool:
        return self.routing is not None and index in self.routing.layers

    @property
    def moe_layers(self) -> list[int]:
        return sorted(self.routing.layers) if self.routing is not None else []


# ---------------------------------------------------------------------------------------
# What the converter takes, checked before any rank starts


def convertible_family(config: dict, source: str = "config.json"):
    """The config's family when the converter takes it; BadInput naming the family or the
    setting it cannot take, and what it does take."""
    from pipeline.families import families

    known = families()
    model_type = config.get("model_type")
    if model_type not in known:
        raise BadInput(
            f"{source}: megatron converts the families lpx registers ({', '.join(known)}), "
            f"not model_type {model_type!r}; replay or capture this model with hf, fsdp or "
            "deepspeed, or add its family in pipeline/families/ and its layout in "
            "pipeline/engines/megatron/convert.py."
        )
    family = known[model_type]
    unsupported = _unsupported_settings(config, family)
    if unsupported:
        raise BadInput(
            f"{source}: megatron's conversion of {model_type} takes none of "
            f"{', '.join(unsupported)} (it converts gated-SiLU MLPs, plain RoPE, full "
            "attention, no o_proj/MLP biases); use hf, fsdp or deepspeed for this model."
        )
    return family


def _unsupported_settings(config: dict, family) -> list[str]:
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    checks = {
        f"hidden_act={config.get('hidden_act')}": config.get("hidden_act", "silu") != "silu",
        f"rope_type={rope.get('rope_type')}": rope.get("rope_type", "default") != "default",
        "use_sliding_window": bool(config.get("use_sliding_window")),
        "mlp_bias": bool(config.get("mlp_bias")),
        # Llama's attention_bias also puts a bias on o_proj, which the layout has no place for
        "attention_bias (o_proj bias)": bool(config.get("attention_bias")) and not family.qkv_bias,
    }
    return [name for name, bad in checks.items() if bad]


def check_convertible(config: dict, parallel: Parallel, world_size: int, source: str) -> Shape:
    """Everything a megatron launch needs of the model and the parallel layout, checked in the
    launching process so a bad one is one `Error:` line, not a failed rank: the family, TP
    dividing heads/groups/vocab/FFN, EP dividing the experts, the world size fitting both."""
    shape = Shape.from_hf_config(config, source)
    tp, ep, etp = parallel.tp, parallel.ep, parallel.expert_tp
    for name, value in (("tensor_parallel_size", tp), ("expert_model_parallel_size", ep)):
        if value < 1:
            raise BadInput(f"{name} must be at least 1, not {value}.")
    if etp < 1:
        raise BadInput(f"expert_tensor_parallel_size must be at least 1, not {etp}.")
    split_by_tp = {
        "key/value heads": shape.num_query_groups,
        "attention heads": shape.num_heads,
        "vocabulary": shape.vocab_size,
    }
    if any(not shape.moe_layer(i) for i in range(shape.num_layers)):
        split_by_tp["intermediate_size"] = shape.ffn_hidden_size
    if shape.routing is not None and shape.routing.shared_ffn_hidden_size:
        split_by_tp["shared_expert_intermediate_size"] = shape.routing.shared_ffn_hidden_size
    bad = [f"{name} ({size})" for name, size in split_by_tp.items() if size % tp]
    if bad:
        raise BadInput(
            f"{source}: tensor parallel size tp={tp} must divide the {', '.join(bad)}; "
            f"choose one of {_divisors(math.gcd(*split_by_tp.values()))}."
        )
    if shape.routing is None and (ep > 1 or parallel.etp not in (None, tp)):
        raise BadInput(
            f"{source}: expert parallelism (ep={ep}, expert tensor parallel size "
            f"{parallel.expert_tp}) needs a mixture-of-experts model, and {shape.family} is "
            "dense; leave expert_model_parallel_size (ep) at 1."
        )
    if shape.routing is not None:
        experts = shape.routing.num_experts
        if experts % ep:
            raise BadInput(
                f"{source}: expert parallel size ep={ep} must divide the {experts} experts of "
                f"this {shape.family} model; choose one of {_divisors(experts)}."
            )
        if shape.routing.ffn_hidden_size % etp:
            raise BadInput(
                f"{source}: expert tensor parallel size etp={etp} must divide "
                f"moe_intermediate_size ({shape.routing.ffn_hidden_size}); choose one of "
                f"{_divisors(shape.routing.ffn_hidden_size)}."
            )
    for what, size in (("tensor_parallel_size", tp), ("expert_model_parallel_size x expert "
                       "tensor parallel size", ep * etp)):  # fmt: skip
        if world_size % size:
            raise BadInput(
                f"--nproc {world_size} is not a multiple of {what} ({size}); megatron needs "
                "every rank in a group of that size."
            )
    return shape


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


# ---------------------------------------------------------------------------------------
# HF -> megatron


def hf_to_megatron(
    hf: dict,
    shape: Shape,
    parallel: Parallel,
    place: Place = Place(),
    interleave_qkv: bool = True,
) -> dict:
    """The state dict the rank at `place` loads. `interleave_qkv=False` is the classic
    conversion bug (q, k, v concatenated whole); tests use it to prove lpx sees it."""
    tp, tp_rank = parallel.tp, place.tp
    out = {
        "embedding.word_embeddings.weight": _rows(hf["model.embed_tokens.weight"], tp, tp_rank),
        "decoder.final_layernorm.weight": hf["model.norm.weight"],
    }
    if not shape.tied:
        out["output_layer.weight"] = _rows(hf["lm_head.weight"], tp, tp_rank)
    for i in range(shape.num_layers):
        hf_prefix, prefix = f"model.layers.{i}.", f"decoder.layers.{i}."
        out.update(_attention(hf, hf_prefix + "self_attn.", prefix, shape, tp, tp_rank,
                              interleave_qkv))  # fmt: skip
        out[prefix + "input_layernorm.weight"] = hf[hf_prefix + "input_layernorm.weight"]
        out[prefix + "pre_mlp_layernorm.weight"] = hf[hf_prefix + "post_attention_layernorm.weight"]
        if shape.moe_layer(i):
            out.update(_moe(hf, hf_prefix + "mlp.", prefix + "mlp.", shape, parallel, place))
        else:
            out.update(_mlp(hf, hf_prefix + "mlp.", prefix + "mlp.", tp, tp_rank))
    return out


def _attention(hf, hf_prefix, prefix, shape, tp, tp_rank, interleave) -> dict:
    out = {}
    q, k, v = (hf[hf_prefix + f"{n}_proj.weight"] for n in "qkv")
    out[prefix + "self_attention.linear_qkv.weight"] = _qkv(q, k, v, shape, tp, tp_rank, interleave)
    if shape.qkv_bias:
        qb, kb, vb = (hf[hf_prefix + f"{n}_proj.bias"][:, None] for n in "qkv")
        bias = _qkv(qb, kb, vb, shape, tp, tp_rank, interleave)
        out[prefix + "self_attention.linear_qkv.bias"] = bias[:, 0]
    if shape.qk_norm:
        out[prefix + "self_attention.q_layernorm.weight"] = hf[hf_prefix + "q_norm.weight"]
        out[prefix + "self_attention.k_layernorm.weight"] = hf[hf_prefix + "k_norm.weight"]
    out[prefix + "self_attention.linear_proj.weight"] = _columns(
        hf[hf_prefix + "o_proj.weight"], tp, tp_rank
    )
    return out


def _mlp(hf, hf_prefix, prefix, tp, tp_rank) -> dict:
    """A gated MLP (gate_proj, up_proj, down_proj) as megatron's linear_fc1/linear_fc2."""
    gate = _rows(hf[hf_prefix + "gate_proj.weight"], tp, tp_rank)
    up = _rows(hf[hf_prefix + "up_proj.weight"], tp, tp_rank)
    return {
        prefix + "linear_fc1.weight": _cat([gate, up]),
        prefix + "linear_fc2.weight": _columns(hf[hf_prefix + "down_proj.weight"], tp, tp_rank),
    }


def _moe(hf, hf_prefix, prefix, shape, parallel, place) -> dict:
    routing = shape.routing
    out = {prefix + "router.weight": hf[hf_prefix + "gate.weight"]}
    local = routing.num_experts // parallel.ep
    for j in range(local):  # megatron's local expert j is HF's expert ep_rank * local + j
        source = f"{hf_prefix}experts.{place.ep * local + j}."
        target = f"{prefix}experts.local_experts.{j}."
        out.update(_mlp(hf, source, target, parallel.expert_tp, place.etp))
    if routing.shared_ffn_hidden_size:
        out.update(_mlp(hf, hf_prefix + "shared_expert.", prefix + "shared_experts.",
                        parallel.tp, place.tp))  # fmt: skip
        out[prefix + "shared_experts.gate_weight"] = hf[hf_prefix + "shared_expert_gate.weight"]
    return out


# ---------------------------------------------------------------------------------------
# megatron -> HF


def megatron_to_hf(shards: dict, shape: Shape, parallel: Parallel) -> dict:
    """Reassemble the HF state dict (inverse of hf_to_megatron) from `shards`, a
    {Place: state dict} holding every TP rank and every (EP, expert-TP) rank at least once."""
    import torch

    by_tp = [_shard_at(shards, "tp", r) for r in range(parallel.tp)]
    cat0 = lambda name: torch.cat([s[name] for s in by_tp], dim=0)  # noqa: E731
    hf = {
        "model.embed_tokens.weight": cat0("embedding.word_embeddings.weight"),
        "model.norm.weight": by_tp[0]["decoder.final_layernorm.weight"],
    }
    hf["lm_head.weight"] = (
        hf["model.embed_tokens.weight"] if shape.tied else cat0("output_layer.weight")
    )
    for i in range(shape.num_layers):
        prefix, hf_prefix = f"decoder.layers.{i}.", f"model.layers.{i}."
        hf.update(_attention_back(by_tp, prefix, hf_prefix + "self_attn.", shape))
        hf[hf_prefix + "input_layernorm.weight"] = by_tp[0][prefix + "input_layernorm.weight"]
        hf[hf_prefix + "post_attention_layernorm.weight"] = by_tp[0][
            prefix + "pre_mlp_layernorm.weight"
        ]
        if shape.moe_layer(i):
            hf.update(
                _moe_back(shards, by_tp, prefix + "mlp.", hf_prefix + "mlp.", shape, parallel)
            )
        else:
            hf.update(_mlp_back(by_tp, prefix + "mlp.", hf_prefix + "mlp."))
    return hf


def _shard_at(shards: dict, axis: str, rank: int, **also) -> dict:
    for place, shard in shards.items():
        if getattr(place, axis) == rank and all(getattr(place, k) == v for k, v in also.items()):
            return shard
    raise ValueError(f"no shard at {axis} rank {rank} {also or ''} among {sorted(shards)}")


def _attention_back(by_tp, prefix, hf_prefix, shape) -> dict:
    import torch

    out = {}
    groups_per_rank = shape.num_query_groups // len(by_tp)
    heads_per_group = shape.num_heads // shape.num_query_groups
    d = shape.head_dim
    for suffix in ("weight", "bias") if shape.qkv_bias else ("weight",):
        name = prefix + f"self_attention.linear_qkv.{suffix}"
        q, k, v = [], [], []
        for shard in by_tp:
            per_group = shard[name].reshape(groups_per_rank, (heads_per_group + 2) * d, -1)
            width = per_group.shape[-1]
            q.append(per_group[:, : heads_per_group * d].reshape(-1, width))
            k.append(
                per_group[:, heads_per_group * d : (heads_per_group + 1) * d].reshape(-1, width)
            )
            v.append(per_group[:, (heads_per_group + 1) * d :].reshape(-1, width))
        for n, parts in zip("qkv", (q, k, v), strict=True):
            tensor = torch.cat(parts)
            out[hf_prefix + f"{n}_proj.{suffix}"] = tensor[:, 0] if suffix == "bias" else tensor
    if shape.qk_norm:
        out[hf_prefix + "q_norm.weight"] = by_tp[0][prefix + "self_attention.q_layernorm.weight"]
        out[hf_prefix + "k_norm.weight"] = by_tp[0][prefix + "self_attention.k_layernorm.weight"]
    out[hf_prefix + "o_proj.weight"] = torch.cat(
        [s[prefix + "self_attention.linear_proj.weight"] for s in by_tp], dim=1
    )
    return out


def _mlp_back(parts, prefix, hf_prefix) -> dict:
    """One gated MLP from its TP (or expert-TP) shards, in rank order."""
    import torch

    gates, ups = zip(*(s[prefix + "linear_fc1.weight"].chunk(2) for s in parts), strict=True)
    return {
        hf_prefix + "gate_proj.weight": torch.cat(gates),
        hf_prefix + "up_proj.weight": torch.cat(ups),
        hf_prefix + "down_proj.weight": torch.cat(
            [s[prefix + "linear_fc2.weight"] for s in parts], dim=1
        ),  # fmt: skip
    }


def _moe_back(shards, by_tp, prefix, hf_prefix, shape, parallel) -> dict:
    routing = shape.routing
    out = {hf_prefix + "gate.weight": by_tp[0][prefix + "router.weight"]}
    local = routing.num_experts // parallel.ep
    for ep_rank in range(parallel.ep):
        parts = [_shard_at(shards, "ep", ep_rank, etp=r) for r in range(parallel.expert_tp)]
        for j in range(local):
            out.update(_mlp_back(parts, f"{prefix}experts.local_experts.{j}.",
                                 f"{hf_prefix}experts.{ep_rank * local + j}."))  # fmt: skip
    if routing.shared_ffn_hidden_size:
        out.update(_mlp_back(by_tp, prefix + "shared_experts.", hf_prefix + "shared_expert."))
        out[hf_prefix + "shared_expert_gate.weight"] = by_tp[0][
            prefix + "shared_experts.gate_weight"
        ]
    return out


def _qkv(q, k, v, shape: Shape, tp_size: int, tp_rank: int, interleave: bool):
    import torch

    d, groups = shape.head_dim, shape.num_query_groups
    heads_per_group = shape.num_heads // groups
    if interleave:
        per_group = torch.cat(
            [
                q.reshape(groups, heads_per_group * d, -1),
                k.reshape(groups, d, -1),
                v.reshape(groups, d, -1),
            ],
            dim=1,
        )
        return _rows(per_group, tp_size, tp_rank).reshape(-1, q.shape[-1])
    # The bug: whole q, k, v stacked, then split by rows as if interleaved.
    return _rows(torch.cat([q, k, v]), tp_size, tp_rank)


def _rows(tensor, tp_size: int, tp_rank: int):
    return tensor.chunk(tp_size, dim=0)[tp_rank].contiguous()


def _columns(tensor, tp_size: int, tp_rank: int):
    return tensor.chunk(tp_size, dim=1)[tp_rank].contiguous()


def _cat(parts):
    import torch

    return torch.cat(parts, dim=0)


# ---------------------------------------------------------------------------------------
# The model
