"""Teacher-forced replay with Hugging Face transformers: the training-side reference."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from pipeline import devices
from pipeline.engines.base import knobs_from_dict
from pipeline.engines.hf.model import (
    load_model,
    model_device,
    numerics_from_knobs,
    numerics_metadata,
    process_logits,
)
from pipeline.engines.hf.routing import router_tap
from pipeline.engines.metadata import model_metadata, software_versions
from pipeline.engines.scoring import ScoredSequence, micro_batch_where, replay_table
from pipeline.errors import BadInput
from pipeline.fixture.table import (
    TokenTable,
)
from pipeline.progress import progress_bar
from pipeline.routing import sequence_routing

PADDING_SIDES = ("right", "left")
SCORED_TOP_IDS = "at the fixture's top-k ids"  # metadata["top_logprobs"] when score_top_ids acts


@dataclass(frozen=True)
class ReplayKnobs:
    """Every setting of the HF replay that can change a logprob."""

    dtype: str = "float32"
    micro_batch_size: int = field(default=8, metadata={"min": 1})
    padding_side: str = "right"
    packing: bool = False
    attn_implementation: str = "sdpa"
    lm_head_fp32: bool = False
    temperature: float = field(default=1.0, metadata={"min": 1e-6})  # logits are divided by it
    top_k: int = 0
    top_p: float = field(default=1.0, metadata={"min": 1e-6, "max": 1.0})
    prompt_logprobs: bool = False
    device: str = "auto"  # auto, cpu, cuda, cuda:N (pipeline.devices)
    allow_tf32: bool = False  # TF32 matmuls in fp32 on CUDA: off unless asked
    # When the fixture recorded top-k ids (k >= 2, e.g. vLLM's logprobs=k), score those ids
    # instead of recording this engine's own top-1, so compare gets a top-k KL (hf only).
    score_top_ids: bool = True
    # MoE: route every position to the fixture's routed_experts (router replay, R3)
    router_replay: bool = False
    # reduced-precision numerics, emulated exactly (docs/reduced-precision.md): a preset
    # (fp8, fp8-block, mxfp8, int8, ...) or ELEMENT:w=..,a=..; the KV cache's dtype (auto,
    # fp8, fp8_e4m3, fp8_e5m2) and its K/V scales ("0.5/0.25"; 1.0 when empty)
    quantization: str = ""
    kv_cache_dtype: str = "auto"
    kv_scales: str = ""

    @classmethod
    def from_dict(cls, knobs: dict) -> ReplayKnobs:
        knobs_obj = knobs_from_dict(cls, knobs, "hf replay")
        devices.parse_device(knobs_obj.device, "--device")
        if knobs_obj.padding_side not in PADDING_SIDES:
            raise BadInput(f"padding_side must be one of {', '.join(PADDING_SIDES)}.")
        if knobs_obj.micro_batch_size < 1:
            raise BadInput("micro_batch_size must be at least 1.")
        if knobs_obj.temperature <= 0:
            raise BadInput("temperature must be > 0 for teacher-forced scoring.")
        knobs_obj.numerics()  # refused here, naming the knob, before any model loads
        return knobs_obj

    def numerics(self):
        return numerics_from_knobs(
            "hf replay", self.quantization, self.kv_cache_dtype, self.kv_scales
        )


class HFScoringEngine:
    name = "hf"
    knobs = ReplayKnobs
    takes_device = True  # --device places it (pipeline.devices)

    def score(self, fixture: TokenTable, model_dir: Path, knobs: dict) -> TokenTable:
        settings = ReplayKnobs.from_dict(knobs)
        device = devices.resolve_device(settings.device, "--device")
        settings = replace(settings, device=device)
        started = time.perf_counter()
        model = load_model(
            model_dir, settings.dtype, settings.attn_implementation, device, settings.numerics()
        )
        tf32 = devices.set_tf32(device, settings.allow_tf32)
        loaded = time.perf_counter()
        size = settings.micro_batch_size
        batches = [
            range(start, min(start + size, fixture.num_sequences))
            for start in range(0, fixture.num_sequences, size)
        ]
        fixture_top = _fixture_top_ids(fixture, model, settings)
        forced = None
        if settings.router_replay:
            forced = [[sequence_routing(fixture, i) for i in b] for b in batches]
        scored = score_batches(
            model,
            [[(fixture.prompt_of(i), fixture.completion_of(i)) for i in b] for b in batches],
            settings,
            where=lambda k: micro_batch_where(fixture, batches[k], size),
            lower=f"--micro-batch-size (now {size}), or score in bf16 or on more ranks "
            "(--engine fsdp --nproc N)",
            top_ids=None
            if fixture_top is None
            else [[fixture_top[fixture.completion_slice(i)] for i in b] for b in batches],
            routing=forced,
        )
        metadata = {
            **replay_metadata(model, model_dir, settings, tf32),
            "timing": {"load_s": loaded - started, "score_s": time.perf_counter() - loaded},
        }
        if fixture_top is not None:
            metadata["top_logprobs"] = SCORED_TOP_IDS
        return replay_table(fixture, scored, metadata, settings.prompt_logprobs)


def _fixture_top_ids(fixture: TokenTable, model, settings: ReplayKnobs) -> np.ndarray | None:
    """The fixture's top-k ids to score (k >= 2 and score_top_ids), checked against the
    vocabulary; None keeps the replay's own top-1."""
    top = fixture.top_ids
    if not settings.score_top_ids or top is None or top.shape[1] < 2:
        return None
    vocab_size = int(model.get_output_embeddings().weight.shape[0])
    outside = np.flatnonzero(((top < 0) | (top >= vocab_size)).any(axis=1))
    if len(outside):
        row = int(outside[0])
        i = int(np.searchsorted(fixture.completion_offsets, row, side="right") - 1)
        raise BadInput(
            f"the fixture's top_ids at sequence {fixture.sequence_ids[i]!r} completion position "
            f"{row - int(fixture.completion_offsets[i])} hold an id outside the model vocabulary "
            f"[0, {vocab_size}); it was recorded with another model, or replay with "
            "--set score_top_ids=false."
        )
    return top


