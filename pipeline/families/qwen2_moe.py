"""Qwen2-MoE: Qwen2 attention (qkv bias), experts chosen by a softmax router's top-k, plus
one shared expert behind a sigmoid gate; top-k weights not renormalised by default."""

from pipeline.families.family import Experts, Family

FAMILY = Family(
    name="qwen2_moe",
    config_class="Qwen2MoeConfig",
    qkv_bias=True,
    experts=Experts(shared_ffn_key="shared_expert_intermediate_size"),
    tiny={
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 64,
        "shared_expert_intermediate_size": 128,
        "norm_topk_prob": False,
    },
)
