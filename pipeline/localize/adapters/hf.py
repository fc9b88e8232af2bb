"""Capture from a Hugging Face transformers model through module hooks.

Every boundary is read where the model computes it: forward hooks on the embedding, the norms,
the attention and MLP modules, the router and the head; q, k and v after RoPE through an
attention function registered with transformers that wraps SDPA (the model calls it with the
rotated tensors). The same hooks replace a boundary's output for an activation swap. FSDP and
DeepSpeed sides reuse this adapter on the model they gather in full.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from pipeline.engines.base import knobs_from_dict
from pipeline.errors import BadInput
from pipeline.localize import seeded

ATTENTION = "lpx_capture"
REFERENCE = {"float32": "float64", "bfloat16": "float32", "float16": "float32"}


@dataclass(frozen=True)
class CaptureKnobs:
    dtype: str = "float32"
    fault: str = ""  # a seeded fault (pipeline.localize.seeded), for proving the localiser
    fault_layer: int = 0


@dataclass
class _Pass:
    """What the hooks do during one forward: where rows go, what replaces them."""

    sink: object
    replace: dict = field(default_factory=dict)
    length: int = 0


_ACTIVE: list[_Pass] = []  # the pass in flight (hooks are module-level; forwards do not nest)


def open_session(model_dir: Path, knobs: dict, device: str = "cpu", spec: str = "hf"):
    settings = knobs_from_dict(CaptureKnobs, knobs, "hf capture")
    if settings.fault and settings.fault not in seeded.FAULTS:
        raise BadInput(
            f"{spec}: unknown fault {settings.fault!r}; known: {', '.join(seeded.FAULTS)}."
        )
    return HFCapture(Path(model_dir), settings, device, name=spec)


def rows(tensor) -> np.ndarray:
    """[1, T, ...] or [T, ...] -> [T, F] numpy, fp32 kept fp32 and fp64 kept fp64."""
    import torch

    tensor = tensor.detach()
    if tensor.dim() >= 3 and tensor.shape[0] == 1:
        tensor = tensor[0]
    if tensor.dtype not in (torch.float64, torch.int64, torch.int32):
        tensor = tensor.float()
    return tensor.reshape(tensor.shape[0], -1).cpu().numpy()


class HFCapture:
    can_replace = True

    def __init__(self, model_dir: Path, settings: CaptureKnobs, device: str, name: str = "hf"):
        self.model_dir = model_dir
        self.settings = settings
        self.device = device
        self.name = name
        self.dtype = settings.dtype
        self.reference_dtype = REFERENCE[settings.dtype]
        self._models: dict[str, object] = {}
        config = self._config()
        self.num_layers = config.num_hidden_layers
        self.moe_layers = _moe_layers(config)
        self.layout = {"engine": "hf", "tp": 1, "world_size": 1, "dtype": self.dtype}
        if settings.fault:
            self.layout["fault"] = settings.fault
            self.layout["fault_layer"] = settings.fault_layer

    @property
    def boundaries(self) -> list[str]:
        names = ["embed"]
        for layer in range(self.num_layers):
            kinds = ["input_norm", "q", "k", "v", "attn_out", "mlp_in"]
            if layer in self.moe_layers:
                kinds += ["router_logits", "experts"]
            names += [f"layers.{layer}.{kind}" for kind in kinds + ["mlp_out"]]
        return names + ["final_norm", "logits"]

    def capture(self, token_ids, precision: str, sink, replace: dict | None = None) -> None:
        import torch

        model = self.model(precision)
        length = len(token_ids)
        ids = torch.tensor([list(token_ids)], device=self.device)
        fault = self.settings.fault or None
        _ACTIVE.append(_Pass(sink, dict(replace or {}), length))
        try:
            with torch.no_grad():
                model(
                    input_ids=ids,
                    position_ids=_to(seeded.position_ids(length, fault), self.device),
                    use_cache=False,
                    logits_to_keep=0,
                )
        finally:
            _ACTIVE.pop()

    @contextlib.contextmanager
    def module_swap(self, boundary: str, donor: HFCapture):
        """Run with the donor's module (its weights, in its dtype) for `boundary`."""
        import torch

        model, other = self.model("declared"), donor.model("declared")
        path = _module_path(boundary)
        parent_path, _, attribute = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        original = getattr(parent, attribute)
        # The copy keeps the donor's capture hooks, which report the same boundary names.
        borrowed = copy.deepcopy(other.get_submodule(path))
        own_dtype = next(original.parameters()).dtype
        donor_dtype = next(borrowed.parameters()).dtype
        if donor_dtype != own_dtype:
            borrowed.register_forward_pre_hook(_cast_inputs(donor_dtype), with_kwargs=True)
            borrowed.register_forward_hook(_cast_output(own_dtype))
        setattr(parent, attribute, borrowed)
        try:
            yield
        finally:
            setattr(parent, attribute, original)
            del borrowed
            if torch.cuda.is_available():
                torch.cuda.empty_cache()

    def model(self, precision: str):
        dtype = self.dtype if precision == "declared" else self.reference_dtype
        if dtype not in self._models:
            self._models[dtype] = self._load(dtype)
        return self._models[dtype]

    def close(self) -> None:
        self._models.clear()

    def _config(self):
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(str(self.model_dir), local_files_only=True)
        seeded.configure(config, self.settings.fault or None)
        return config

    def _load(self, dtype: str):
        import torch
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        from pipeline.engines.model_dir import check_model_dir

        check_model_dir(self.model_dir)
        _register_attention()
        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        model = AutoModelForCausalLM.from_pretrained(
            str(self.model_dir),
            config=self._config(),
            dtype=getattr(torch, dtype),
            attn_implementation=ATTENTION,
            local_files_only=True,
        )
        model.eval().requires_grad_(False)
        if self.device != "cpu":
            model.to(self.device)
        seeded.apply(model, self.settings.fault or None, self.settings.fault_layer)
        _install_hooks(model, self.settings)
        return model