def score_batches(
    model,
    batches: list,
    settings: ReplayKnobs,
    where=None,
    lower: str = "",
    progress=True,
    top_ids: list | None = None,
    routing: list | None = None,
):
    """ScoredSequences of micro-batches of (prompt ids, completion ids) pairs, in order.

    ``routing``, when given, holds per micro-batch one [length - 1, MoE layers, k] array of
    expert ids per pair, which the MoE routers are made to choose (router replay).

    ``top_ids``, when given, holds per micro-batch one [completion tokens, k] id array per
    pair: the ids to score at each completion position instead of the replay's own top-1.

    On a GPU, micro-batch k + 1 is launched before k's results are read back, so the GPU
    never idles while the host pads the next batch and splits the last one's results. A CUDA
    out-of-memory becomes an exit-2 error naming the micro-batch (``where(k)``) and what to
    ``lower``.
    """
    scored: list[ScoredSequence] = []
    waiting = None
    shown = progress_bar(batches, desc="hf replay", unit="batch") if progress else batches
    for k, pairs in enumerate(shown):
        try:
            launched = launch_batch(
                model,
                pairs,
                settings,
                top_ids=None if top_ids is None else top_ids[k],
                routing=None if routing is None else routing[k],
            )
        except Exception as error:
            if not devices.is_out_of_memory(error):
                raise
            devices.release_memory(settings.device)
            place = where(k) if where else f"micro-batch {k + 1} of {len(batches)}"
            raise devices.out_of_memory(settings.device, place, lower or "the batch size") from None
        if waiting is not None:
            scored.extend(finish_batch(waiting))
        waiting = launched
    if waiting is not None:
        scored.extend(finish_batch(waiting))
    return scored


