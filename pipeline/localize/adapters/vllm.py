"""Capture from vLLM's own model modules, offline and in this process (vLLM-CPU or CUDA vLLM).

The engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0, the uni executor), so
`LLM.apply_model` hands back the very model the scheduler runs, and forward hooks on its
modules see every step. A sequence is scored as a prefill of all its token ids (max_tokens=1),
with prefix caching off so no prefix is skipped; each step's positions come from the model's
own `positions` argument, so a chunked prefill is reassembled row by row (row t = token t).

Where each boundary is read (vLLM's names, HF layout out):
- embed: `embed_tokens`; input_norm / mlp_in: the RMSNorms, which fuse the residual add and
  return (normed, residual) from layer 1 on: the normed part;
- q, k, v: the arguments of the attention op (`self_attn.attn`), i.e. q and k after
  `rotary_emb` and v as split from `qkv_proj`;
- attn_out: `self_attn` (o_proj's output without its bias tuple); mlp_out: `mlp`;
- router_logits (MoE layers): `mlp.gate`'s output, the logits FusedMoE routes with;
- experts: the ids vLLM's own router chose (its routing step, where vLLM's routed-experts
  capture reads them; pipeline/engines/vllm/routing.py), not a recomputation;
- final_norm: `model.norm`; logits: `compute_logits` (lm_head and vLLM's logits processor) of
  the final hidden state at every position, since the engine computes only the last one.

vLLM has no float64, so a float32 side's floor is measured against the HF model in float64
(`layout["floor_source"]`); a bf16/fp16 side's against a second vLLM engine in float32.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from pipeline.engines.base import knobs_from_dict
from pipeline.errors import BadInput
from pipeline.localize.boundaries import model_boundaries, moe_layers

REFERENCE = {"float32": "float64", "bfloat16": "float32", "float16": "float32"}


@dataclass(frozen=True)
class VLLMCaptureKnobs:
    dtype: str = "float32"
    # a prefill longer than this is chunked over several steps (rows are reassembled)
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool | None = None
    max_model_len: int = field(default=1024, metadata={"min": 1})
    cpu_kv_cache_gib: int = field(default=1, metadata={"min": 1})
    gpu_memory_utilization: float = field(default=0.1, metadata={"max": 1.0})


def open_session(model_dir: Path, knobs: dict, device: str = "cpu", spec: str = "vllm"):
    settings = knobs_from_dict(VLLMCaptureKnobs, knobs, "vllm capture")
    return VLLMCapture(Path(model_dir), settings, device, name=spec)


@dataclass
class _Pass:
    """One sequence's prefill: where rows go, what replaces them, and the rows of a chunked
    prefill held until every position has run."""

    sink: object
    length: int
    replace: dict = field(default_factory=dict)
    positions: np.ndarray | None = None  # this step's token positions
    steps: int = 0  # forward steps the prefill took (more than one: chunked)
    held: dict = field(default_factory=dict)  # boundary -> [(positions, rows)]

    @property
    def whole(self) -> bool:
        """This step runs positions 0..T-1 in order: its rows go straight to the sink."""
        p = self.positions
        return (
            p is not None
            and p.shape[0] == self.length
            and bool(np.array_equal(p, np.arange(self.length)))
        )

    def emit(self, name: str, tensor):
        """Send (or hold) `tensor`'s rows for this step; the replacement tensor, or None."""
        import torch

        count = self.positions.shape[0]
        replaced = None
        if name in self.replace:
            # rows this step computes, by position (a decode step past the sequence keeps its own)
            where = np.flatnonzero(self.positions < self.length)
            values = torch.as_tensor(self.replace[name][self.positions[where]])
            replaced = tensor.clone()
            replaced[torch.as_tensor(where)] = values.to(tensor.dtype).reshape(
                len(where), *tensor.shape[1:]
            )
            tensor = replaced
        values = _rows(tensor[:count])
        if self.whole:
            self.sink(name, values)
        else:
            self.held.setdefault(name, []).append((self.positions.copy(), values))
        return replaced

    def flush(self) -> None:
        """Rows of a chunked prefill in position order, first computation of each position."""
        for name, parts in self.held.items():
            positions = np.concatenate([p for p, _ in parts])
            values = np.concatenate([v for _, v in parts])
            out = np.empty((self.length, values.shape[1]), dtype=values.dtype)
            seen = np.zeros(self.length, dtype=bool)
            for position, row in zip(positions, values, strict=True):
                if position < self.length and not seen[position]:
                    out[position], seen[position] = row, True
            if not seen.all():
                missing = int(np.flatnonzero(~seen)[0])
                raise RuntimeError(f"vLLM never ran position {missing} of boundary {name}")
            self.sink(name, out)
        self.held.clear()


