"""megatron-core replay: a GPTModel built from the HF config, HF weights converted and
sharded for tensor parallelism (and, for MoE models, expert parallelism through
megatron-core's own MoE layer), selected logprobs computed vocab-parallel (the full-vocab
logits are never gathered). Padding is right-side with an explicit boolean mask.

Knobs beyond the HF replay's: tensor_parallel_size (default: every rank),
expert_model_parallel_size (EP, default 1), expert_tensor_parallel_size (default: the TP
size, megatron's default), conversion. The model and the layout are checked in the launching
process (`check_convertible`), so a family or split megatron cannot take is one error line
before any rank starts. MoE models record each position's experts from megatron's routers
(ScoredSequence.routed_experts); router_replay=true forces the fixture's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np

from pipeline.devices import cpu_stands_in_for_cuda, is_cuda
from pipeline.engines.distributed import DistributedScoringEngine
from pipeline.engines.hf.model import torch_dtype
from pipeline.engines.hf.replay import ReplayKnobs
from pipeline.engines.megatron.convert import (
    CONVERSION,
    Parallel,
    check_convertible,
    hf_to_megatron,
    megatron_to_hf,
)
from pipeline.engines.megatron.model import (
    DISPATCHER,
    config_as_built,
    cpu_moe_shims,
    gpt_model,
    initialize_parallel,
    load_hf_weights,
    place_of_this_rank,
)
from pipeline.engines.megatron.routing import MegatronRouters, batch_targets, sequence_rows
from pipeline.engines.metadata import model_metadata, software_versions
from pipeline.engines.scoring import ScoredSequence
from pipeline.errors import BadInput, EngineNotInstalled
from pipeline.fingerprint import tensor_fingerprint


@dataclass(frozen=True)
class MegatronKnobs(ReplayKnobs):
    """The HF replay's knobs, and megatron's parallel layout and weight conversion."""

    tensor_parallel_size: int | None = None  # None: every rank
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: int | None = None  # None: the TP size, megatron's default
    conversion: str = "correct"  # no_qkv_interleave: a deliberate bug, to prove it is caught


class MegatronScoringEngine(DistributedScoringEngine):
    name = "megatron"
    knobs = MegatronKnobs

    def score(self, fixture, model_dir: Path, knobs: dict):
        preflight(Path(model_dir), knobs, fixture)  # before torchrun starts a rank
        return super().score(fixture, model_dir, knobs)

    def open(self, model_dir: Path, knobs: dict, rank: int, world_size: int):
        return MegatronSession(model_dir, dict(knobs), world_size)


# The knobs megatron takes beyond the HF replay's, in MegatronKnobs' order
MEGATRON_KNOBS = tuple(
    f.name for f in fields(MegatronKnobs) if f.name not in ReplayKnobs.__dataclass_fields__
)


def parallel_of(knobs: dict, world_size: int) -> Parallel:
    """The split the knobs ask for (TP defaults to every rank, EP to 1, expert TP to TP)."""
    etp = knobs.get("expert_tensor_parallel_size")
    try:
        return Parallel(
            tp=int(knobs.get("tensor_parallel_size", world_size)),
            ep=int(knobs.get("expert_model_parallel_size", 1)),
            etp=None if etp is None else int(etp),
        )
    except (TypeError, ValueError):
        raise BadInput(
            "tensor_parallel_size, expert_model_parallel_size and expert_tensor_parallel_size "
            "take whole numbers, e.g. --set expert_model_parallel_size=2."
        ) from None


def preflight(model_dir: Path, knobs: dict, fixture=None) -> None:
    """The model's family, the parallel layout and the knobs (router_replay needing the
    fixture's routing too), checked in the launching process: a refusal here is one `Error:`
    line and exit 2, and no rank is started."""
    from pipeline.engines.distributed import plan_ranks, under_launcher
    from pipeline.engines.model_dir import check_model_dir

    check_model_dir(model_dir)
    if under_launcher():  # the user's own torchrun: this process is already a rank
        import os

        world_size = int(os.environ["WORLD_SIZE"])
    else:
        world_size = plan_ranks(knobs, knobs.get("nproc", 1))[0]
    rank_knobs = {k: v for k, v in knobs.items() if k != "nproc"}
    config = json.loads((model_dir / "config.json").read_text())
    shape = check_convertible(
        config, parallel_of(rank_knobs, world_size), world_size, str(model_dir)
    )
    settings = ReplayKnobs.from_dict(
        {k: v for k, v in rank_knobs.items() if k not in MEGATRON_KNOBS}
    )
    if settings.router_replay:
        if shape.routing is None:
            raise BadInput(
                f"router_replay forces MoE routing, and {model_dir} is a dense {shape.family} "
                "model; leave router_replay off."
            )
        if fixture is not None:
            from pipeline.routing import sequence_routing, unrecorded

            sequence_routing(fixture, 0)  # refuses a fixture without routed experts
            missing = unrecorded(fixture)
            if missing:  # megatron's RouterReplay forces a whole layer or none of it
                first = missing["first"]
                raise BadInput(
                    f"router_replay on megatron forces every position's experts, and the "
                    f"fixture's routing is incomplete: {missing['rows']} of {missing['of']} "
                    f"positions hold no top-k choice (first: sequence {first['sequence_id']!r}, "
                    f"position {first['position']}; an id of -1 or repeated, as an engine "
                    "returns for prefix-cached or chunked-prefill tokens). Record the rollout "
                    "with prefix caching off, or replay with --engine hf, which leaves those "
                    "positions to its own router."
                )


class MegatronSession:
    def __init__(self, model_dir: Path, knobs: dict, world_size: int):
        try:
            from megatron.core import parallel_state
        except ImportError as error:
            raise EngineNotInstalled(
                f"engine 'megatron' is not installed ({error}); install it with "
                "`pip install -e '.[megatron]'`."
            ) from None

        self.parallel = parallel_of(knobs, world_size)
        for name in MEGATRON_KNOBS[:3]:
            knobs.pop(name, None)
        self.tp = self.parallel.tp
        self.interleave_qkv = (
            str(knobs.pop("conversion", MegatronKnobs.conversion)) != "no_qkv_interleave"
        )
        self.settings = ReplayKnobs.from_dict(knobs)
        unsupported = {
            "packing": self.settings.packing,
            "padding_side=left": self.settings.padding_side != "right",
            "top_k/top_p": self.settings.top_k or self.settings.top_p < 1,
        }
        if any(unsupported.values()):
            names = ", ".join(k for k, v in unsupported.items() if v)
            raise BadInput(f"megatron replay does not support {names}.")
        self.model_dir = Path(model_dir)
        config = json.loads((self.model_dir / "config.json").read_text())
        self.shape = check_convertible(config, self.parallel, world_size, str(model_dir))
        if self.settings.router_replay and self.shape.routing is None:
            raise BadInput(
                f"router_replay forces MoE routing, and {model_dir} is a dense "
                f"{self.shape.family} model; leave router_replay off."
            )
        self.device = self.settings.device  # this rank's: cpu or cuda:LOCAL_RANK
        if not is_cuda(self.device):
            cpu_stands_in_for_cuda()
            if self.shape.routing is not None:
                cpu_moe_shims()
        # a second session in this process (lpx serve loading a new weight version) rebuilds
        # megatron's groups: it keeps them in globals
        initialize_parallel(self.parallel)
        from megatron.core.tensor_parallel.random import initialize_rng_tracker

        initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
        self.parallel_state = parallel_state
        self.place = place_of_this_rank()
        self.model = self._build(config)
        self.model_config = config_as_built(self.model, config)
        self.routers = MegatronRouters(self.model)
        self.tp_rank = parallel_state.get_tensor_model_parallel_rank()
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.dp_size = parallel_state.get_data_parallel_world_size()
        self.world_size = world_size
        self.micro_batch_size = self.settings.micro_batch_size
        self.prompt_logprobs = self.settings.prompt_logprobs

    def _build(self, config: dict):
        dtype = torch_dtype(self.settings.dtype)
        shape = self.shape
        model = gpt_model(config, shape, self.parallel, dtype)
        hf = load_hf_weights(self.model_dir)
        self.checkpoint_fingerprint = tensor_fingerprint(
            (n, t.to(dtype)) for n, t in hf.items() if n != "lm_head.weight" or not shape.tied
        )
        shard = hf_to_megatron(hf, shape, self.parallel, self.place, self.interleave_qkv)
        missing, unexpected = model.load_state_dict(
            {k: v.to(dtype) for k, v in shard.items()}, strict=False
        )
        missing = [k for k in missing if not k.endswith("_extra_state")]
        if missing or unexpected:
            raise BadInput(
                f"megatron conversion mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}."
            )
        return model.to(device=self.device, dtype=dtype).eval()

    def score(self, pairs, routing: list | None = None):
        """One ScoredSequence per (prompt, completion) pair; ``routing`` (one [length - 1, MoE
        layers, k] array per pair, router_replay) forces the experts."""
        import torch

        if routing is not None and not self.routers:
            raise BadInput("router_replay forces MoE routing, and this model has no router.")
        try:
            with torch.no_grad():
                return self._score(pairs, routing)
        finally:
            self.routers.end()

    def _score(self, pairs, routing):
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
        if self.routers:
            forced = routing and batch_targets(
                routing, width, len(self.routers.layers), self.routers.top_k
            )
            self.routers.begin(forced or None)
        logits = self.model(input_ids=input_ids, position_ids=position_ids, attention_mask=mask)
        routed = self.routers.finish() if self.routers else None
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
        for row, ((prompt, _), sequence, first) in enumerate(
            zip(pairs, sequences, firsts, strict=True)
        ):
            count = len(sequence) - first
            values = logprobs[cursor : cursor + count]
            split = len(prompt) - first
            span = slice(cursor + split, cursor + count)
            prompt_lp = (
                np.concatenate([[np.nan], values[:split]]).astype(np.float32)
                if self.settings.prompt_logprobs
                else None
            )
            experts = None
            if routed is not None:
                experts = sequence_rows(routed, len(sequences), row, len(sequence))
            results.append(
                ScoredSequence(
                    values[split:].astype(np.float32),
                    prompt_lp,
                    top_ids[span],
                    top_logprobs[span],
                    routed_experts=experts,
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

        held = self.held_weights()
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
                "expert_model_parallel_size": self.parallel.ep,
                "expert_tensor_parallel_size": self.parallel.expert_tp,
                "router_replay": self.settings.router_replay,
                "conversion": "correct" if self.interleave_qkv else "no_qkv_interleave",
                "layer_spec": "local (no Transformer Engine), RMSNorm, unfused",
            },
            "layout": {
                "world_size": self.world_size,
                "tensor_parallel_size": self.tp,
                "expert_model_parallel_size": self.parallel.ep,
                "expert_tensor_parallel_size": self.parallel.expert_tp,
                "pipeline_parallel_size": 1,
                "data_parallel_size": self.dp_size,
                "micro_batch_size": self.settings.micro_batch_size,
                "padding_side": "right",
                "packing": False,
                "attn_implementation": "megatron local DotProductAttention",
                "logprobs": "vocab-parallel (logits never gathered)",
                "conversion": CONVERSION,
                **self._moe_layout(),
            },
            "model": model_metadata(self.model_dir, self.model_config),
            "weights": {
                "checkpoint_tensor_fingerprint": self.checkpoint_fingerprint,
                "held_tensor_fingerprint": tensor_fingerprint(held.items()),
            },
            "position_id_rule": "arange",
        }

    def _moe_layout(self) -> dict:
        if self.shape.routing is None:
            return {}
        config = self.model.config
        return {
            "moe": "megatron-core MoELayer (TopKRouter, SequentialMLP experts)",
            "moe_token_dispatcher_type": DISPATCHER,
            "moe_router_pre_softmax": config.moe_router_pre_softmax,
            "moe_router_dtype": config.moe_router_dtype or "the activations' dtype",
            "moe_shared_expert_gate": config.moe_shared_expert_gate,
        }

    def held_weights(self) -> dict:
        """Every rank's shard, reassembled into the HF layout: the weights actually held
        (gathered from the whole world: TP shards, and each EP rank's experts)."""
        import torch.distributed as dist

        ps = self.parallel_state
        # One copy of each shard: the data-parallel replicas of the dense layers (rank > 0)
        # and of the experts (expert data-parallel rank > 0) hold nothing the others lack.
        unique = ps.get_data_parallel_rank() == 0 or ps.get_expert_data_parallel_rank() == 0
        shard = unique and {
            k: v.detach().cpu()
            for k, v in self.model.state_dict().items()
            if not k.endswith("_extra_state")
        }
        shards = [None] * dist.get_world_size()
        dist.all_gather_object(shards, (self.place, shard))
        held = {place: shard for place, shard in shards if shard}
        return megatron_to_hf(held, self.shape, self.parallel)
