"""Hugging Face Llama/Qwen2 weights <-> megatron-core GPTModel shards for tensor parallelism.

Pure tensor functions (no process groups), so the layout rules can be tested on their own:
- `linear_qkv` interleaves per query group [q heads of the group, k, v], then each TP rank
  takes its contiguous run of groups (the same for the Qwen2 qkv bias);
- `linear_fc1` is, per rank, cat(gate chunk, up chunk);
- `linear_proj` and `linear_fc2` split their input dimension (dim 1);
- word embeddings and the output layer split the vocabulary (dim 0).
"""

from __future__ import annotations

from dataclasses import dataclass

CONVERSION = "hf-llama/qwen2 -> mcore GPTModel (local spec): qkv interleaved per query group, fc1 = [gate; up] per rank"


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

    @classmethod
    def from_hf_config(cls, config: dict) -> Shape:
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
            qkv_bias=config.get("model_type") == "qwen2"
            or bool(config.get("attention_bias", False)),
        )


def hf_to_megatron(
    hf: dict, shape: Shape, tp_size: int, tp_rank: int, interleave_qkv: bool = True
) -> dict:
    """The state dict TP rank `tp_rank` of `tp_size` loads. `interleave_qkv=False` is the
    classic conversion bug (q, k, v concatenated whole); tests use it to prove lpx sees it."""
    out = {
        "embedding.word_embeddings.weight": _rows(
            hf["model.embed_tokens.weight"], tp_size, tp_rank
        ),
        "decoder.final_layernorm.weight": hf["model.norm.weight"],
    }
    if not shape.tied:
        out["output_layer.weight"] = _rows(hf["lm_head.weight"], tp_size, tp_rank)
    for i in range(shape.num_layers):
        hf_prefix, prefix = f"model.layers.{i}.", f"decoder.layers.{i}."
        attention = hf_prefix + "self_attn."
        q, k, v = (hf[attention + f"{n}_proj.weight"] for n in "qkv")
        out[prefix + "self_attention.linear_qkv.weight"] = _qkv(
            q, k, v, shape, tp_size, tp_rank, interleave_qkv
        )
        if shape.qkv_bias:
            qb, kb, vb = (hf[attention + f"{n}_proj.bias"][:, None] for n in "qkv")
            bias = _qkv(qb, kb, vb, shape, tp_size, tp_rank, interleave_qkv)
            out[prefix + "self_attention.linear_qkv.bias"] = bias[:, 0]
        out[prefix + "self_attention.linear_proj.weight"] = _columns(
            hf[attention + "o_proj.weight"], tp_size, tp_rank
        )
        out[prefix + "input_layernorm.weight"] = hf[hf_prefix + "input_layernorm.weight"]
        out[prefix + "pre_mlp_layernorm.weight"] = hf[hf_prefix + "post_attention_layernorm.weight"]
        mlp = hf_prefix + "mlp."
        gate = _rows(hf[mlp + "gate_proj.weight"], tp_size, tp_rank)
        up = _rows(hf[mlp + "up_proj.weight"], tp_size, tp_rank)
        out[prefix + "mlp.linear_fc1.weight"] = _cat([gate, up])
        out[prefix + "mlp.linear_fc2.weight"] = _columns(
            hf[mlp + "down_proj.weight"], tp_size, tp_rank
        )
    return out


def megatron_to_hf(shards: list[dict], shape: Shape) -> dict:
    """Reassemble the HF state dict from every TP rank's shard (inverse of hf_to_megatron)."""
    import torch

    tp_size = len(shards)
    cat0 = lambda name: torch.cat([s[name] for s in shards], dim=0)  # noqa: E731
    cat1 = lambda name: torch.cat([s[name] for s in shards], dim=1)  # noqa: E731
    hf = {
        "model.embed_tokens.weight": cat0("embedding.word_embeddings.weight"),
        "model.norm.weight": shards[0]["decoder.final_layernorm.weight"],
    }
    hf["lm_head.weight"] = (
        hf["model.embed_tokens.weight"] if shape.tied else cat0("output_layer.weight")
    )
    groups_per_rank = shape.num_query_groups // tp_size
    heads_per_group = shape.num_heads // shape.num_query_groups
    d = shape.head_dim
    for i in range(shape.num_layers):
        prefix, hf_prefix = f"decoder.layers.{i}.", f"model.layers.{i}."
        for suffix in ("weight", "bias") if shape.qkv_bias else ("weight",):
            name = prefix + f"self_attention.linear_qkv.{suffix}"
            q, k, v = [], [], []
            for shard in shards:
                per_group = shard[name].reshape(groups_per_rank, (heads_per_group + 2) * d, -1)
                q.append(per_group[:, : heads_per_group * d].reshape(-1, per_group.shape[-1]))
                k.append(
                    per_group[:, heads_per_group * d : (heads_per_group + 1) * d].reshape(
                        -1, per_group.shape[-1]
                    )
                )
                v.append(per_group[:, (heads_per_group + 1) * d :].reshape(-1, per_group.shape[-1]))
            for n, parts in zip("qkv", (q, k, v), strict=True):
                tensor = torch.cat(parts)
                hf[hf_prefix + f"self_attn.{n}_proj.{suffix}"] = (
                    tensor[:, 0] if suffix == "bias" else tensor
                )
        hf[hf_prefix + "self_attn.o_proj.weight"] = cat1(
            prefix + "self_attention.linear_proj.weight"
        )
        hf[hf_prefix + "input_layernorm.weight"] = shards[0][prefix + "input_layernorm.weight"]
        hf[hf_prefix + "post_attention_layernorm.weight"] = shards[0][
            prefix + "pre_mlp_layernorm.weight"
        ]
        gates, ups = zip(
            *(s[prefix + "mlp.linear_fc1.weight"].chunk(2) for s in shards), strict=True
        )
        hf[hf_prefix + "mlp.gate_proj.weight"] = torch.cat(gates)
        hf[hf_prefix + "mlp.up_proj.weight"] = torch.cat(ups)
        hf[hf_prefix + "mlp.down_proj.weight"] = cat1(prefix + "mlp.linear_fc2.weight")
    return hf


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


def gpt_model(config: dict, shape, tp: int, dtype):
    """An empty Megatron-core GPTModel of the HF model's shape, for `tp` TP ranks, in torch
    `dtype`, with every fusion off so it runs on the CPU (the replay and the capture side both
    load their shard of the HF weights into it)."""
    import torch
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    transformer = TransformerConfig(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        num_attention_heads=shape.num_heads,
        num_query_groups=shape.num_query_groups,
        kv_channels=shape.head_dim,
        ffn_hidden_size=shape.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=config.get("rms_norm_eps", 1e-6),
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=shape.qkv_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        use_cpu_initialization=True,
        perform_initialization=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        attention_softmax_in_fp32=True,
    )
    return GPTModel(
        config=transformer,
        transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=shape.vocab_size,
        max_sequence_length=config.get("max_position_embeddings", 4096),
        position_embedding_type="rope",
        rotary_base=int(
            (config.get("rope_parameters") or {}).get("rope_theta")
            or config.get("rope_theta", 10000)
        ),
        share_embeddings_and_output_weights=shape.tied,
        parallel_output=True,
    )
