"""The megatron-core side of the replay: an empty GPTModel of the HF model's shape, its MoE
layers set to route as HF does, megatron's process groups, and the CPU shims its MoE
dispatcher needs. The weight layout itself is `megatron.convert` (pure tensor functions).
"""

from __future__ import annotations

from pipeline.engines.megatron.convert import Parallel, Place, Shape

DISPATCHER = "alltoall"  # the one megatron token dispatcher that takes uneven ranks (see gpt_model)


def moe_settings(shape: Shape, parallel: Parallel) -> dict:
    """megatron-core's own MoE layer set to route exactly as the HF model does at inference.

    - softmax router; HF takes the top-k of the softmax: with ``norm_topk_prob`` the chosen
      probabilities are renormalised, which is megatron's default order (top-k of the logits,
      then a softmax over those k); without it, megatron's ``moe_router_pre_softmax`` (softmax
      over every expert, then top-k), unscaled;
    - no load balancing, no aux/z loss, no capacity: every token goes to its k experts;
    - router logits in the activations' dtype (``moe_router_dtype`` None), as HF's
      ``F.linear`` computes them; the softmax is fp32 on both sides;
    - Qwen2-MoE's shared expert with its sigmoid gate (``moe_shared_expert_gate``);
    - the alltoall dispatcher: EP ranks score different micro-batches (they are data
      parallel for attention), and only alltoall exchanges uneven token counts;
    - ``moe_enable_routing_replay``: megatron's RouterReplay records each router's top-k
      (the routing record) and forces it (router replay, R3).
    """
    routing = shape.routing
    return {
        "num_moe_experts": routing.num_experts,
        "moe_router_topk": routing.top_k,
        "moe_ffn_hidden_size": routing.ffn_hidden_size,
        "moe_layer_freq": [int(shape.moe_layer(i)) for i in range(shape.num_layers)],
        "moe_shared_expert_intermediate_size": routing.shared_ffn_hidden_size or None,
        "moe_shared_expert_gate": bool(routing.shared_ffn_hidden_size),
        "moe_router_score_function": "softmax",
        "moe_router_pre_softmax": not routing.norm_topk_prob,
        "moe_router_topk_scaling_factor": None,
        "moe_router_load_balancing_type": "none",
        "moe_aux_loss_coeff": 0.0,
        "moe_z_loss_coeff": None,
        "moe_input_jitter_eps": None,
        "moe_expert_capacity_factor": None,
        "moe_token_dispatcher_type": DISPATCHER,
        "moe_router_dtype": None,
        "moe_grouped_gemm": False,
        "moe_permute_fusion": False,
        "moe_router_fusion": False,
        "moe_enable_routing_replay": True,
        "expert_model_parallel_size": parallel.ep,
        "expert_tensor_parallel_size": parallel.expert_tp,
    }


def gpt_model(config: dict, shape: Shape, parallel: Parallel, dtype):
    """An empty Megatron-core GPTModel of the HF model's shape, split as `parallel` says, in
    torch `dtype`, with every fusion off so it runs on the CPU (the replay and the capture
    side both load their shard of the HF weights into it)."""
    import torch
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_layer_local_spec,
    )
    from megatron.core.transformer import TransformerConfig

    moe = moe_settings(shape, parallel) if shape.routing is not None else {}
    transformer = TransformerConfig(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        num_attention_heads=shape.num_heads,
        num_query_groups=shape.num_query_groups,
        kv_channels=shape.head_dim,
        ffn_hidden_size=shape.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=config.get("rms_norm_eps", 1e-6),
        qk_layernorm=shape.qk_norm,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=shape.qkv_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=parallel.tp,
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
        **moe,
    )
    if shape.routing is not None:
        # per-layer specs: MoE layers and the dense ones (mlp_only_layers, decoder_sparse_step)
        spec = get_gpt_decoder_block_spec(
            transformer, use_transformer_engine=False, normalization="RMSNorm"
        )
    else:
        spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=shape.qk_norm)
    return GPTModel(
        config=transformer,
        transformer_layer_spec=spec,
        vocab_size=shape.vocab_size,
        max_sequence_length=config.get("max_position_embeddings", 4096),
        position_embedding_type="rope",
        rotary_base=rotary_base(config),
        share_embeddings_and_output_weights=shape.tied,
        parallel_output=True,
    )


def config_as_built(model, config: dict) -> dict:
    """The model config the built GPTModel computes with, in config.json's words (what lpx
    records as the side's config): what megatron was given, read off its TransformerConfig
    and rotary embedding. The converter gives it no RoPE scaling and no window, so a
    checkpoint's YaRN or sliding window shows here as missing, as it is."""
    transformer = model.config
    return {
        "model_type": config.get("model_type"),
        "num_hidden_layers": transformer.num_layers,
        "hidden_size": transformer.hidden_size,
        "num_attention_heads": transformer.num_attention_heads,
        "num_key_value_heads": transformer.num_query_groups,
        "head_dim": transformer.kv_channels,
        "rms_norm_eps": transformer.layernorm_epsilon,
        "rope_parameters": {"rope_type": "default", "rope_theta": rotary_base(config)},
        "max_position_embeddings": model.max_sequence_length,
        "tie_word_embeddings": bool(model.share_embeddings_and_output_weights),
        "sliding_window": getattr(transformer, "window_size", None),
        "quantization_config": config.get("quantization_config"),
    }


def rotary_base(config: dict) -> int:
    """The RoPE base GPTModel is given: the config's theta, as an integer (megatron's type)."""
    return int(
        (config.get("rope_parameters") or {}).get("rope_theta") or config.get("rope_theta", 10000)
    )


def initialize_parallel(parallel: Parallel) -> None:
    """megatron's process groups for `parallel` (rebuilt when a second model is opened in the
    same process: megatron keeps them in globals)."""
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.router_replay import RouterReplay

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    # Each router registers itself in a class-level list; a new model starts a new list.
    RouterReplay.clear_global_router_replay_instances()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=parallel.tp,
        expert_model_parallel_size=parallel.ep,
        expert_tensor_parallel_size=parallel.expert_tp,
    )


def place_of_this_rank() -> Place:
    from megatron.core import parallel_state

    return Place(
        tp=parallel_state.get_tensor_model_parallel_rank(),
        ep=parallel_state.get_expert_model_parallel_rank(),
        etp=parallel_state.get_expert_tensor_parallel_rank(),
    )


def load_hf_weights(model_dir) -> dict:
    from safetensors.torch import load_file

    weights = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        weights.update(load_file(path))
    return weights


def cpu_moe_shims() -> None:
    """megatron's alltoall token dispatcher copies its split sizes to the host on a CUDA side
    stream (a stream, the current stream, an event it synchronizes). On a CPU rank the
    tensors are already on the host: the stream becomes a no-op (pipeline.devices) and the
    copy a plain `.numpy()` (what it yields on CUDA). For a process that scores on the CPU."""
    import torch
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    from pipeline.devices import cpu_streams_do_nothing

    # megatron-core 0.16.1 names te_general_gemm only when Transformer Engine imports; the
    # router's gating linear reads it either way (None: plain torch.mm).
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    token_dispatcher.MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = cpu_streams_do_nothing()

    def to_host(tensor, as_numpy: bool = False, record_stream: bool = False):
        if torch.is_tensor(tensor) and as_numpy:
            return tensor.cpu().numpy()
        return tensor

    token_dispatcher.maybe_move_tensor_to_cpu = to_host