def _moe_layers(config) -> set[int]:
    experts = getattr(config, "num_experts", 0) or 0
    if not experts:
        return set()
    step = getattr(config, "decoder_sparse_step", 1) or 1
    dense = set(getattr(config, "mlp_only_layers", []) or [])
    return {i for i in range(config.num_hidden_layers) if i not in dense and (i + 1) % step == 0}


def _module_path(boundary: str) -> str:
    from pipeline.localize.boundaries import kind_of, layer_of

    kind, layer = kind_of(boundary), layer_of(boundary)
    prefix = f"model.layers.{layer}."
    return {
        "embed": "model.embed_tokens",
        "input_norm": prefix + "input_layernorm",
        "q": prefix + "self_attn.q_proj",
        "k": prefix + "self_attn.k_proj",
        "v": prefix + "self_attn.v_proj",
        "attn_out": prefix + "self_attn.o_proj",
        "mlp_in": prefix + "post_attention_layernorm",
        "router_logits": prefix + "mlp.gate",
        "experts": prefix + "mlp.gate",
        "mlp_out": prefix + "mlp",
        "final_norm": "model.norm",
        "logits": "lm_head",
    }[kind]


def _install_hooks(model, settings: CaptureKnobs) -> None:
    """Hooks on every boundary's module; each emits (and may replace) that boundary's rows."""
    model.model.embed_tokens.register_forward_hook(_output_hook("embed"))
    for index, decoder in enumerate(model.model.layers):
        prefix = f"layers.{index}."
        decoder.input_layernorm.register_forward_hook(_output_hook(prefix + "input_norm"))
        decoder.self_attn.register_forward_hook(_output_hook(prefix + "attn_out", tuple_index=0))
        decoder.post_attention_layernorm.register_forward_hook(_output_hook(prefix + "mlp_in"))
        gate = getattr(decoder.mlp, "gate", None)
        if gate is not None and hasattr(decoder.mlp, "experts"):
            flip = settings.fault == "moe_routing_flip" and settings.fault_layer == index
            gate.register_forward_hook(_router_hook(prefix, gate, flip))
        decoder.mlp.register_forward_hook(_output_hook(prefix + "mlp_out"))
    model.model.norm.register_forward_hook(_output_hook("final_norm"))
    model.lm_head.register_forward_hook(_output_hook("logits"))
    for decoder in model.model.layers:
        decoder.self_attn.lpx_fault = settings.fault or None


