"""What a model family is: its name, config class, attention and expert settings. Apart
from the registry (`pipeline.families`), so each family's module imports this and the
registry imports the modules, with no circle."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Experts:
    """How a family names its mixture-of-experts settings in the HF config."""

    count_key: str = "num_experts"
    top_k_key: str = "num_experts_per_tok"
    ffn_key: str = "moe_intermediate_size"
    shared_ffn_key: str | None = None  # Qwen2-MoE's shared expert (with a sigmoid gate)
    norm_topk_prob_default: bool = False


@dataclass(frozen=True)
class Family:
    name: str  # `lpx make-model --arch`, and the HF model_type
    config_class: str  # the transformers config class make-model builds
    qkv_bias: bool = False
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3)
    experts: Experts | None = None
    tiny: dict = field(default_factory=dict)  # make-model's fields beyond the shared ones

    @property
    def moe(self) -> bool:
        return self.experts is not None


@dataclass(frozen=True)
class Routing:
    """A MoE model's routing settings, read from its HF config."""

    num_experts: int
    top_k: int
    ffn_hidden_size: int
    shared_ffn_hidden_size: int  # 0: no shared expert
    norm_topk_prob: bool
    layers: frozenset[int]  # the decoder layers that route (the others are dense MLPs)
