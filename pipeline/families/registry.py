"""The registry of model families: every family lpx knows by its HF `model_type`, and what
an HF config's routing is, read with its family's key names."""

from __future__ import annotations

from pipeline.errors import BadInput
from pipeline.families.family import Experts, Family, Routing


def families() -> dict[str, Family]:
    from pipeline.families import llama, qwen2, qwen2_moe, qwen3, qwen3_moe

    return {m.FAMILY.name: m.FAMILY for m in (llama, qwen2, qwen3, qwen2_moe, qwen3_moe)}


def family_of(config: dict, source: str = "config.json") -> Family:
    """The family of an HF config (as a dict); a clear error for one lpx does not know."""
    model_type = config.get("model_type")
    known = families()
    if model_type not in known:
        raise BadInput(
            f"{source}: model_type {model_type!r} is not a family lpx knows "
            f"({', '.join(known)}); add one as a module in pipeline/families/."
        )
    return known[model_type]


def routing(config: dict) -> Routing | None:
    """The routing of an HF config's model, None for a dense one. Reads any config that
    names experts (Mixtral's num_local_experts too), so capture works beyond the registry."""
    family = families().get(config.get("model_type"))
    experts = family.experts if family and family.experts else Experts()
    count = config.get(experts.count_key) or config.get("num_local_experts") or 0
    if not count:
        return None
    step = config.get("decoder_sparse_step") or 1
    dense = set(config.get("mlp_only_layers") or [])
    layers = frozenset(
        i for i in range(config["num_hidden_layers"]) if i not in dense and (i + 1) % step == 0
    )
    norm = config.get("norm_topk_prob")
    shared = config.get(experts.shared_ffn_key) if experts.shared_ffn_key else 0
    return Routing(
        num_experts=int(count),
        top_k=int(config.get(experts.top_k_key) or 2),
        ffn_hidden_size=int(config.get(experts.ffn_key) or config.get("intermediate_size")),
        shared_ffn_hidden_size=int(shared or 0),
        norm_topk_prob=experts.norm_topk_prob_default if norm is None else bool(norm),
        layers=layers,
    )
