"""Write faulted copies of fixtures and replays, so users can prove their pipeline catches faults.

Data-only faults edit the logprob channel directly; the others re-score the sequence with
the real model under the fault (wrong temperature, offset position ids, older weights),
so the drift they plant has the shape a real bug would give.
"""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np

from pipeline.errors import BadInput
from pipeline.fixture.table import REPLAY_CHANNEL, TokenTable

FAULT_KINDS = ("token_shift", "mask", "position_ids", "temperature", "dtype", "stale_weights")
MODEL_KINDS = ("position_ids", "temperature", "stale_weights")
PAD_FILL_VALUE = 0.0  # what engines commonly write for tokens they did not score
INJECTED_TEMPERATURE = 0.7
POSITION_OFFSET = 16
STALE_WEIGHT_NOISE = 0.05  # relative to each tensor's standard deviation
STALE_SEED = 1234


def inject_fault(
    table: TokenTable,
    kind: str,
    sequence_id: str,
    from_position: int = 0,
    model_dir: Path | None = None,
) -> TokenTable:
    """A copy of ``table`` whose logprobs carry fault ``kind`` in one sequence from a position."""
    if kind not in FAULT_KINDS:
        raise BadInput(f"unknown fault kind {kind!r}; choose one of {', '.join(FAULT_KINDS)}.")
    index = table.index_of().get(str(sequence_id))
    if index is None:
        raise BadInput(f"no sequence {sequence_id!r} in this {table.kind}; see `lpx fixture show`.")
    span = table.completion_slice(index)
    length = span.stop - span.start
    if not 0 <= from_position < length - (2 if kind == "token_shift" else 0):
        raise BadInput(
            f"--from-position {from_position} is outside sequence {sequence_id!r} "
            f"({length} completion tokens{'; token_shift needs 2 after it' if kind == 'token_shift' else ''})."
        )
    faulted = copy.deepcopy(table)
    channel = REPLAY_CHANNEL if table.kind == "replay" else "rollout"
    values = faulted.channels[channel][span]  # a view: edits land in the copy
    if kind == "token_shift":
        values[from_position:-1] = values[from_position + 1 :].copy()
    elif kind == "mask":
        values[from_position:] = PAD_FILL_VALUE
    elif kind == "dtype":
        values[from_position:] = _round_to_bfloat16(values[from_position:])
    else:
        rescored = _rescore(table, index, kind, from_position, _model_dir(table, model_dir))
        values[from_position:] = rescored[from_position:]
        if kind == "stale_weights":
            _mark_stale(faulted, span, from_position)
    record = {"kind": kind, "sequence_id": str(sequence_id), "from_position": from_position}
    faulted.metadata = {
        **faulted.metadata,
        "injected_faults": [*faulted.metadata.get("injected_faults", []), record],
    }
    return faulted


def _rescore(
    table: TokenTable, index: int, kind: str, from_position: int, model_dir: Path
) -> np.ndarray:
    """Teacher-forced logprobs of one sequence with the real model under the fault."""
    import torch

    from pipeline.engines.hf_common import load_model
    from pipeline.engines.hf_replay import ReplayKnobs, score_batch

    prompt, completion = table.prompt_of(index), table.completion_of(index)
    model = load_model(model_dir, "float32")
    settings = ReplayKnobs(micro_batch_size=1)
    positions = None
    if kind == "temperature":
        settings = ReplayKnobs(micro_batch_size=1, temperature=INJECTED_TEMPERATURE)
    elif kind == "position_ids":
        position = np.arange(len(prompt) + len(completion))
        position[len(prompt) + from_position :] += POSITION_OFFSET
        positions = [position]
    elif kind == "stale_weights":
        generator = torch.Generator().manual_seed(STALE_SEED)
        for parameter in model.parameters():
            noise = torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype)
            parameter.add_(noise * parameter.std() * STALE_WEIGHT_NOISE)
    (scored,) = score_batch(model, [(prompt, completion)], settings, position_ids=positions)
    return scored.completion


def _mark_stale(table: TokenTable, span: slice, from_position: int) -> None:
    """Tokens from the fault on were sampled under the previous weight version."""
    if table.weight_versions is None:
        table.weight_versions = np.full(table.num_completion_tokens, "1", dtype=object)
    versions = table.weight_versions[span]
    current = str(versions[from_position])
    versions[from_position:] = str(int(current) - 1) if current.isdigit() else f"{current}-previous"


def _model_dir(table: TokenTable, model_dir: Path | None) -> Path:
    path = model_dir or (table.metadata.get("model") or {}).get("path")
    if not path or not (Path(path) / "config.json").is_file():
        raise BadInput(
            f"this fault re-scores with the model, but {path or 'no model path'} is not a model "
            "directory; pass --model DIR."
        )
    return Path(path)


def _round_to_bfloat16(values: np.ndarray) -> np.ndarray:
    """Round float32 to the nearest bfloat16 (ties to even), as an engine emitting bf16 would."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return rounded.astype(np.uint32).view(np.float32)