def score_batch(
    model,
    pairs,
    settings: ReplayKnobs,
    position_ids=None,
    full_forward: bool = False,
    top_ids: list | None = None,
    routing: list | None = None,
):
    """Selected-token logprobs for a micro-batch of (prompt ids, completion ids) pairs.

    Returns one ScoredSequence per pair. Logits are computed
    only at the positions that predict a scored token, so the harness costs less than a
    full-vocabulary forward. ``position_ids`` (one array per pair) overrides the default
    0..len-1 rule; fault injection uses it to reproduce position-id bugs. ``full_forward``
    runs the model's own forward (all-position logits) instead: sharded wrappers (FSDP,
    DeepSpeed) gather their parameters in hooks on the root module, so they need it.
    ``top_ids`` (one [completion tokens, k] array per pair) are ids to score at each
    completion position instead of the replay's own top-1 (ScoredSequence says which).
    ``routing`` (one [length - 1, MoE layers, k] array per pair) forces the MoE routers.
    """
    return finish_batch(
        launch_batch(model, pairs, settings, position_ids, full_forward, top_ids, routing)
    )


@dataclass
class LaunchedBatch:
    """A micro-batch whose scoring is queued on the device; its results copy back."""

    pairs: list
    firsts: list[int]
    with_prompt: bool
    # host tensor [tokens, 3]: selected logprob, top logprob, top id; or with k scored ids
    # [tokens, 2 + 2k]: selected logprob, own top logprob, k logprobs, k ids
    values: object
    ready: object  # waits for the copy to land
    scored_ids: int = 0  # k, or 0: the replay's own top-1
    routed: list | None = None  # MoE: each pair's routing [length - 1, MoE layers, k]


def launch_batch(
    model,
    pairs,
    settings: ReplayKnobs,
    position_ids=None,
    full_forward: bool = False,
    top_ids: list | None = None,
    routing: list | None = None,
) -> LaunchedBatch:
    """Queue a micro-batch's scoring on the model's device (score_batch without the wait)."""
    import torch

    with torch.no_grad():
        return _launch_batch(model, pairs, settings, position_ids, full_forward, top_ids, routing)


def finish_batch(launched: LaunchedBatch) -> list[ScoredSequence]:
    """Wait for a launched micro-batch and split its results per sequence."""
    launched.ready()
    values = launched.values.numpy()
    logprobs = values[:, 0].astype(np.float32)
    k = launched.scored_ids
    if k:
        best = values[:, 1].astype(np.float32)
        top_logprobs = values[:, 2 : 2 + k].astype(np.float32)
        top_ids = values[:, 2 + k :].astype(np.int64)
    else:
        best = None
        top_logprobs = values[:, 1].astype(np.float32)
        top_ids = values[:, 2].astype(np.int64)
    results, cursor = [], 0
    for (prompt, completion), first in zip(launched.pairs, launched.firsts, strict=True):
        count = len(prompt) + len(completion) - first
        chunk = logprobs[cursor : cursor + count]
        split = len(prompt) - first
        prompt_lp = None
        if launched.with_prompt:  # the first prompt token has no context, so no logprob
            prompt_lp = np.concatenate([[np.nan], chunk[:split]]).astype(np.float32)
        span = slice(cursor + split, cursor + count)
        cursor += count
        results.append(
            ScoredSequence(
                chunk[split:],
                prompt_lp,
                top_ids[span],
                top_logprobs[span],
                None if best is None else best[span],
                None if launched.routed is None else launched.routed[len(results)],
            )
        )
    return results


