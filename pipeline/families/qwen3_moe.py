"""Qwen3-MoE: Qwen3 attention (q/k norms), experts chosen by a softmax router's top-k with
the chosen weights renormalised (norm_topk_prob), no shared expert."""

from pipeline.families.family import Experts, Family

FAMILY = Family(
    name="qwen3_moe",
    config_class="Qwen3MoeConfig",
    qk_norm=True,
    experts=Experts(norm_topk_prob_default=True),
    tiny={
        "head_dim": 32,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 64,
        "norm_topk_prob": True,
    },
)