_ACTIVE: list[_Pass] = []  # the prefill in flight (one generate() at a time)
# Engines of this process. Shutting one down tears down vLLM's process-wide parallel state,
# which every other engine still uses: a closed engine waits here until the last one closes.
_LIVE: list = []
_CLOSED: list = []


class VLLMCapture:
    can_replace = True

    def __init__(self, model_dir: Path, settings: VLLMCaptureKnobs, device: str, name: str):
        from pipeline.engines.model_dir import check_model_dir

        check_model_dir(model_dir)
        self.model_dir = model_dir
        self.settings = settings
        self.device = device
        self.name = name
        self.dtype = settings.dtype
        self.reference_dtype = REFERENCE[settings.dtype]
        config = json.loads((model_dir / "config.json").read_text())
        self.num_layers = int(config["num_hidden_layers"])
        self.moe_layers = moe_layers(config)
        self._engines: dict[str, tuple] = {}
        self._hf_reference = None
        self.prefill_steps = 0  # of the last capture: more than one when vLLM chunked it
        self.layout = {
            "engine": "vllm",
            "tp": 1,
            "world_size": 1,
            "dtype": self.dtype,
            "floor_source": (
                "hf float64 (vLLM has no float64)"
                if self.reference_dtype == "float64"
                else "vllm float32"
            ),
            "prefix_caching": False,
        }

    @property
    def boundaries(self) -> list[str]:
        return model_boundaries(self.num_layers, self.moe_layers)

    def capture(self, token_ids, precision: str, sink, replace: dict | None = None) -> None:
        if precision == "reference" and self.reference_dtype == "float64":
            self._reference_side().capture(token_ids, "reference", sink, replace)
            return
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        dtype = self.dtype if precision == "declared" else self.reference_dtype
        llm = self._engine(dtype)
        ids = [int(t) for t in token_ids]
        current = _Pass(sink, len(ids), dict(replace or {}))
        params = SamplingParams(max_tokens=1, detokenize=False)
        _ACTIVE.append(current)
        try:
            llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
        finally:
            _ACTIVE.pop()
        current.flush()
        self.prefill_steps = current.steps

    def close(self) -> None:
        from pipeline.engines.vllm.knobs import release_llm

        for llm, _ in self._engines.values():
            _LIVE.remove(llm)
            _CLOSED.append(llm)
        self._engines.clear()
        if not _LIVE:
            while _CLOSED:
                release_llm(_CLOSED.pop())
        if self._hf_reference is not None:
            self._hf_reference.close()
            self._hf_reference = None

    def _engine(self, dtype: str):
        if dtype not in self._engines:
            self._engines[dtype] = self._load(dtype)
        return self._engines[dtype][0]

    def _load(self, dtype: str):
        from pipeline.engines.vllm.knobs import VLLMKnobs, create_llm, vllm_versions

        s = self.settings
        knobs = VLLMKnobs(
            dtype=dtype,
            # a cached prefix is not recomputed: its boundaries would never be seen
            enable_prefix_caching=False,
            enable_chunked_prefill=s.enable_chunked_prefill,
            max_num_batched_tokens=s.max_num_batched_tokens,
            max_model_len=s.max_model_len,
            gpu_memory_utilization=s.gpu_memory_utilization,
            cpu_kv_cache_gib=s.cpu_kv_cache_gib,
            enforce_eager=True,  # hooks must run eagerly, not be traced into a graph
            in_process=True,
        )
        llm = create_llm(self.model_dir, knobs)
        self.layout["vllm"] = vllm_versions()["vllm"]
        model = llm.apply_model(lambda model: model)[0]
        if not hasattr(model, "model") or not hasattr(model.model, "layers"):
            raise BadInput(
                f"{self.name}: vLLM runs {type(model).__name__}, which has no decoder layers "
                "to hook (model.layers); capture this model with the hf adapter."
            )
        _install_hooks(model)
        _LIVE.append(llm)
        return llm, model

    def _reference_side(self):
        from pipeline.localize.adapters.hf import CaptureKnobs, HFCapture

        if self._hf_reference is None:
            self._hf_reference = HFCapture(
                self.model_dir, CaptureKnobs(dtype="float32"), self.device, name="hf"
            )
        return self._hf_reference


