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
from pipeline.faults import capture as seeded
from pipeline.localize.boundaries import model_boundaries, moe_layers

ATTENTION = "lpx_capture"
REFERENCE = {"float32": "float64", "bfloat16": "float32", "float16": "float32"}


@dataclass(frozen=True)
class CaptureKnobs:
    dtype: str = "float32"
    fault: str = ""  # a seeded fault (pipeline.faults.capture), for proving the localiser
    fault_layer: int = 0
    fault_step: float = 0.0  # stale_layer's step relative to each matrix's RMS (0: seeded's)
    attention: str = "sdpa"  # sdpa or eager: two kernels of one model, for clean pairs


@dataclass
class _Pass:
    """What the hooks do during one forward of a right-padded batch: where each sequence's
    rows go (`sink(index, boundary, rows)`), and what replaces them on a swap.

    By default a replaced boundary reports the rows it was replaced with (what flows on). With
    `own_first` it reports the op's own output, computed from the (replaced) inputs before it
    is replaced: that op's own contribution given matched inputs (the step rule, verdict.py)."""

    sink: object
    lengths: list
    replace: list = field(default_factory=list)
    own_first: bool = False

    def swapped(self, name: str) -> bool:
        return bool(self.replace) and all(name in r for r in self.replace)

    def padded(self, name: str, like):
        """The replacement rows of every sequence as one [B, T, F] tensor like `like`: padded
        in numpy and cast once (one small torch op per sequence costs more than the copy)."""
        import torch

        batch, length = len(self.lengths), max(self.lengths)
        every = [r[name] for r in self.replace]
        out = np.zeros((batch, length, *every[0].shape[1:]), dtype=every[0].dtype)
        for index, values in enumerate(every):
            out[index, : values.shape[0]] = values.reshape(values.shape[0], *out.shape[2:])
        return torch.from_numpy(out).to(device=like.device, dtype=like.dtype)

    def passed(self, name: str, tensor):
        """Emit `name`'s rows of a [B, T, ...] tensor and return what flows on: on a swap the
        replacement (reported as such, or with `own_first` after the op's own rows)."""
        if not self.swapped(name):
            self.emit(name, tensor)
            return tensor
        replaced = self.padded(name, tensor)
        self.emit(name, tensor if self.own_first else replaced)
        return replaced

    def emit(self, name: str, tensor) -> None:
        """Each sequence's rows of a [B, T, ...] tensor, cut to its own length (converted to
        numpy once for the batch)."""
        values = rows(tensor.reshape(-1, *tensor.shape[2:]))
        values = values.reshape(tensor.shape[0], tensor.shape[1], -1)
        for index, length in enumerate(self.lengths):
            self.sink(index, name, values[index, :length])


_ACTIVE: list[_Pass] = []  # the pass in flight (hooks are module-level; forwards do not nest)


def open_session(model_dir: Path, knobs: dict, device: str = "cpu", spec: str = "hf"):
    settings = knobs_from_dict(CaptureKnobs, knobs, "hf capture")
    if settings.attention not in ("sdpa", "eager"):
        raise BadInput(f"{spec}: attention={settings.attention!r}; use sdpa or eager.")
    if settings.fault and settings.fault not in seeded.FAULTS:
        raise BadInput(
            f"{spec}: unknown fault {settings.fault!r}; known: {', '.join(seeded.FAULTS)}."
        )
    return HFCapture(Path(model_dir), settings, device, name=spec)


def rows(tensor) -> np.ndarray:
    """[T, ...] -> [T, F] numpy; fp64 and integer ids keep their type, the rest become fp32."""
    import torch

    tensor = tensor.detach()
    if tensor.dtype not in (torch.float64, torch.int64, torch.int32):
        tensor = tensor.float()
    return tensor.reshape(tensor.shape[0], -1).cpu().numpy()


