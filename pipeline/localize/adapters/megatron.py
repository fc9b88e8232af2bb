"""Capture from a megatron-core GPTModel with tensor (and expert) parallelism, un-sharded to
the HF layout.

Spec: `megatron:tensor_parallel_size=2,dtype=fp32`; for MoE models also
`expert_model_parallel_size=2` and `expert_tensor_parallel_size` (default: the TP size): the
replay's knob names (`tp`, `ep` and `etp` are read too). The ranks are lcm(tp, ep x etp)
processes. The
model is built and its HF weights converted as for the Megatron replay
(`pipeline.engines.megatron.convert`: local layer spec, RMSNorm, RoPE, gated SiLU MLP, q/k
norms, megatron-core's own MoE layer), for every family lpx registers. Every rank runs the
same sequence. Megatron modules and the boundaries they give:

- `embedding` -> embed (the vocab-parallel lookup, already all-reduced);
- `decoder.layers.i.input_layernorm` -> input_norm, `pre_mlp_layernorm` -> mlp_in;
- the inputs of `self_attention.core_attention` -> q, k, v: after RoPE, each rank's heads
  gathered over the TP group; ranks hold contiguous runs of query groups, so rank order is HF
  head order ([T, heads * head_dim]);
- `self_attention` and `mlp` outputs (after their row-parallel all-reduce) -> attn_out, mlp_out
  (a MoE layer's output after its token combine, shared expert included);
- MoE layers: the router's gating logits -> router_logits ([T, experts], whole on every rank:
  routers run before any dispatch); the experts its RouterReplay recorded -> experts (sorted);
- `decoder.final_layernorm` -> final_norm; `output_layer` -> logits, gathered over the
  vocabulary shards.

Megatron works sequence-first ([T, batch, ...]); rows come out token-first like every
adapter's. A swap puts the other side's rows in at the same places, each rank taking its own
heads (q, k, v) or vocabulary slice (logits); swapped router_logits replace the gating
logits (top-k and weights follow from them), swapped experts are forced through megatron's
RouterReplay with this side's router probabilities as gate weights. The floor of fp32 is
measured against fp64: with neither `fp16` nor `bf16` set, megatron-core's local attention,
softmax and norms run in the parameters' dtype, so an fp64 model is fp64 throughout (RoPE
angles are computed in fp32, as HF computes them too).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.engines.base import knobs_from_dict
from pipeline.engines.megatron.convert import Parallel, check_convertible
from pipeline.errors import BadInput, EngineNotInstalled
from pipeline.localize.adapters._workers import WorkerGroup, WorkerSession
from pipeline.localize.adapters.hf import REFERENCE, CaptureKnobs, HFCapture, rows


@dataclass(frozen=True)
class MegatronCaptureKnobs:
    tensor_parallel_size: int = field(default=2, metadata={"min": 1})
    expert_model_parallel_size: int = field(default=1, metadata={"min": 1})  # MoE models
    expert_tensor_parallel_size: int = field(default=0, metadata={"min": 0})  # 0: as TP
    dtype: str = "float32"
    # Seconds to wait for the ranks to start, or for any one reply during a capture.
    timeout: float = field(default=600.0, metadata={"min": 1})


def open_session(model_dir: Path, knobs: dict, device: str = "cpu", spec: str = "megatron"):
    from pipeline import devices
    from pipeline.engines.model_dir import check_model_dir

    settings = capture_settings(knobs, spec)
    model_dir = Path(model_dir)
    check_model_dir(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    parallel = parallel_of(settings)
    world_size = math.lcm(parallel.tp, parallel.ep * parallel.expert_tp)
    # The family and the split, before any rank starts.
    check_convertible(config, parallel, world_size, spec)
    kind = devices.device_kind(device)
    devices.check_ranks(world_size, devices.resolve_device(device))
    rank_knobs = {"tp": parallel.tp, "ep": parallel.ep, "etp": parallel.expert_tp}
    rank_knobs["dtype"] = settings.dtype
    group = WorkerGroup("megatron", model_dir, rank_knobs, world_size, kind, settings.timeout)
    layout = {"engine": "megatron", "world_size": world_size, "tp": parallel.tp}
    if parallel.ep > 1 or parallel.expert_tp != parallel.tp:
        layout.update(ep=parallel.ep, etp=parallel.expert_tp)
    layout["dtype"] = settings.dtype
    return WorkerSession(
        spec,
        group,
        settings.dtype,
        REFERENCE[settings.dtype],
        layout,
        # The HF model's boundaries (read from its config): the same names.
        HFCapture(model_dir, CaptureKnobs(dtype=settings.dtype), "cpu").boundaries,
    )


# The spec's knobs are named as the replay's; the short names earlier specs used still read.
SHORT_NAMES = {
    "tp": "tensor_parallel_size",
    "ep": "expert_model_parallel_size",
    "etp": "expert_tensor_parallel_size",
}


def capture_settings(knobs: dict, spec: str = "megatron") -> MegatronCaptureKnobs:
    """The spec's knobs, a short name read as its long one; the same knob given under both
    names is refused (which value was meant is the user's to say)."""
    named: dict[str, str] = {}
    given: dict[str, str] = {}
    for key, value in knobs.items():
        name = SHORT_NAMES.get(key, key)
        if name in named:
            raise BadInput(f"{spec}: {given[name]} and {key} both set {name}; give it once.")
        named[name], given[name] = value, key
    return knobs_from_dict(MegatronCaptureKnobs, named, "megatron capture")


def parallel_of(settings: MegatronCaptureKnobs) -> Parallel:
    return Parallel(
        tp=settings.tensor_parallel_size,
        ep=settings.expert_model_parallel_size,
        etp=settings.expert_tensor_parallel_size or None,
    )


def open_rank(model_dir: Path, knobs: dict, device: str, world_size: int):
    parallel = Parallel(tp=int(knobs["tp"]), ep=int(knobs.get("ep", 1)), etp=knobs.get("etp"))
    return MegatronRank(Path(model_dir), parallel, knobs["dtype"], device)


class MegatronRank:
    """One rank: a GPTModel per precision, hooked to emit (and swap) HF-layout rows."""

    def __init__(self, model_dir: Path, parallel: Parallel, dtype: str, device: str):
        try:
            from megatron.core import parallel_state
            from megatron.core.tensor_parallel.random import initialize_rng_tracker
        except ImportError as error:
            raise EngineNotInstalled(
                f"engine 'megatron' is not installed ({error}); install it with "
                "`pip install -e '.[megatron]'`."
            ) from None
        from pipeline.devices import cpu_stands_in_for_cuda, is_cuda
        from pipeline.engines.megatron.convert import Shape
        from pipeline.engines.megatron.model import (
            cpu_moe_shims,
            initialize_parallel,
            place_of_this_rank,
        )

        self.config = json.loads((model_dir / "config.json").read_text())
        self.shape = Shape.from_hf_config(self.config, str(model_dir))
        if not is_cuda(device):
            cpu_stands_in_for_cuda()
            if self.shape.routing is not None:
                cpu_moe_shims()
        initialize_parallel(parallel)
        initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
        self.group = parallel_state.get_tensor_model_parallel_group()
        self.parallel, self.place = parallel, place_of_this_rank()
        self.tp, self.tp_rank = parallel.tp, self.place.tp
        self.model_dir, self.device = model_dir, device
        self.dtypes = {"declared": dtype, "reference": REFERENCE[dtype]}
        self._models: dict[str, object] = {}
        self._routers: dict[str, object] = {}
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
        routers = self._routers[precision]
        try:
            if routers:
                routers.begin(self._forced_experts(routers))
            with torch.no_grad():
                model(input_ids=ids, position_ids=positions, attention_mask=mask[None, None])
        finally:
            self._pass = None
            routers.end()

    def _forced_experts(self, routers) -> dict:
        """MoE slot -> the other side's experts ([T, k]) where `experts` is swapped."""
        replace = self._pass["replace"]
        names = {slot: f"layers.{layer}.experts" for slot, layer in enumerate(routers.layers)}
        return {slot: replace[name] for slot, name in names.items() if name in replace}

    def _model(self, precision: str):
        from pipeline.engines.megatron.routing import MegatronRouters

        if precision not in self._models:
            model = build_model(
                self.model_dir,
                self.config,
                self.shape,
                self.parallel,
                self.place,
                self.device,
                self.dtypes[precision],
            )
            routers = MegatronRouters(model)
            self._install_hooks(model, routers)
            self._models[precision], self._routers[precision] = model, routers
        return self._models[precision]

    def _install_hooks(self, model, routers) -> None:
        model.embedding.register_forward_hook(self._hidden("embed"))
        for index, layer in enumerate(model.decoder.layers):
            prefix = f"layers.{index}."
            layer.input_layernorm.register_forward_hook(self._hidden(prefix + "input_norm"))
            attention = layer.self_attention
            attention.core_attention.register_forward_pre_hook(self._qkv(prefix))
            attention.register_forward_hook(self._hidden(prefix + "attn_out", in_tuple=True))
            layer.pre_mlp_layernorm.register_forward_hook(self._hidden(prefix + "mlp_in"))
            if index in routers.layers:
                self._hook_router(prefix, layer.mlp.router, routers, routers.layers.index(index))
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

    def _hook_router(self, prefix: str, router, routers, slot: int) -> None:
        """router_logits from the router's gating (wrapped on this instance: the router's
        forward returns probabilities and a routing map, not its logits); experts from its
        RouterReplay once it has routed."""
        gating = router.gating
        name = prefix + "router_logits"

        def gating_with_capture(hidden):
            logits = gating(hidden)  # [T, 1, experts], whole on every rank
            swapped = self._swapped(name, logits, dim=None)
            if swapped is not None:
                logits = swapped
            self._emit(name, logits)
            return logits

        router.gating = gating_with_capture

        def experts(module, args, output):
            if self._pass is not None:
                chosen = routers.chosen(slot).sort(dim=-1).values
                self._pass["sink"](prefix + "experts", rows(chosen))

        router.register_forward_hook(experts)

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
        if self._pass is not None:
            self._pass["sink"](name, rows(tensor[:, 0]))


def build_model(model_dir: Path, config: dict, shape, parallel, place, device, dtype: str):
    """The GPTModel the Megatron replay builds, in `dtype` (fp64 included), with this rank's
    shard of the HF weights."""
    import torch

    from pipeline.engines.megatron.convert import hf_to_megatron
    from pipeline.engines.megatron.model import gpt_model, load_hf_weights

    torch_dtype = getattr(torch, dtype)
    model = gpt_model(config, shape, parallel, torch_dtype)
    shard = hf_to_megatron(load_hf_weights(model_dir), shape, parallel, place)
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
