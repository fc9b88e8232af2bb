"""What every scoring engine returns per sequence (ScoredSequence), how it names a micro-batch
in an error, and how its scored sequences become a replay table in the fixture's order.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeline.fixture.table import (
    REPLAY_CHANNEL,
    REPLAY_TOP1_CHANNEL,
    TokenTable,
    table_from_sequences,
)
from pipeline.routing import routing_metadata


@dataclass
class ScoredSequence:
    completion: np.ndarray  # selected-token logprobs of the completion
    prompt: np.ndarray | None  # of the prompt (NaN first) when asked
    # [tokens]: the most likely token at each completion position and its logprob; or
    # [tokens, k]: the fixture's top-k ids there and this engine's logprobs at them
    top_id: np.ndarray
    top_logprob: np.ndarray
    # with [tokens, k] ids only: the logprob of this engine's own most likely token
    best_logprob: np.ndarray | None = None
    # MoE models: int [prompt + completion - 1, MoE layers, k], the experts each position's
    # router chose (pipeline.routing)
    routed_experts: np.ndarray | None = None


def micro_batch_where(fixture: TokenTable, indices, size: int) -> str:
    indices = list(indices)
    lengths = [len(fixture.prompt_of(i)) + len(fixture.completion_of(i)) for i in indices]
    ids = fixture.sequence_ids
    return (
        f"micro-batch {indices[0] // size + 1} of {-(-fixture.num_sequences // size)} "
        f"(sequences {ids[indices[0]]!r} to {ids[indices[-1]]!r}, {len(indices)} x "
        f"{max(lengths)} tokens padded)"
    )


def replay_table(
    fixture: TokenTable, scored: list[ScoredSequence], metadata: dict, with_prompt: bool
) -> TokenTable:
    """A replay of `fixture` from one ScoredSequence per fixture sequence, in fixture order."""
    indices = range(fixture.num_sequences)
    channels = {REPLAY_CHANNEL: [s.completion for s in scored]}
    if scored and scored[0].best_logprob is not None:  # top_ids are the fixture's ids
        channels[REPLAY_TOP1_CHANNEL] = [s.best_logprob for s in scored]
    table = table_from_sequences(
        "replay",
        fixture.sequence_ids,
        [fixture.prompt_of(i) for i in indices],
        [fixture.completion_of(i) for i in indices],
        channels,
        masks=np.split(fixture.completion_mask, fixture.completion_offsets[1:-1]),
        prompt_logprobs=[s.prompt for s in scored] if with_prompt else None,
        metadata=metadata,
    )
    if scored:
        top_ids = np.concatenate([s.top_id for s in scored])
        top_logprobs = np.concatenate([s.top_logprob for s in scored])
        if top_ids.ndim == 1:  # the engine's own top-1
            top_ids, top_logprobs = top_ids[:, None], top_logprobs[:, None]
        table.top_ids = top_ids.astype(np.int32)
        table.top_logprobs = top_logprobs.astype(np.float32)
    if scored and scored[0].routed_experts is not None:
        table.routed_experts = np.concatenate([s.routed_experts for s in scored])
        if "routing" not in metadata:
            config = json.loads((Path(metadata["model"]["path"]) / "config.json").read_text())
            engine = (metadata.get("engine") or {}).get("name", "replay")
            table.metadata = {**metadata, "routing": routing_metadata(config, engine)}
    return table