def _launch_batch(
    model, pairs, settings: ReplayKnobs, position_ids, full_forward: bool, top_ids, routing
):
    import torch

    sequences = [np.concatenate([p, c]).astype(np.int64) for p, c in pairs]
    positions = position_ids or [np.arange(len(s)) for s in sequences]
    if settings.packing:
        inputs, starts = _packed_inputs(model, sequences, positions)
    else:
        inputs, starts = _padded_inputs(model, sequences, positions, settings.padding_side)
    # The hidden state at position t predicts the token at t + 1: gather, in one indexing
    # op, the rows that predict each scored token (from `first` on) of every sequence.
    firsts = [1 if settings.prompt_logprobs else len(prompt) for prompt, _ in pairs]
    counts = [len(s) - f for s, f in zip(sequences, firsts, strict=True)]
    row_index = np.repeat([row for row, _ in starts], counts)
    column_index = np.concatenate(
        [
            np.arange(start + f - 1, start + len(s) - 1)
            for (_, start), f, s in zip(starts, firsts, sequences, strict=True)
        ]
    )
    targets = np.concatenate([s[f:] for s, f in zip(sequences, firsts, strict=True)])
    index = np.stack([row_index, column_index, targets])
    if top_ids is not None:
        index = np.concatenate([index, _scored_id_rows(pairs, firsts, top_ids).T])
    tap = router_tap(model)
    if routing is not None and tap is None:
        raise BadInput("router_replay forces MoE routing, and this model has no router.")
    if tap is not None:
        tap.begin(int(inputs["input_ids"].shape[1]), starts, [len(s) for s in sequences], routing)
    device = model_device(model)
    inputs = _to_device(inputs, device)
    index = torch.from_numpy(index).to(device)  # one copy for all the index rows
    rows, columns, targets = index[0], index[1], index[2]
    scored_ids = index[3:].T if top_ids is not None else None
    if full_forward:
        logits = model(**inputs, use_cache=False).logits[rows, columns]
    else:
        hidden = model.base_model(**inputs).last_hidden_state
        logits = _head_logits(model, hidden[rows, columns], settings)
    values, ready = devices.to_host_later(_selected_logprobs(logits, targets, settings, scored_ids))
    k = 0 if top_ids is None else len(index) - 3
    routed = tap.finish() if tap is not None else None
    return LaunchedBatch(pairs, firsts, settings.prompt_logprobs, values, ready, k, routed)


def _scored_id_rows(pairs, firsts, top_ids) -> np.ndarray:
    """[scored rows, k]: the ids to score at each completion row, in the order the rows are
    gathered; rows that predict prompt tokens score id 0, and their values are dropped."""
    k = top_ids[0].shape[1]
    blocks = []
    for (prompt, completion), first, ids in zip(pairs, firsts, top_ids, strict=True):
        if ids.shape != (len(completion), k):
            raise ValueError(f"top ids of shape {ids.shape} for {len(completion)} tokens, k={k}")
        blocks += [np.zeros((len(prompt) - first, k), np.int64), ids.astype(np.int64)]
    return np.concatenate(blocks)


def _head_logits(model, hidden_rows, settings: ReplayKnobs):
    import torch

    head = model.get_output_embeddings()
    if settings.lm_head_fp32:
        bias = None if head.bias is None else head.bias.float()
        return torch.nn.functional.linear(hidden_rows.float(), head.weight.float(), bias)
    return head(hidden_rows)


def _selected_logprobs(logits, targets, settings: ReplayKnobs, scored_ids=None):
    """[rows, 3]: the selected-token logprob, the top-1 token's logprob and its id; with
    ``scored_ids`` [rows, k], [rows, 2 + 2k]: the selected-token logprob, the top-1 token's
    logprob, the logprobs at the k ids and the ids.

    ``logits`` come in the model's dtype; the log-softmax is always fp32. Without
    temperature or truncation it reads bf16 logits and writes fp32 in one kernel, and the
    top token comes from the logits (a log-softmax keeps each row's order), so no fp32 copy
    of the logits is made: on a GPU these passes over rows x vocabulary are most of what
    the harness adds to the forward.
    """
    import torch

    processed = settings.temperature != 1.0 or settings.top_k or settings.top_p < 1.0
    if processed:
        logits = process_logits(
            logits.float(), settings.temperature, settings.top_k, settings.top_p
        )
    all_logprobs = logits.log_softmax(-1, dtype=torch.float32)
    if scored_ids is not None:
        picked = all_logprobs.gather(-1, torch.cat([targets[:, None], scored_ids], dim=1))
        best = all_logprobs.amax(-1, keepdim=True)
        logprobs = torch.cat([picked[:, :1], best, picked[:, 1:]], dim=1)
        return torch.cat([logprobs.double(), scored_ids.double()], dim=1)
    top_id = logits.argmax(-1)
    picked = all_logprobs.gather(-1, torch.stack([targets, top_id], dim=1))
    # float64 holds every fp32 logprob and token id exactly: one copy off the device
    return torch.cat([picked.double(), top_id.double()[:, None]], dim=1)