class HFCapture:
    can_replace = True
    scores_own = True  # a replaced boundary can report its own output first (own_first)

    def __init__(self, model_dir: Path, settings: CaptureKnobs, device: str, name: str = "hf"):
        self.model_dir = model_dir
        self.settings = settings
        self.device = device
        self.name = name
        self.dtype = settings.dtype
        self.reference_dtype = REFERENCE[settings.dtype]
        self._models: dict[str, object] = {}
        config = load_config(model_dir, settings)
        self.num_layers = config.num_hidden_layers
        self.moe_layers = moe_layers(config.to_dict())
        self.layout = {
            "engine": "hf",
            "tp": 1,
            "world_size": 1,
            "dtype": self.dtype,
            "attention": settings.attention,
        }
        if settings.fault:
            self.layout["fault"] = settings.fault
            self.layout["fault_layer"] = settings.fault_layer
        if settings.fault_step:
            self.layout["fault_step"] = settings.fault_step

    @property
    def boundaries(self) -> list[str]:
        return model_boundaries(self.num_layers, self.moe_layers)

    def capture(
        self, token_ids, precision: str, sink, replace: dict | None = None, own_first=False
    ) -> None:
        model = self.model(precision)
        captured_forward(
            model, token_ids, sink, replace, self.device, self.settings.fault, own_first
        )

    def capture_batch(
        self, batch, precision: str, sink, replace: list | None = None, own_first=False
    ) -> None:
        model = self.model(precision)
        captured_batch_forward(
            model, batch, sink, replace, self.device, self.settings.fault, own_first
        )

    @contextlib.contextmanager
    def module_swap(self, boundary: str, donor: HFCapture):
        """Run with the donor's module (its weights, in its dtype) for `boundary`."""
        from pipeline.devices import release_memory

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
            release_memory(self.device)

    def model(self, precision: str):
        dtype = self.dtype if precision == "declared" else self.reference_dtype
        if dtype not in self._models:
            self._models[dtype] = load_hooked_model(
                self.model_dir, self.settings, dtype, self.device
            )
        return self._models[dtype]

    def close(self) -> None:
        self._models.clear()


def load_config(model_dir: Path, settings: CaptureKnobs):
    """The model's HF config, with a seeded fault that lives in the config applied."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
    seeded.configure(config, settings.fault or None)
    return config


def load_hooked_model(model_dir: Path, settings: CaptureKnobs, dtype: str, device: str = "cpu"):
    """The HF model in `dtype` with the capture hooks (and any seeded fault) in place. Engines
    that wrap an HF model (FSDP, DeepSpeed) load theirs here, so every side reads the same
    boundaries the same way."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from pipeline.engines.model_dir import check_model_dir

    check_model_dir(model_dir)
    _register_attention()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(
        str(model_dir),
        config=load_config(model_dir, settings),
        dtype=getattr(torch, dtype),
        attn_implementation=ATTENTION,
        local_files_only=True,
        # Grouped-GEMM experts have no fp64 kernel; the fp64 reference loops over experts.
        **({"experts_implementation": "eager"} if dtype == "float64" else {}),
    )
    model.eval().requires_grad_(False)
    if device != "cpu":
        model.to(device)
    seeded.apply(model, settings.fault or None, settings.fault_layer, settings.fault_step or None)
    _install_hooks(model, settings)
    return model


def captured_forward(
    model,
    token_ids,
    sink,
    replace: dict | None = None,
    device: str = "cpu",
    fault: str = "",
    own_first: bool = False,
) -> None:
    """One forward of one sequence through a hooked model (`load_hooked_model`): each
    boundary's rows go to `sink(boundary, rows)`, and the boundaries named in `replace` are
    swapped in."""
    captured_batch_forward(
        model,
        [token_ids],
        lambda index, name, values: sink(name, values),
        None if replace is None else [replace],
        device,
        fault,
        own_first,
    )


