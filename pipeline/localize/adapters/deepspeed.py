"""Capture from the HF model under DeepSpeed ZeRO (stage 3 by default), parameters
partitioned over ranks and gathered by DeepSpeed's own hooks for each module's forward.

Spec: `deepspeed:nproc=2`, `deepspeed:nproc=2,dtype=bf16,zero_stage=3`. bf16 is DeepSpeed's
`bf16` mode (the module held in bf16); fp32 runs as loaded. The floor of fp32 is measured
against fp64: ZeRO partitions and gathers fp64 parameters like any others (checked on gloo).

DeepSpeed 0.19.8's ZeRO-3 `Init` takes an existing module's dtype only where the accelerator
says fp16 is unsupported (`dtype or fp16 if fp16 supported else bf16 ...`, an operator
precedence slip), then refuses anything but fp16, bf16 and fp32. So on a CPU with AVX512-FP16
(Intel Sapphire Rapids and later) it refused the fp64 reference module that it takes on every
other CPU. The fp64 reference is sharded with the fp16 probe answered as those CPUs answer it;
the dtype `Init` records then only types tensors created under it, and none are.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.errors import BadInput
from pipeline.localize.adapters._sharded_hf import ShardedHFRank, open_sharded_session


@dataclass(frozen=True)
class DeepSpeedCaptureKnobs:
    nproc: int = 0  # ranks; 0 = 2 on the CPU, one per visible GPU on CUDA
    dtype: str = "float32"
    zero_stage: int = field(default=3, metadata={"max": 3})
    fault: str = ""  # a seeded fault (pipeline.faults.capture), as for the hf adapter
    fault_layer: int = 0
    # Seconds to wait for the ranks to start, or for any one reply during a capture.
    timeout: float = field(default=600.0, metadata={"min": 1})


def open_session(model_dir: Path, knobs: dict, device: str = "cpu", spec: str = "deepspeed"):
    session = open_sharded_session(
        "deepspeed", DeepSpeedCaptureKnobs, model_dir, knobs, device, spec
    )
    if session.dtype == "float16":
        session.close()
        raise BadInput(f"{spec}: DeepSpeed capture runs float32 or bfloat16, not float16.")
    return session


def open_rank(model_dir: Path, knobs: dict, device: str, world_size: int) -> ShardedHFRank:
    from pipeline.engines.deepspeed.replay import import_deepspeed

    deepspeed = import_deepspeed(device)
    import torch.distributed as dist

    # Its shared-memory all-reduce is JIT-compiled on first use (60-90 s on a CPU) and a
    # forward needs none: skip it, as the DeepSpeed replay does.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend=dist.get_backend())
    stage = int(knobs.get("zero_stage", 3))

    def shard(model, dtype: str):
        config = {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": stage},
            "bf16": {"enabled": dtype == "bfloat16"},
            "steps_per_print": 10**9,
            "wall_clock_breakdown": False,
        }
        with _fp16_probe_answering_no(deepspeed, dtype == "float64"):
            engine, *_ = deepspeed.initialize(model=model, config=config)
        engine.eval()
        return engine

    return ShardedHFRank(model_dir, knobs, device, shard)


@contextmanager
def _fp16_probe_answering_no(deepspeed, active: bool):
    """DeepSpeed's accelerator answering "no fp16" while a float64 module is sharded (see
    the module's docstring); as it was otherwise."""
    accelerator = deepspeed.accelerator.get_accelerator()
    if not active:
        yield
        return
    probe = accelerator.is_fp16_supported
    accelerator.is_fp16_supported = lambda: False
    try:
        yield
    finally:
        accelerator.is_fp16_supported = probe
