"""FSDP2 replay: the HF model under `fully_shard`, one shard per rank, teacher-forced.

Decoder layers are FSDP units and the root holds embeddings, final norm and lm_head (tied
or not), so scoring runs the model's own forward, whose root hooks gather those weights.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from pipeline.devices import device_kind
from pipeline.engines.distributed import DistributedScoringEngine
from pipeline.engines.hf.model import load_model, torch_dtype
from pipeline.engines.hf.replay import ReplayKnobs, score_batch
from pipeline.engines.metadata import model_metadata
from pipeline.errors import BadInput
from pipeline.fingerprint import tensor_fingerprint
from pipeline.names import canonical_dtype


@dataclasses.dataclass(frozen=True)
class FSDPKnobs(ReplayKnobs):
    """The HF replay's knobs, and the dtype FSDP's mixed-precision policy reduces in."""

    reduce_dtype: str = "float32"


class FSDPScoringEngine(DistributedScoringEngine):
    name = "fsdp"
    knobs = FSDPKnobs

    def open(self, model_dir: Path, knobs: dict, rank: int, world_size: int):
        return FSDPSession(model_dir, dict(knobs), world_size)


class FSDPSession:
    def __init__(self, model_dir: Path, knobs: dict, world_size: int):
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        reduce_dtype = _dtype_knob(knobs.pop("reduce_dtype", FSDPKnobs.reduce_dtype))
        self.settings = ReplayKnobs.from_dict(knobs)
        if self.settings.lm_head_fp32:
            raise BadInput(
                "fsdp replay: lm_head_fp32 is not supported (lm_head is sharded with the root)."
            )
        self.model_dir = Path(model_dir)
        device = self.settings.device  # this rank's: cpu or cuda:LOCAL_RANK
        # fp32 master weights; the mixed-precision policy casts them for compute.
        model = load_model(model_dir, "float32", self.settings.attn_implementation)
        self.model_config = model.config  # the config it computes with (metadata.model.config)
        self.checkpoint_fingerprint = tensor_fingerprint(model.state_dict().items())
        model.to(device)
        mesh = init_device_mesh(device_kind(device), (world_size,))
        policy = MixedPrecisionPolicy(
            param_dtype=torch_dtype(self.settings.dtype), reduce_dtype=torch_dtype(reduce_dtype)
        )
        for layer in model.base_model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        self.model = model
        self.world_size = world_size
        self.dp_rank, self.dp_size = dist.get_rank(), world_size
        self.micro_batch_size = self.settings.micro_batch_size
        self.prompt_logprobs = self.settings.prompt_logprobs
        self.reduce_dtype = reduce_dtype

    def score(self, pairs, routing=None):
        return score_batch(self.model, pairs, self.settings, full_forward=True, routing=routing)

    def metadata(self) -> dict:
        import torch
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        # The full weights this engine actually holds, gathered from all shards.
        full = get_model_state_dict(
            self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        applied = dataclasses.asdict(self.settings)
        return {
            "engine": {"name": "fsdp", "role": "replay", "versions": _versions(torch)},
            "dtype": self.settings.dtype,
            "knobs": {**applied, "reduce_dtype": self.reduce_dtype, "fsdp": "FSDP2 fully_shard"},
            "layout": {
                "world_size": self.world_size,
                "data_parallel_size": self.dp_size,
                "tensor_parallel_size": 1,
                "pipeline_parallel_size": 1,
                "micro_batch_size": self.settings.micro_batch_size,
                "padding_side": self.settings.padding_side,
                "packing": self.settings.packing,
                "attn_implementation": self.model.config._attn_implementation,
                "mixed_precision": {
                    "param_dtype": self.settings.dtype,
                    "reduce_dtype": self.reduce_dtype,
                },
                "sharding": "decoder layers + root (embeddings, norm, lm_head)",
            },
            "model": model_metadata(self.model_dir, self.model_config),
            "weights": {
                "checkpoint_tensor_fingerprint": self.checkpoint_fingerprint,
                "held_tensor_fingerprint": tensor_fingerprint(full.items()) if full else None,
            },
            "position_id_rule": "arange",
        }


def _dtype_knob(value: str) -> str:
    try:
        return canonical_dtype(str(value))
    except ValueError as error:
        raise BadInput(str(error)) from None


def _versions(torch) -> dict:
    from pipeline.engines.metadata import software_versions

    return {**software_versions(), "fsdp": f"FSDP2 (torch {torch.__version__})"}