def captured_batch_forward(
    model,
    batch,
    sink,
    replace: list | None = None,
    device: str = "cpu",
    fault: str = "",
    own_first: bool = False,
) -> None:
    """One forward of several sequences, right-padded: under a causal mask no real token sees
    a pad, so each sequence's rows are those of its own forward. `sink(index, boundary, rows)`;
    `replace[index]` maps boundaries to that sequence's rows to swap in; `own_first` as _Pass."""
    import torch

    lengths = [len(ids) for ids in batch]
    width = max(lengths)
    pad = model.config.pad_token_id or 0
    ids = torch.tensor([list(t) + [pad] * (width - len(t)) for t in batch], device=device)
    positions = seeded.position_ids(lengths, width, fault or None)
    _ACTIVE.append(_Pass(sink, lengths, list(replace or []), own_first))
    try:
        with torch.no_grad():
            model(
                input_ids=ids,
                position_ids=_to(positions, device),
                use_cache=False,
                logits_to_keep=0,
            )
    finally:
        _ACTIVE.pop()


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
        decoder.self_attn.lpx_kernel = settings.attention


def _output_hook(name: str, tuple_index: int | None = None):
    def hook(module, args, output):
        current = _ACTIVE[-1] if _ACTIVE else None
        if current is None:
            return None
        own = output if tuple_index is None else output[tuple_index]
        tensor = current.passed(name, own)
        if tensor is own:
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
            batch, length = len(current.lengths), max(current.lengths)
            flowing = current.passed(prefix + "router_logits", logits.reshape(batch, length, -1))
            logits = flowing.reshape(logits.shape)
            name = prefix + "experts"
            if current.swapped(name):
                if current.own_first:
                    current.emit(name, _chosen(indices, batch, length))
                indices = current.padded(name, indices).reshape(indices.shape)
        probs = torch.softmax(logits, dtype=torch.float, dim=-1)
        scores = torch.gather(probs, -1, indices)
        if getattr(gate, "norm_topk_prob", False):
            scores = scores / scores.sum(dim=-1, keepdim=True)
        if current is not None and not (current.own_first and current.swapped(prefix + "experts")):
            current.emit(prefix + "experts", _chosen(indices, batch, length))
        return logits, scores.to(logits.dtype), indices

    return hook


def _attention(module, query, key, value, attention_mask, **kwargs):
    """SDPA (or eager attention), with q/k (after RoPE) and v captured, and replaced on a
    swap (own rows first with `own_first`)."""
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.models.llama.modeling_llama import eager_attention_forward

    current = _ACTIVE[-1] if _ACTIVE else None
    if current is not None:
        prefix = f"layers.{module.layer_idx}."
        tensors = {"q": query, "k": key, "v": value}
        for kind, tensor in tensors.items():
            name = prefix + kind
            own = _heads_to_rows(tensor)
            flowing = current.passed(name, own)
            if flowing is not own:
                tensors[kind] = _rows_to_heads(flowing, tensor)
        query, key, value = tensors["q"], tensors["k"], tensors["v"]
    mask = seeded.attention_mask(query.shape[2], getattr(module, "lpx_fault", None), query.device)
    if mask is not None:
        attention_mask, kwargs["is_causal"] = mask, False
    if getattr(module, "lpx_kernel", "sdpa") == "eager":
        if attention_mask is None:
            attention_mask = _causal_additive(query)
        elif attention_mask.dtype == torch.bool:
            attention_mask = _additive(attention_mask, query.dtype)
        kwargs.pop("is_causal", None)
        return eager_attention_forward(module, query, key, value, attention_mask, **kwargs)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def _causal_additive(query):
    import torch

    length = query.shape[2]
    keep = torch.ones(length, length, dtype=torch.bool, device=query.device).tril()
    return _additive(keep[None, None], query.dtype)


def _additive(keep, dtype):
    import torch

    return torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill(
        ~keep, torch.finfo(dtype).min
    )


def _register_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, _attention)


def _chosen(indices, batch: int, length: int):
    """The chosen experts of a [B*T, k] routing as sorted [B, T, k] rows."""
    import torch

    return torch.sort(indices, dim=-1).values.reshape(batch, length, -1)


def _heads_to_rows(tensor):
    """[B, heads, T, D] -> [B, T, heads * D]."""
    batch, heads, length, dim = tensor.shape
    return tensor.transpose(1, 2).reshape(batch, length, heads * dim)


def _rows_to_heads(values, like):
    batch, heads, length, dim = like.shape
    return values.reshape(batch, length, heads, dim).transpose(1, 2).contiguous()


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
