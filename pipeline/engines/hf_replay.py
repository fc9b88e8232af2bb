"""Teacher-forced replay with Hugging Face transformers: the training-side reference."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from pipeline.engines.base import knobs_from_dict
from pipeline.engines.hf_common import (
    load_model,
    model_metadata,
    process_logits,
    software_versions,
)
from pipeline.errors import BadInput
from pipeline.fixture.table import REPLAY_CHANNEL, TokenTable, table_from_sequences
from pipeline.progress import progress_bar

PADDING_SIDES = ("right", "left")


@dataclass
class ScoredSequence:
    completion: np.ndarray  # selected-token logprobs of the completion
    prompt: np.ndarray | None  # of the prompt (NaN first) when asked
    top_id: np.ndarray  # the most likely token at each completion position
    top_logprob: np.ndarray


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

    @classmethod
    def from_dict(cls, knobs: dict) -> ReplayKnobs:
        knobs_obj = knobs_from_dict(cls, knobs, "hf replay")
        if knobs_obj.padding_side not in PADDING_SIDES:
            raise BadInput(f"padding_side must be one of {', '.join(PADDING_SIDES)}.")
        if knobs_obj.micro_batch_size < 1:
            raise BadInput("micro_batch_size must be at least 1.")
        if knobs_obj.temperature <= 0:
            raise BadInput("temperature must be > 0 for teacher-forced scoring.")
        return knobs_obj


class HFScoringEngine:
    name = "hf"

    def score(self, fixture: TokenTable, model_dir: Path, knobs: dict) -> TokenTable:
        settings = ReplayKnobs.from_dict(knobs)
        started = time.perf_counter()
        model = load_model(model_dir, settings.dtype, settings.attn_implementation)
        loaded = time.perf_counter()
        scored: list[ScoredSequence] = []
        batches = range(0, fixture.num_sequences, settings.micro_batch_size)
        for start in progress_bar(batches, desc="hf replay", unit="batch"):
            indices = range(start, min(start + settings.micro_batch_size, fixture.num_sequences))
            pairs = [(fixture.prompt_of(i), fixture.completion_of(i)) for i in indices]
            scored.extend(score_batch(model, pairs, settings))
        metadata = {
            **replay_metadata(model, model_dir, settings),
            "timing": {"load_s": loaded - started, "score_s": time.perf_counter() - loaded},
        }
        return replay_table(fixture, scored, metadata, settings.prompt_logprobs)


def replay_table(
    fixture: TokenTable, scored: list[ScoredSequence], metadata: dict, with_prompt: bool
) -> TokenTable:
    """A replay of `fixture` from one ScoredSequence per fixture sequence, in fixture order."""
    indices = range(fixture.num_sequences)
    table = table_from_sequences(
        "replay",
        fixture.sequence_ids,
        [fixture.prompt_of(i) for i in indices],
        [fixture.completion_of(i) for i in indices],
        {REPLAY_CHANNEL: [s.completion for s in scored]},
        masks=np.split(fixture.completion_mask, fixture.completion_offsets[1:-1]),
        prompt_logprobs=[s.prompt for s in scored] if with_prompt else None,
        metadata=metadata,
    )
    if scored:
        table.top_ids = np.concatenate([s.top_id for s in scored])[:, None].astype(np.int32)
        table.top_logprobs = np.concatenate([s.top_logprob for s in scored])[:, None]
    return table


def score_batch(model, pairs, settings: ReplayKnobs, position_ids=None, full_forward: bool = False):
    """Selected-token logprobs for a micro-batch of (prompt ids, completion ids) pairs.

    Returns one ScoredSequence per pair. Logits are computed
    only at the positions that predict a scored token, so the harness costs less than a
    full-vocabulary forward. ``position_ids`` (one array per pair) overrides the default
    0..len-1 rule; fault injection uses it to reproduce position-id bugs. ``full_forward``
    runs the model's own forward (all-position logits) instead: sharded wrappers (FSDP,
    DeepSpeed) gather their parameters in hooks on the root module, so they need it.
    """
    import torch

    with torch.no_grad():
        return _score_batch(model, pairs, settings, position_ids, full_forward)


def _score_batch(model, pairs, settings: ReplayKnobs, position_ids, full_forward: bool):
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
    rows, columns = torch.from_numpy(row_index), torch.from_numpy(column_index)
    if full_forward:
        logits = model(**inputs, use_cache=False).logits[rows, columns].float()
    else:
        hidden = model.base_model(**inputs).last_hidden_state
        logits = _head_logits(model, hidden[rows, columns], settings)
    logprobs, top_ids, top_logprobs = _selected_logprobs(
        logits, torch.from_numpy(targets), settings
    )
    results, cursor = [], 0
    for (prompt, _), first, count in zip(pairs, firsts, counts, strict=True):
        values = logprobs[cursor : cursor + count]
        cursor += count
        split = len(prompt) - first
        prompt_lp = None
        if settings.prompt_logprobs:
            # The first prompt token has no context, hence no logprob.
            prompt_lp = np.concatenate([[np.nan], values[:split]]).astype(np.float32)
        span = slice(cursor - count + split, cursor)
        results.append(
            ScoredSequence(
                values[split:].astype(np.float32),
                prompt_lp,
                top_ids[span],
                top_logprobs[span].astype(np.float32),
            )
        )
    return results


def _head_logits(model, hidden_rows, settings: ReplayKnobs):
    import torch

    head = model.get_output_embeddings()
    if settings.lm_head_fp32:
        bias = None if head.bias is None else head.bias.float()
        return torch.nn.functional.linear(hidden_rows.float(), head.weight.float(), bias)
    return head(hidden_rows).float()


def _selected_logprobs(logits, targets, settings: ReplayKnobs):
    """Selected-token logprobs, plus the top-1 token and its logprob at each row."""
    logits = process_logits(logits, settings.temperature, settings.top_k, settings.top_p)
    all_logprobs = logits.log_softmax(-1)
    selected = all_logprobs.gather(-1, targets[:, None]).squeeze(-1)
    top_logprob, top_id = all_logprobs.max(-1)
    return selected.numpy(), top_id.numpy(), top_logprob.numpy()


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


def replay_metadata(model, model_dir: Path, settings: ReplayKnobs) -> dict:
    import dataclasses

    applied = dataclasses.asdict(settings)
    # Read back what the engine actually runs with, not only what was asked.
    applied["dtype"] = str(next(model.parameters()).dtype).removeprefix("torch.")
    applied["attn_implementation"] = model.config._attn_implementation
    return {
        "engine": {"name": "hf", "role": "replay", "versions": software_versions()},
        "dtype": applied["dtype"],
        "knobs": applied,
        "layout": {
            "world_size": 1,
            "tensor_parallel_size": 1,
            "pipeline_parallel_size": 1,
            "micro_batch_size": settings.micro_batch_size,
            "padding_side": settings.padding_side,
            "packing": settings.packing,
            "attn_implementation": applied["attn_implementation"],
        },
        "model": model_metadata(model_dir),
        "position_id_rule": "arange",
    }
