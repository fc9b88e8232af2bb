"""DeepSpeed replay: the HF model under `deepspeed.initialize` with ZeRO stage 0-3."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import field
from pathlib import Path

from pipeline.devices import device_kind
from pipeline.engines.distributed import DistributedScoringEngine
from pipeline.engines.hf.model import load_model, torch_dtype
from pipeline.engines.hf.replay import ReplayKnobs, score_batch
from pipeline.engines.metadata import model_metadata, software_versions
from pipeline.errors import BadInput, EngineNotInstalled
from pipeline.fingerprint import tensor_fingerprint


@dataclasses.dataclass(frozen=True)
class DeepSpeedKnobs(ReplayKnobs):
    """The HF replay's knobs, and the ZeRO stage the model is partitioned with."""

    zero_stage: int = field(default=3, metadata={"max": 3})


class DeepSpeedScoringEngine(DistributedScoringEngine):
    name = "deepspeed"
    knobs = DeepSpeedKnobs

    def open(self, model_dir: Path, knobs: dict, rank: int, world_size: int):
        return DeepSpeedSession(model_dir, dict(knobs), world_size)


def import_deepspeed(device: str):
    """DeepSpeed, imported for `device`: it picks its accelerator when imported (the one this
    rank was given); EngineNotInstalled says how to install it."""
    os.environ["DS_ACCELERATOR"] = device_kind(device)
    try:
        import deepspeed
    except ImportError as error:
        raise EngineNotInstalled(
            f"engine 'deepspeed' is not installed ({error}); install it with "
            "`pip install --no-build-isolation -e '.[deepspeed]'` after torch."
        ) from None
    return deepspeed


class DeepSpeedSession:
    def __init__(self, model_dir: Path, knobs: dict, world_size: int):
        deepspeed = import_deepspeed(str(knobs.get("device", "cpu")))
        import torch.distributed as dist

        self.zero_stage = int(knobs.pop("zero_stage", DeepSpeedKnobs.zero_stage))
        if self.zero_stage not in (0, 1, 2, 3):
            raise BadInput(f"deepspeed zero_stage must be 0-3, not {self.zero_stage}.")
        self.settings = ReplayKnobs.from_dict(knobs)
        if self.settings.lm_head_fp32:
            raise BadInput(
                "deepspeed replay: lm_head_fp32 is not supported (lm_head is partitioned)."
            )
        if self.settings.dtype == "float16":
            raise BadInput("deepspeed replay: use float32 or bfloat16.")
        # The shared-memory all-reduce op is JIT-compiled on first use (60-90 s on CPU) and
        # scoring needs no all-reduce: skip it so no op build is required to run.
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        deepspeed.init_distributed(dist_backend=dist.get_backend())
        self.model_dir = Path(model_dir)
        model = load_model(model_dir, "float32", self.settings.attn_implementation)
        self.model_config = model.config  # the config it computes with (metadata.model.config)
        bf16 = self.settings.dtype == "bfloat16"
        # DeepSpeed holds bf16 weights when bf16 is on: fingerprint the checkpoint cast the same way.
        held_dtype = torch_dtype(self.settings.dtype)
        self.checkpoint_fingerprint = tensor_fingerprint(
            (n, t.to(held_dtype)) for n, t in model.state_dict().items()
        )
        self.config = {
            "train_micro_batch_size_per_gpu": self.settings.micro_batch_size,
            "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": self.zero_stage},
            "bf16": {"enabled": bf16},
            "steps_per_print": 10**9,
            "wall_clock_breakdown": False,
        }
        self.engine, *_ = deepspeed.initialize(model=model, config=self.config)
        self.engine.eval()
        self.deepspeed = deepspeed
        self.world_size = world_size
        self.dp_rank, self.dp_size = dist.get_rank(), world_size
        self.micro_batch_size = self.settings.micro_batch_size
        self.prompt_logprobs = self.settings.prompt_logprobs

    def score(self, pairs, routing=None):
        return score_batch(
            self.engine.module, pairs, self.settings, full_forward=True, routing=routing
        )

    def metadata(self) -> dict:
        module = self.engine.module
        # Gather ZeRO-3 partitions (a no-op for stages 0-2) to fingerprint what is held.
        with self.deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
            held = tensor_fingerprint(module.state_dict().items())
        applied_dtype = str(next(module.parameters()).dtype).removeprefix("torch.")
        return {
            "engine": {
                "name": "deepspeed",
                "role": "replay",
                "versions": {**software_versions(), "deepspeed": self.deepspeed.__version__},
            },
            "dtype": applied_dtype,
            "knobs": {
                **dataclasses.asdict(self.settings),
                "dtype": applied_dtype,
                "zero_stage": self.zero_stage,
            },
            "layout": {
                "world_size": self.world_size,
                "data_parallel_size": self.dp_size,
                "tensor_parallel_size": 1,
                "pipeline_parallel_size": 1,
                "zero_stage": self.zero_stage,
                "micro_batch_size": self.settings.micro_batch_size,
                "padding_side": self.settings.padding_side,
                "packing": self.settings.packing,
                "attn_implementation": module.config._attn_implementation,
                "deepspeed_config": self.config,
            },
            "model": model_metadata(self.model_dir, self.model_config),
            "weights": {
                "checkpoint_tensor_fingerprint": self.checkpoint_fingerprint,
                "held_tensor_fingerprint": held,
            },
            "position_id_rule": "arange",
        }
