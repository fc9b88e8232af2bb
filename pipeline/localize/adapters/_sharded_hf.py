"""What the FSDP and DeepSpeed capture adapters share: the HF model, its capture hooks, and a
worker group whose ranks each hold a shard of its parameters.

Each rank loads the hooked HF model of `pipeline.localize.adapters.hf` for a precision on
first use and hands it to the engine, which shards it in place; the engine's own hooks gather
the full parameters for every forward, so the capture hooks (and the activation swap they
do) read the very tensors the engine computes.
"""

from __future__ import annotations

from pathlib import Path

from pipeline.engines.base import knobs_from_dict
from pipeline.errors import BadInput
from pipeline.faults import capture as seeded
from pipeline.localize.adapters._workers import WorkerGroup, WorkerSession
from pipeline.localize.adapters.hf import CaptureKnobs, HFCapture

# Ranks when the spec names none: two show sharding on a CPU; one per GPU on CUDA.
CPU_RANKS = 2


def open_sharded_session(engine: str, knob_class, model_dir, knobs: dict, device: str, spec: str):
    """The parent side: check the spec, launch the ranks, describe the side."""
    from pipeline import devices
    from pipeline.engines.model_dir import check_model_dir

    settings = knobs_from_dict(knob_class, knobs, f"{engine} capture")
    if settings.fault and settings.fault not in seeded.FAULTS:
        raise BadInput(
            f"{spec}: unknown fault {settings.fault!r}; known: {', '.join(seeded.FAULTS)}."
        )
    model_dir = Path(model_dir)
    check_model_dir(model_dir)
    kind = devices.device_kind(device)
    nproc = settings.nproc or (devices.visible_gpus() if kind == "cuda" else CPU_RANKS)
    devices.check_ranks(nproc, devices.resolve_device(device))
    model = HFCapture(model_dir, hf_knobs(settings), "cpu")  # reads the config only
    rank_knobs = {k: v for k, v in vars(settings).items() if k not in ("nproc", "timeout")}
    group = WorkerGroup(engine, model_dir, rank_knobs, nproc, kind, settings.timeout)
    layout = {"engine": engine, "world_size": nproc, "tp": 1, "dtype": settings.dtype}
    layout.update(engine_layout(settings))
    if settings.fault:
        layout.update(fault=settings.fault, fault_layer=settings.fault_layer)
    return WorkerSession(
        spec,
        group,
        settings.dtype,
        model.reference_dtype,
        layout,
        model.boundaries,
        scores_own=True,
    )


def engine_layout(settings) -> dict:
    return {"zero_stage": settings.zero_stage} if hasattr(settings, "zero_stage") else {}


def hf_knobs(settings) -> CaptureKnobs:
    return CaptureKnobs(
        dtype=settings.dtype, fault=settings.fault, fault_layer=settings.fault_layer
    )


class ShardedHFRank:
    """The rank side: the hooked HF model per precision, sharded by `shard(model, dtype)`
    the first time that precision runs."""

    def __init__(self, model_dir: Path, knobs: dict, device: str, shard):
        fields = {k: v for k, v in knobs.items() if k in CaptureKnobs.__dataclass_fields__}
        self.hf = HFCapture(Path(model_dir), CaptureKnobs(**fields), device)
        self.shard = shard
        self._engines: dict[str, object] = {}  # what the engine returned, kept alive

    def capture(self, token_ids, precision: str, sink, replace: dict, own_first=False) -> None:
        model = self.hf.model(precision)
        if precision not in self._engines:
            dtype = self.hf.dtype if precision == "declared" else self.hf.reference_dtype
            self._engines[precision] = self.shard(model, dtype)
        if hasattr(self.hf, "capture_batch"):
            self.hf.capture_batch(
                [token_ids],
                precision,
                lambda index, name, rows: sink(name, rows),
                [replace] if replace else None,
                own_first=own_first,
            )
        else:
            self.hf.capture(token_ids, precision, sink, replace or None, own_first=own_first)