def _to_device(inputs: dict, device) -> dict:
    """The batch's tensors on ``device``, the same-shaped integer ones in one copy."""
    import torch

    if device.type == "cpu":
        return inputs
    same = [name for name, t in inputs.items() if t.dtype == torch.long]
    shapes = {inputs[name].shape for name in same}
    moved = {name: t.to(device) for name, t in inputs.items() if name not in same}
    if len(shapes) == 1:
        stacked = torch.stack([inputs[n] for n in same]).to(device).unbind(0)
        moved.update(zip(same, stacked, strict=True))
    else:
        moved.update({name: inputs[name].to(device) for name in same})
    return moved


def _padded_inputs(model, sequences, positions, padding_side: str):
    import torch

    width = max(len(s) for s in sequences)
    pad_id = model.config.pad_token_id or 0
    input_ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(sequences), width), dtype=torch.long)
    position_ids = torch.zeros((len(sequences), width), dtype=torch.long)
    starts = []
    for i, (sequence, position) in enumerate(zip(sequences, positions, strict=True)):
        start = 0 if padding_side == "right" else width - len(sequence)
        span = slice(start, start + len(sequence))
        input_ids[i, span] = torch.from_numpy(sequence)
        attention_mask[i, span] = 1
        position_ids[i, span] = torch.as_tensor(position)
        starts.append((i, start))
    inputs = {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": position_ids,
    }
    return inputs, starts


def _packed_inputs(model, sequences, positions):
    """One row holding all sequences, with a block-diagonal causal mask between them."""
    import torch

    total = sum(len(s) for s in sequences)
    segment = torch.repeat_interleave(
        torch.arange(len(sequences)), torch.tensor([len(s) for s in sequences])
    )
    allowed = torch.tril(torch.ones(total, total, dtype=torch.bool))
    allowed &= segment[:, None] == segment[None, :]
    dtype = model.get_output_embeddings().weight.dtype
    # An additive float mask: both the eager and sdpa attention paths read it the same way.
    mask = torch.zeros((1, 1, total, total), dtype=dtype)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    starts, cursor = [], 0
    for sequence in sequences:
        starts.append((0, cursor))
        cursor += len(sequence)
    inputs = {
        "input_ids": torch.from_numpy(np.concatenate(sequences))[None],
        "position_ids": torch.from_numpy(np.concatenate(positions).astype(np.int64))[None],
        "attention_mask": mask,
    }
    return inputs, starts


def replay_metadata(model, model_dir: Path, settings: ReplayKnobs, tf32: dict) -> dict:
    import dataclasses

    applied = dataclasses.asdict(settings)
    # Read back what the engine actually runs with, not only what was asked.
    applied["dtype"] = str(next(model.parameters()).dtype).removeprefix("torch.")
    applied["attn_implementation"] = model.config._attn_implementation
    applied["device"] = str(model_device(model))
    applied["allow_tf32"] = tf32["allow_tf32"]
    return {
        "engine": {
            "name": "hf",
            "role": "replay",
            "versions": software_versions(applied["device"]),
        },
        "dtype": applied["dtype"],
        "knobs": applied,
        "hardware": {**devices.hardware(applied["device"]), **tf32},
        "layout": {
            "device": devices.device_kind(applied["device"]),
            "world_size": 1,
            "tensor_parallel_size": 1,
            "pipeline_parallel_size": 1,
            "micro_batch_size": settings.micro_batch_size,
            "padding_side": settings.padding_side,
            "packing": settings.packing,
            "attn_implementation": applied["attn_implementation"],
        },
        "model": model_metadata(model_dir, model.config),
        "position_id_rule": "arange",
        **numerics_metadata(model),
    }