def _output_hook(name: str, tuple_index: int | None = None):
    def hook(module, args, output):
        current = _ACTIVE[-1] if _ACTIVE else None
        if current is None:
            return None
        tensor = output if tuple_index is None else output[tuple_index]
        if name in current.replace:
            tensor = _like(current.replace[name], tensor)
        current.sink(name, rows(tensor))
        if name not in current.replace:
            return None
        return tensor if tuple_index is None else (tensor, *output[1:])

    return hook


def _router_hook(prefix: str, gate, flip: bool):
    """Router logits and chosen experts; a swap of `experts` keeps this side's logits and
    re-derives the routing weights for the other side's choice."""
    import torch

    def hook(module, args, output):
        current = _ACTIVE[-1] if _ACTIVE else None
        logits, scores, indices = output
        if flip:
            indices = seeded.flip_routing(logits, indices, gate.top_k)
        if current is not None:
            name = prefix + "router_logits"
            if name in current.replace:
                logits = _like(current.replace[name], logits).reshape(logits.shape)
            current.sink(name, rows(logits))
            name = prefix + "experts"
            if name in current.replace:
                indices = torch.as_tensor(current.replace[name], device=indices.device).to(
                    indices.dtype
                )
        probs = torch.softmax(logits, dtype=torch.float, dim=-1)
        scores = torch.gather(probs, -1, indices)
        if getattr(gate, "norm_topk_prob", False):
            scores = scores / scores.sum(dim=-1, keepdim=True)
        if current is not None:
            current.sink(prefix + "experts", np.sort(indices.cpu().numpy(), axis=-1))
        return logits, scores.to(logits.dtype), indices

    return hook


def _attention(module, query, key, value, attention_mask, **kwargs):
    """SDPA, with q/k (after RoPE) and v captured, and replaced on a swap."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    current = _ACTIVE[-1] if _ACTIVE else None
    if current is not None:
        prefix = f"layers.{module.layer_idx}."
        tensors = {"q": query, "k": key, "v": value}
        for kind, tensor in tensors.items():
            name = prefix + kind
            if name in current.replace:
                tensors[kind] = _heads_like(current.replace[name], tensor)
            current.sink(name, rows(_heads_to_rows(tensors[kind])))
        query, key, value = tensors["q"], tensors["k"], tensors["v"]
    mask = seeded.attention_mask(query.shape[2], getattr(module, "lpx_fault", None), query.device)
    if mask is not None:
        attention_mask, kwargs["is_causal"] = mask, False
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def _register_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, _attention)


def _heads_to_rows(tensor):
    """[1, heads, T, D] -> [T, heads * D]."""
    return tensor[0].transpose(0, 1).reshape(tensor.shape[2], -1)


def _heads_like(values: np.ndarray, like):
    import torch

    _, heads, length, dim = like.shape
    tensor = torch.as_tensor(values, device=like.device).to(like.dtype)
    return tensor.reshape(length, heads, dim).transpose(0, 1)[None].contiguous()


def _like(values: np.ndarray, like):
    import torch

    return torch.as_tensor(values, device=like.device).to(like.dtype).reshape(like.shape)


def _to(tensor, device):
    return None if tensor is None else tensor.to(device)


def _cast_inputs(dtype):
    import torch

    def hook(module, args, kwargs):
        cast = tuple(a.to(dtype) if torch.is_floating_point(a) else a for a in args)
        return cast, kwargs

    return hook


def _cast_output(dtype):
    import torch

    def hook(module, args, output):
        if isinstance(output, tuple):
            return tuple(o.to(dtype) if torch.is_floating_point(o) else o for o in output)
        return output.to(dtype)

    return hook
