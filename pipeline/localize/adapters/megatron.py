"""Capture from a megatron-core GPTModel with tensor parallelism, un-sharded to the HF layout.

Spec: `megatron:tp=2,dtype=fp32`. The model is built and its HF weights converted as for the
Megatron replay (`pipeline.engines.megatron_convert`: local layer spec, RMSNorm, RoPE, gated
SiLU MLP), one TP rank per process. Megatron modules and the boundaries they give:

- `embedding` -> embed (the vocab-parallel lookup, already all-reduced);
- `decoder.layers.i.input_layernorm` -> input_norm, `pre_mlp_layernorm` -> mlp_in;
- the inputs of `self_attention.core_attention` -> q, k, v: after RoPE, each rank's heads
  gathered over the TP group; ranks hold contiguous runs of query groups, so rank order is HF
  head order ([T, heads * head_dim]);
- `self_attention` and `mlp` outputs (after their row-parallel all-reduce) -> attn_out, mlp_out;
- `decoder.final_layernorm` -> final_norm; `output_layer` -> logits, gathered over the
  vocabulary shards.

Megatron works sequence-first ([T, batch, ...]); rows come out token-first like every
adapter's. A swap puts the other side's rows in at the same places, each rank taking its own
heads (q, k, v) or vocabulary slice (logits). The floor of fp32 is measured against fp64:
with neither `fp16` nor `bf16` set, megatron-core's local attention, softmax and norms run in
the parameters' dtype, so an fp64 model is fp64 throughout (RoPE angles are computed in fp32,
as HF computes them too).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.engines.base import knobs_from_dict
from pipeline.errors import BadInput, EngineNotInstalled
from pipeline.localize.adapters._workers import WorkerGroup, WorkerSession
from pipeline.localize.adapters.hf import REFERENCE, CaptureKnobs, HFCapture

ARCHITECTURES = ("llama", "qwen2")


@dataclass(frozen=True)
class MegatronCaptureKnobs:
    tp: int = field(default=2, metadata={"min": 1})  # tensor-parallel ranks (the world size)
    dtype: str = "float32"
    # Seconds to wait for the ranks to start, or for any one reply during a capture.
    timeout: float = field(default=600.0, metadata={"min": 1})


def open_session(model_dir: Path, knobs: dict, device: str = "cpu", spec: str = "megatron"):
    from pipeline import devices
    from pipeline.engines.megatron_convert import Shape
    from pipeline.engines.model_dir import check_model_dir

    settings = knobs_from_dict(MegatronCaptureKnobs, knobs, "megatron capture")
    model_dir = Path(model_dir)
    check_model_dir(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    if config.get("model_type") not in ARCHITECTURES:
        raise BadInput(
            f"{spec}: megatron capture converts {' and '.join(ARCHITECTURES)} models, not "
            f"{config.get('model_type')!r}; capture this model with hf, fsdp or deepspeed."
        )
    shape = Shape.from_hf_config(config)
    if shape.num_query_groups % settings.tp or shape.vocab_size % settings.tp:
        raise BadInput(
            f"{spec}: tp={settings.tp} must divide the key/value heads "
            f"({shape.num_query_groups}) and the vocabulary ({shape.vocab_size})."
        )
    kind = devices.device_kind(device)
    devices.check_ranks(settings.tp, devices.resolve_device(device))
    rank_knobs = {"tp": settings.tp, "dtype": settings.dtype}
    group = WorkerGroup("megatron", model_dir, rank_knobs, settings.tp, kind, settings.timeout)
    layout = {"engine": "megatron", "world_size": settings.tp, "tp": settings.tp}
    layout["dtype"] = settings.dtype
    return WorkerSession(
        spec,
        group,
        settings.dtype,
        REFERENCE[settings.dtype],
        layout,
        # The HF model's boundaries (read from its config): the same names, dense layers only.
        HFCapture(model_dir, CaptureKnobs(dtype=settings.dtype), "cpu").boundaries,
    )


def open_rank(model_dir: Path, knobs: dict, device: str, world_size: int):
    return MegatronRank(Path(model_dir), int(knobs["tp"]), knobs["dtype"], device)


class MegatronRank:
    """One TP rank: a GPTModel per precision, hooked to emit (and swap) HF-layout rows."""

    def __init__(self, model_dir: Path, tp: int, dtype: str, device: str):
        try:
            from megatron.core import parallel_state
            from megatron.core.tensor_parallel.random import initialize_rng_tracker
        except ImportError as error:
            raise EngineNotInstalled(
                f"engine 'megatron' is not installed ({error}); install it with "
                "`pip install -e '.[megatron]'`."
            ) from None
        from pipeline.devices import cpu_stands_in_for_cuda, is_cuda
        from pipeline.engines.megatron_convert import Shape

        if not is_cuda(device):
            cpu_stands_in_for_cuda()
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
        initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
        self.group = parallel_state.get_tensor_model_parallel_group()
        self.tp, self.tp_rank = tp, parallel_state.get_tensor_model_parallel_rank()
        self.model_dir, self.device = model_dir, device
        self.config = json.loads((model_dir / "config.json").read_text())
        self.shape = Shape.from_hf_config(self.config)
        self.dtypes = {"declared": dtype, "reference": REFERENCE[dtype]}
        self._models: dict[str, object] = {}
        self._pass: dict | None = None  # {"sink", "replace"} while a forward runs

    def capture(self, token_ids, precision: str, sink, replace: dict) -> None:
        import torch

        model = self._model(precision)
        length = len(token_ids)
        ids = torch.tensor([list(token_ids)], device=self.device)
        positions = torch.arange(length, device=self.device)[None]
        # Megatron's mask: True = masked (its default causal mask is made on "cuda").
        mask = ~torch.ones(length, length, dtype=torch.bool, device=self.device).tril()
        self._pass = {"sink": sink, "replace": replace or {}}
        try:
            with torch.no_grad():
                model(input_ids=ids, position_ids=positions, attention_mask=mask[None, None])
        finally:
            self._pass = None

    def _model(self, precision: str):
        if precision not in self._models:
            model = build_model(
                self.model_dir,
                self.config,
                self.shape,
                self.tp,
                self.tp_rank,
                self.device,
                self.dtypes[precision],
            )
            self._install_hooks(model)
            self._models[precision] = model
        return self._models[precision]

    def _install_hooks(self, model) -> None:
        model.embedding.register_forward_hook(self._hidden("embed"))
        for index, layer in enumerate(model.decoder.layers):
            prefix = f"layers.{index}."
            layer.input_layernorm.register_forward_hook(self._hidden(prefix + "input_norm"))
            attention = layer.self_attention
            attention.core_attention.register_forward_pre_hook(self._qkv(prefix))
            attention.register_forward_hook(self._hidden(prefix + "attn_out", in_tuple=True))
            layer.pre_mlp_layernorm.register_forward_hook(self._hidden(prefix + "mlp_in"))
            layer.mlp.register_forward_hook(self._hidden(prefix + "mlp_out", in_tuple=True))
        model.decoder.final_layernorm.register_forward_hook(self._hidden("final_norm"))
        model.output_layer.register_forward_hook(self._logits)

    def _hidden(self, name: str, in_tuple: bool = False):
        """A [T, 1, hidden] output, the same on every TP rank."""

        def hook(module, args, output):
            tensor = output[0] if in_tuple else output
            swapped = self._swapped(name, tensor, dim=None)
            self._emit(name, swapped if swapped is not None else tensor)
            if swapped is None:
                return None
            return (swapped, *output[1:]) if in_tuple else swapped

        return hook

    def _qkv(self, prefix: str):
        """q, k, v ([T, 1, local heads, head_dim]) after RoPE, gathered into HF head order."""

        def hook(module, args):
            tensors = list(args[:3])
            for index, kind in enumerate("qkv"):
                swapped = self._swapped(prefix + kind, tensors[index], dim=2)
                if swapped is not None:
                    tensors[index] = swapped
                self._emit(prefix + kind, self._gather(tensors[index], dim=2))
            return (*tensors, *args[3:])

        return hook

    def _logits(self, module, args, output):
        """[T, 1, vocab / tp] logits, gathered over the vocabulary shards."""
        local = output[0]
        swapped = self._swapped("logits", local, dim=2)
        if swapped is not None:
            local = swapped
        self._emit("logits", self._gather(local, dim=2))
        return None if swapped is None else (local, *output[1:])

    def _swapped(self, name: str, like, dim: int | None):
        """This rank's part of the other side's rows for `name`, shaped like `like`: the
        whole of it (dim None), or this rank's slice of dimension `dim` (heads, vocabulary)."""
        import torch

        if self._pass is None or name not in self._pass["replace"]:
            return None
        rows = torch.as_tensor(self._pass["replace"][name]).to(like.dtype)
        if dim is not None:
            full = list(like.shape)
            full[dim] *= self.tp
            size = like.shape[dim]
            rows = rows.reshape(full).narrow(dim, self.tp_rank * size, size)
        return rows.reshape(like.shape).to(like.device).contiguous()

    def _gather(self, local, dim: int):
        import torch
        import torch.distributed as dist

        if self.tp == 1:
            return local
        parts = [torch.empty_like(local) for _ in range(self.tp)]
        dist.all_gather(parts, local.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)

    def _emit(self, name: str, tensor) -> None:
        from pipeline.localize.adapters.hf import rows

        if self._pass is not None:
            self._pass["sink"](name, rows(tensor[:, 0]))


def build_model(model_dir: Path, config: dict, shape, tp: int, tp_rank: int, device, dtype: str):
    """The GPTModel the Megatron replay builds, in `dtype` (fp64 included), with this TP
    rank's shard of the HF weights."""
    import torch
    from safetensors.torch import load_file

    from pipeline.engines.megatron_convert import gpt_model, hf_to_megatron

    torch_dtype = getattr(torch, dtype)
    model = gpt_model(config, shape, tp, torch_dtype)
    weights = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        weights.update(load_file(path))
    shard = hf_to_megatron(weights, shape, tp, tp_rank)
    missing, unexpected = model.load_state_dict(
        {k: v.to(torch_dtype) for k, v in shard.items()}, strict=False
    )
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise BadInput(
            f"{model_dir}: the megatron conversion does not fit this model (missing "
            f"{missing[:5]}, unexpected {unexpected[:5]})."
        )
    return model.to(device=device, dtype=torch_dtype).eval().requires_grad_(False)