def _install_hooks(model) -> None:
    """Forward hooks on every boundary's module of vLLM's model (see the module docstring)."""
    from pipeline.engines.vllm.routing import moe_routers

    # refuses a fused routing kernel, whose choice no hook can see
    moe_routers(model, "capture this model with the hf adapter.")
    model.register_forward_pre_hook(_positions_hook, with_kwargs=True)
    model.model.embed_tokens.register_forward_hook(_output_hook("embed"))
    for index, decoder in enumerate(model.model.layers):
        prefix = f"layers.{index}."
        decoder.input_layernorm.register_forward_hook(_output_hook(prefix + "input_norm"))
        decoder.self_attn.attn.register_forward_pre_hook(_qkv_hook(prefix), with_kwargs=True)
        decoder.self_attn.register_forward_hook(_output_hook(prefix + "attn_out"))
        decoder.post_attention_layernorm.register_forward_hook(_output_hook(prefix + "mlp_in"))
        gate = getattr(decoder.mlp, "gate", None)
        router = getattr(getattr(decoder.mlp, "experts", None), "router", None)
        if gate is not None and router is not None:
            gate.register_forward_hook(_output_hook(prefix + "router_logits"))
            _tap_router(router, prefix + "experts")
        decoder.mlp.register_forward_hook(_output_hook(prefix + "mlp_out"))
    model.model.norm.register_forward_hook(_final_norm_hook(model))


def _positions_hook(module, args, kwargs):
    current = _ACTIVE[-1] if _ACTIVE else None
    if current is not None:
        positions = kwargs.get("positions", args[1] if len(args) > 1 else None)
        current.positions = positions.detach().cpu().numpy().astype(np.int64)
        current.steps += 1
    return None


def _output_hook(name: str):
    """A boundary read from a module's output; (normed, residual) tuples give the normed."""

    def hook(module, args, output):
        current = _ACTIVE[-1] if _ACTIVE else None
        if current is None:
            return None
        tensor = output[0] if isinstance(output, tuple) else output
        replaced = current.emit(name, tensor)
        if replaced is None:
            return None
        return (replaced, *output[1:]) if isinstance(output, tuple) else replaced

    return hook


def _qkv_hook(prefix: str):
    """q and k after RoPE and v, as the attention op receives them ([N, heads * dim])."""

    def hook(module, args, kwargs):
        current = _ACTIVE[-1] if _ACTIVE else None
        if current is None:
            return None
        names = ("query", "key", "value")
        tensors = [args[i] if i < len(args) else kwargs[names[i]] for i in range(3)]
        changed = False
        for i, kind in enumerate(("q", "k", "v")):
            shape = tensors[i].shape
            flat = tensors[i].reshape(shape[0], -1)
            replaced = current.emit(prefix + kind, flat)
            if replaced is not None:
                tensors[i], changed = replaced.reshape(shape), True
        if not changed:
            return None
        args = tuple(tensors) + tuple(args[3:])
        return args, {k: v for k, v in kwargs.items() if k not in names}

    return hook


def _tap_router(router, name: str) -> None:
    """The experts vLLM's router chose, read where vLLM's own routed-experts capture reads
    them (the router's routing step, before EPLB remapping: base_router.py _select_experts);
    a swap routes to the other side's experts with this side's weights for them."""
    compute = router._compute_routing

    def compute_routing(hidden_states, router_logits, indices_type, **kwargs):
        import torch

        weights, ids = compute(hidden_states, router_logits, indices_type, **kwargs)
        current = _ACTIVE[-1] if _ACTIVE else None
        if current is None:
            return weights, ids
        replaced = current.emit(name, torch.sort(ids.long(), dim=-1).values)
        if replaced is None:
            return weights, ids
        forced = replaced.to(ids.dtype).contiguous()
        return _weights_of(router, router_logits, forced).to(weights.dtype), forced

    router._compute_routing = compute_routing


def _weights_of(router, router_logits, ids):
    """The weights `router` gives experts `ids` (plain softmax top-k routing, renormalised
    when the model says so, as vLLM's CPU router computes them)."""
    import torch

    plain = (
        getattr(router, "scoring_func", "softmax") == "softmax"
        and not getattr(router, "use_grouped_topk", False)
        and getattr(router, "custom_routing_function", None) is None
    )
    if not plain:
        raise BadInput(
            f"lpx can swap experts only under plain softmax top-k routing, and vLLM routes "
            f"this model with {type(router).__name__}; localize without swapping the router "
            "family, or capture this model with the hf adapter."
        )
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights = torch.gather(probs, -1, ids.long())
    if getattr(router, "renormalize", False):
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights


def _final_norm_hook(model):
    """The final norm, then the logits of every position from it (the engine itself computes
    only the positions it samples or scores)."""
    final = _output_hook("final_norm")

    def hook(module, args, output):
        current = _ACTIVE[-1] if _ACTIVE else None
        if current is None:
            return None
        result = final(module, args, output)
        normed = result if result is not None else output
        normed = normed[0] if isinstance(normed, tuple) else normed
        count = current.positions.shape[0]
        current.emit("logits", model.compute_logits(normed[:count]))
        return result

    return hook


def _rows(tensor) -> np.ndarray:
    """[N, ...] -> [N, F] float32 numpy, copied (vLLM updates some tensors in place later)."""
    tensor = tensor.detach()
    if tensor.dtype.is_floating_point:
        tensor = tensor.float()
    return np.array(tensor.reshape(tensor.shape[0], -1).cpu().numpy(), copy=True)
