"""megatron-core replay: a GPTModel built from the HF config, HF weights converted and
sharded for tensor parallelism, selected logprobs computed vocab-parallel (the full-vocab
logits are never gathered). Padding is right-side with an explicit boolean mask.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from pipeline.devices import cpu_stands_in_for_cuda, is_cuda
from pipeline.engines.distributed import DistributedScoringEngine
from pipeline.engines.hf_common import model_metadata, software_versions, torch_dtype
from pipeline.engines.hf_replay import ReplayKnobs, ScoredSequence
from pipeline.engines.megatron_convert import (
    CONVERSION,
    Shape,
    gpt_model,
    hf_to_megatron,
    megatron_to_hf,
)
from pipeline.errors import BadInput, EngineNotInstalled
from pipeline.fingerprint import tensor_fingerprint


class MegatronScoringEngine(DistributedScoringEngine):
    name = "megatron"

    def open(self, model_dir: Path, knobs: dict, rank: int, world_size: int):
        return MegatronSession(model_dir, dict(knobs), world_size)


class MegatronSession:
    def __init__(self, model_dir: Path, knobs: dict, world_size: int):
        try:
            from megatron.core import parallel_state
        except ImportError as error:
            raise EngineNotInstalled(
                f"engine 'megatron' is not installed ({error}); install it with `pip install -e '.[megatron]'`."
            ) from None

        self.tp = int(knobs.pop("tensor_parallel_size", world_size))
        self.interleave_qkv = str(knobs.pop("conversion", "correct")) != "no_qkv_interleave"
        self.settings = ReplayKnobs.from_dict(knobs)
        unsupported = {
            "packing": self.settings.packing,
            "padding_side=left": self.settings.padding_side != "right",
            "top_k/top_p": self.settings.top_k or self.settings.top_p < 1,
        }
        if any(unsupported.values()):
            names = ", ".join(k for k, v in unsupported.items() if v)
            raise BadInput(f"megatron replay does not support {names}.")
        if world_size % self.tp:
            raise BadInput(
                f"--nproc {world_size} is not a multiple of tensor_parallel_size {self.tp}."
            )
        self.device = self.settings.device  # this rank's: cpu or cuda:LOCAL_RANK
        if not is_cuda(self.device):
            cpu_stands_in_for_cuda()
        if parallel_state.model_parallel_is_initialized():
            # a second session in this process (lpx serve loading a new weight version):
            # megatron keeps its groups in globals, so they are rebuilt for it
            parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=self.tp)
        from megatron.core.tensor_parallel.random import initialize_rng_tracker

        initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
        self.parallel_state = parallel_state
        self.model_dir = Path(model_dir)
        config = json.loads((self.model_dir / "config.json").read_text())
        if config.get("model_type") not in ("llama", "qwen2"):
            raise BadInput(
                f"{model_dir}: megatron replay converts llama and qwen2 models, not {config.get('model_type')!r}."
            )
        self.shape = Shape.from_hf_config(config)
        if self.shape.num_query_groups % self.tp or self.shape.vocab_size % self.tp:
            raise BadInput(
                f"tensor_parallel_size {self.tp} must divide the query groups and the vocabulary."
            )
        self.model = self._build(config)
        self.tp_rank = parallel_state.get_tensor_model_parallel_rank()
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.dp_size = parallel_state.get_data_parallel_world_size()
        self.world_size = world_size
        self.micro_batch_size = self.settings.micro_batch_size
        self.prompt_logprobs = self.settings.prompt_logprobs

    def _build(self, config: dict):
        from safetensors.torch import load_file

        dtype = torch_dtype(self.settings.dtype)
        shape = self.shape
        model = gpt_model(config, shape, self.tp, dtype)
        hf = {}
        for path in sorted(self.model_dir.glob("*.safetensors")):
            hf.update(load_file(path))
        self.checkpoint_fingerprint = tensor_fingerprint(
            (n, t.to(dtype)) for n, t in hf.items() if n != "lm_head.weight" or not shape.tied
        )
        shard = hf_to_megatron(
            hf,
            shape,
            self.tp,
            self.parallel_state.get_tensor_model_parallel_rank(),
            self.interleave_qkv,
        )
        missing, unexpected = model.load_state_dict(
            {k: v.to(dtype) for k, v in shard.items()}, strict=False
        )
        missing = [k for k in missing if not k.endswith("_extra_state")]
        if missing or unexpected:
            raise BadInput(
                f"megatron conversion mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}."
            )
        return model.to(device=self.device, dtype=dtype).eval()

    def score(self, pairs):
        import torch

        with torch.no_grad():
            return self._score(pairs)

    def _score(self, pairs):
        import torch

        sequences = [np.concatenate([p, c]).astype(np.int64) for p, c in pairs]
        width = max(len(s) for s in sequences)
        input_ids = torch.zeros((len(sequences), width), dtype=torch.long)
        valid = torch.zeros((len(sequences), width), dtype=torch.bool)
        for i, sequence in enumerate(sequences):
            input_ids[i, : len(sequence)] = torch.from_numpy(sequence)
            valid[i, : len(sequence)] = True
        input_ids, valid = input_ids.to(self.device), valid.to(self.device)
        position_ids = torch.arange(width, device=self.device)[None].expand(len(sequences), -1)
        causal = torch.tril(torch.ones(width, width, dtype=torch.bool, device=self.device))
        # Megatron's mask: True = masked. Causal, and pad keys never attended to.
        mask = ~(causal[None, None] & valid[:, None, None, :])
        logits = self.model(input_ids=input_ids, position_ids=position_ids, attention_mask=mask)
        firsts = [1 if self.settings.prompt_logprobs else len(p) for p, _ in pairs]
        rows = np.concatenate(
            [np.full(len(s) - f, i) for i, (s, f) in enumerate(zip(sequences, firsts, strict=True))]
        )
        columns = np.concatenate(
            [np.arange(f - 1, len(s) - 1) for s, f in zip(sequences, firsts, strict=True)]
        )
        targets = np.concatenate([s[f:] for s, f in zip(sequences, firsts, strict=True)])
        local = (
            logits[
                torch.from_numpy(rows).to(self.device), torch.from_numpy(columns).to(self.device)
            ].float()
            / self.settings.temperature
        )
        logprobs, top_ids, top_logprobs = self._vocab_parallel_logprobs(
            local, torch.from_numpy(targets).to(self.device)
        )
        results, cursor = [], 0
        for (prompt, _), sequence, first in zip(pairs, sequences, firsts, strict=True):
            count = len(sequence) - first
            values = logprobs[cursor : cursor + count]
            split = len(prompt) - first
            span = slice(cursor + split, cursor + count)
            prompt_lp = (
                np.concatenate([[np.nan], values[:split]]).astype(np.float32)
                if self.settings.prompt_logprobs
                else None
            )
            results.append(
                ScoredSequence(
                    values[split:].astype(np.float32), prompt_lp, top_ids[span], top_logprobs[span]
                )
            )
            cursor += count
        return results

    def _vocab_parallel_logprobs(self, local, targets):
        """log-softmax over a vocabulary split across TP ranks, from three small all-reduces."""
        import torch
        import torch.distributed as dist

        group = self.parallel_state.get_tensor_model_parallel_group()
        per_rank = local.shape[-1]
        start = self.tp_rank * per_rank
        global_max = local.max(-1).values
        dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=group)
        sum_exp = (local - global_max[:, None]).exp().sum(-1)
        dist.all_reduce(sum_exp, group=group)
        log_normalizer = global_max + sum_exp.log()
        mine = (targets >= start) & (targets < start + per_rank)
        target_logit = torch.where(
            mine, local.gather(-1, (targets - start).clamp(0, per_rank - 1)[:, None])[:, 0], 0.0
        )
        dist.all_reduce(target_logit, group=group)
        # Top-1: each rank's best, then the best of the bests.
        local_best, local_index = local.max(-1)
        bests = [torch.empty_like(local_best) for _ in range(self.tp)]
        indices = [torch.empty_like(local_index) for _ in range(self.tp)]
        dist.all_gather(bests, local_best, group=group)
        dist.all_gather(indices, local_index + start, group=group)
        stacked = torch.stack(bests)
        winner = stacked.argmax(0)
        top_ids = torch.stack(indices).gather(0, winner[None])[0]
        top_logprobs = stacked.max(0).values - log_normalizer
        return (
            (target_logit - log_normalizer).cpu().numpy(),
            top_ids.cpu().numpy().astype(np.int32),
            top_logprobs.cpu().numpy().astype(np.float32),
        )

    def metadata(self) -> dict:
        import megatron.core
        import torch.distributed as dist

        # Every TP rank's shard, reassembled into HF layout: the weights actually held.
        shard = {
            k: v.detach().cpu()
            for k, v in self.model.state_dict().items()
            if not k.endswith("_extra_state")
        }
        shards = [None] * self.tp
        dist.all_gather_object(
            shards, shard, group=self.parallel_state.get_tensor_model_parallel_group()
        )
        held = megatron_to_hf(shards, self.shape)
        if self.shape.tied:
            held.pop("lm_head.weight", None)
        dtype = self.settings.dtype
        return {
            "engine": {
                "name": "megatron",
                "role": "replay",
                "versions": {**software_versions(), "megatron": megatron.core.__version__},
            },
            "dtype": dtype,
            "knobs": {
                "dtype": dtype,
                "micro_batch_size": self.settings.micro_batch_size,
                "temperature": self.settings.temperature,
                "prompt_logprobs": self.settings.prompt_logprobs,
                "device": self.device,
                "allow_tf32": self.settings.allow_tf32,
                "tensor_parallel_size": self.tp,
                "conversion": "correct" if self.interleave_qkv else "no_qkv_interleave",
                "layer_spec": "local (no Transformer Engine), RMSNorm, unfused",
            },
            "layout": {
                "world_size": self.world_size,
                "tensor_parallel_size": self.tp,
                "pipeline_parallel_size": 1,
                "data_parallel_size": self.dp_size,
                "micro_batch_size": self.settings.micro_batch_size,
                "padding_side": "right",
                "packing": False,
                "attn_implementation": "megatron local DotProductAttention",
                "logprobs": "vocab-parallel (logits never gathered)",
                "conversion": CONVERSION,
            },
            "model": model_metadata(self.model_dir),
            "weights": {
                "checkpoint_tensor_fingerprint": self.checkpoint_fingerprint,
                "held_tensor_fingerprint": tensor_fingerprint(held.items()),
            },
            "position_id_rule": "arange",
        }
