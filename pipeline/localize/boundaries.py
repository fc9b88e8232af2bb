"""The boundaries lpx captures, in the order data flows through a decoder-only transformer.

A boundary is a name: `embed`, `layers.{i}.{kind}` for i in 0..L-1, `final_norm`, `logits`.
Every capture adapter emits arrays in the Hugging Face layout, one row per token position:

- `q`, `k`: after RoPE, heads concatenated in HF order ([T, heads * head_dim]);
- `v`: [T, kv_heads * head_dim];
- `router_logits`: [T, experts]; `experts`: the chosen expert ids, sorted ([T, top_k]);
- everything else: [T, hidden] (or [T, vocab] for `logits`).
"""

from __future__ import annotations

from dataclasses import dataclass

LAYER_KINDS = (
    "input_norm",
    "q",
    "k",
    "v",
    "attn_out",
    "mlp_in",
    "router_logits",
    "experts",
    "mlp_out",
)
# Ops that act the same way at every layer: swapping an op "from layer i on" swaps the whole
# family, because one misconfiguration (an eps, a rope theta, a mask) reaches all its members.
FAMILY = {
    "input_norm": "norm",
    "mlp_in": "norm",
    "final_norm": "norm",
    "q": "qkv",
    "k": "qkv",
    "v": "qkv",
    "attn_out": "attention",
    "router_logits": "router",
    "experts": "router",
    "mlp_out": "mlp",
    "embed": "embed",
    "logits": "head",
}
# Boundaries whose rows are discrete choices, compared by agreement rather than distance.
DISCRETE = frozenset({"experts"})


@dataclass(frozen=True, order=True)
class Boundary:
    """A boundary's place in network order: (stage, layer, kind index)."""

    stage: int  # 0 embed, 1 layers, 2 final norm, 3 logits
    layer: int
    kind_index: int

    @property
    def kind(self) -> str:
        if self.stage == 1:
            return LAYER_KINDS[self.kind_index]
        return ("embed", None, "final_norm", "logits")[self.stage]

    @property
    def name(self) -> str:
        return f"layers.{self.layer}.{self.kind}" if self.stage == 1 else self.kind

    @property
    def family(self) -> str:
        return FAMILY[self.kind]


def parse(name: str) -> Boundary:
    """The boundary for a name; ValueError for anything that is not one."""
    if name == "embed":
        return Boundary(0, -1, 0)
    if name == "final_norm":
        return Boundary(2, 1 << 30, 0)
    if name == "logits":
        return Boundary(3, 1 << 30, 0)
    parts = name.split(".")
    if len(parts) == 3 and parts[0] == "layers" and parts[1].isdigit() and parts[2] in LAYER_KINDS:
        return Boundary(1, int(parts[1]), LAYER_KINDS.index(parts[2]))
    raise ValueError(f"{name!r} is not a boundary")


def kind_of(name: str) -> str:
    return parse(name).kind


def layer_of(name: str) -> int | None:
    boundary = parse(name)
    return boundary.layer if boundary.stage == 1 else None


def in_order(names) -> list[str]:
    return sorted(names, key=parse)


def family_from(names, first: str) -> list[str]:
    """The boundaries of `first`'s family at its layer and every later one (the final norm
    belongs to the norm family and comes after every layer)."""
    start = parse(first)
    return [
        n
        for n in in_order(names)
        if parse(n).family == start.family
        and (parse(n).stage, parse(n).layer) >= (start.stage, start.layer)
    ]


def model_boundaries(num_layers: int, moe_layers: set[int]) -> list[str]:
    """Every boundary of a decoder of `num_layers`, routers only on its MoE layers."""
    names = ["embed"]
    for layer in range(num_layers):
        kinds = ["input_norm", "q", "k", "v", "attn_out", "mlp_in"]
        if layer in moe_layers:
            kinds += ["router_logits", "experts"]
        names += [f"layers.{layer}.{kind}" for kind in kinds + ["mlp_out"]]
    return names + ["final_norm", "logits"]


def moe_layers(config: dict) -> set[int]:
    """The layers with a router, from an HF config as a dict (pipeline.families.routing:
    Qwen2/3-MoE's sparse step and MLP-only layers, Mixtral's num_local_experts)."""
    from pipeline.families import routing

    spec = routing(config)
    return set(spec.layers) if spec else set()
