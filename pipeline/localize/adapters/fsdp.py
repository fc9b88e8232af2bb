"""Capture from the HF model under FSDP2 (`fully_shard`), its parameters sharded over ranks.

Spec: `fsdp:nproc=2,dtype=bf16`. Decoder layers are FSDP units and the root holds the
embedding, final norm and head, as in the FSDP replay; each unit's parameters are gathered
for its forward and resharded after it. Parameters are held in the precision that runs (the
declared dtype, or the reference one for the floor), so a bf16 side computes exactly what
an fp32-master FSDP with `MixedPrecisionPolicy(param_dtype=bf16)` computes in its forward.
The reference of fp32 is fp64: FSDP2 shards and gathers fp64 parameters over gloo and NCCL.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from pipeline.localize.adapters._sharded_hf import ShardedHFRank, open_sharded_session


@dataclass(frozen=True)
class FSDPCaptureKnobs:
    nproc: int = 0  # ranks; 0 = 2 on the CPU, one per visible GPU on CUDA
    dtype: str = "float32"
    fault: str = ""  # a seeded fault (pipeline.faults.capture), as for the hf adapter
    fault_layer: int = 0
    # Seconds to wait for the ranks to start, or for any one reply during a capture.
    timeout: float = field(default=600.0, metadata={"min": 1})


def open_session(model_dir: Path, knobs: dict, device: str = "cpu", spec: str = "fsdp"):
    return open_sharded_session("fsdp", FSDPCaptureKnobs, model_dir, knobs, device, spec)


def open_rank(model_dir: Path, knobs: dict, device: str, world_size: int) -> ShardedHFRank:
    from torch.distributed.device_mesh import init_device_mesh

    from pipeline.devices import device_kind

    mesh = init_device_mesh(device_kind(device), (world_size,))

    def shard(model, dtype: str):
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        return fully_shard(model, mesh=mesh)

    return ShardedHFRank(model_dir, knobs, device, shard)
