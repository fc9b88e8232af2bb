"""Write faulted copies of fixtures and replays, so users can prove their pipeline catches faults.

Data faults edit the logprob channel directly (a shift by one token, a pad fill, bf16
rounding, Gaussian noise). Model faults (`pipeline/faults/`) re-score the chosen sequences
with the real model under a real misconfiguration, so the drift they plant has the shape the
real bug gives.
"""

from __future__ import annotations

import copy
from dataclasses import replace
from pathlib import Path

import numpy as np

from pipeline.devices import resolve_device, set_tf32
from pipeline.errors import BadInput
from pipeline.faults import FAULTS, FaultSettings, rescore
from pipeline.fixture.table import REPLAY_CHANNEL, TokenTable

DATA_KINDS = ("token_shift", "mask", "dtype", "noise")
MODEL_KINDS = tuple(FAULTS)
FAULT_KINDS = (*DATA_KINDS, *MODEL_KINDS)
PAD_FILL_VALUE = 0.0  # what engines commonly write for tokens they did not score
NOISE_SIGMA = 1e-3  # TF32 matmuls or another reduction order give drift of this size
NOISE_SEED = 1234
BATCH_KINDS = (
    "pad_attended",
    "mask_dropped",
    "pad_positions",
    "packed_no_reset",
    "prompt_truncated",
    "stale_weights",
    "version_change",
    "version_change_unrecorded",
)
# Kinds whose drift starts at --from-position; the others span the whole sequence.
FROM_POSITION_KINDS = (
    "token_shift",
    "mask",
    "dtype",
    "position_ids",
    "version_change",
    "version_change_unrecorded",
)


def inject_fault(
    table: TokenTable,
    kind: str,
    sequence_ids: list[str] | str,
    from_position: int = 0,
    model_dir: Path | None = None,
    settings: FaultSettings | None = None,
    device: str = "cpu",
    dtype: str = "float32",
    model=None,
) -> TokenTable:
    """A copy of ``table`` whose logprobs carry fault ``kind`` in the chosen sequences
    (``"all"`` for every one), from ``from_position`` where the kind has an onset. The model
    kinds re-score on ``device`` (auto, cpu, cuda, cuda:N) in ``dtype``: a bf16 engine's bug
    carries bf16 noise too. ``model``: one already loaded, reused."""
    if kind not in FAULT_KINDS:
        raise BadInput(f"unknown fault kind {kind!r}; choose one of {', '.join(FAULT_KINDS)}.")
    rows = _rows(table, sequence_ids)
    for row in rows:
        length = table.completion_slice(row).stop - table.completion_slice(row).start
        need = 2 if kind == "token_shift" else 0
        if kind in FROM_POSITION_KINDS and not 0 <= from_position < length - need:
            raise BadInput(
                f"--from-position {from_position} is outside sequence {table.sequence_ids[row]!r} "
                f"({length} completion tokens{'; token_shift needs 2 after it' if need else ''})."
            )
    faulted = copy.deepcopy(table)
    channel = REPLAY_CHANNEL if table.kind == "replay" else "rollout"
    if kind in DATA_KINDS:
        for row in rows:
            values = faulted.channels[channel][faulted.completion_slice(row)]  # a view
            _data_fault(values, kind, from_position, row)
    else:
        settings = _settings_for(table, kind, from_position, settings or FaultSettings())
        device = resolve_device(device)
        model = model if model is not None else _load(_model_dir(table, model_dir), device, dtype)
        if model.config.bos_token_id is not None:
            settings = replace(settings, bos_id=int(model.config.bos_token_id))
        # Padding, packing, truncation and the optimiser step depend on the whole batch:
        # score it all as the engine would, then keep the chosen sequences' scores.
        scored_rows = list(range(len(table.sequence_ids))) if kind in BATCH_KINDS else rows
        pairs = [(table.prompt_of(r), table.completion_of(r)) for r in scored_rows]
        scores = dict(zip(scored_rows, rescore(model, pairs, kind, settings), strict=True))
        for row, scored in ((r, scores[r]) for r in rows):
            _refuse_impossible(table, row, kind, scored)
            values = faulted.channels[channel][faulted.completion_slice(row)]
            values[:] = scored
            if kind == "version_change":
                _mark_new_version(faulted, faulted.completion_slice(row), settings.at)
    record = {
        "kind": kind,
        "sequence_ids": [table.sequence_ids[r] for r in rows],
        "from_position": from_position,
        **({} if kind in DATA_KINDS else {"device": device, "dtype": _dtype_of(model)}),
        "expected_cause": FAULTS[kind][0] if kind in FAULTS else _DATA_CAUSES.get(kind),
    }
    faulted.metadata = {
        **faulted.metadata,
        "injected_faults": [*faulted.metadata.get("injected_faults", []), record],
    }
    if kind in OTHER_WEIGHTS and faulted.metadata.get("model"):
        # these logprobs came from weights other than the checkpoint on file: its
        # fingerprint no longer says what they were scored with (as in a dump whose engine
        # synced weights in memory), so it is not kept as evidence that they were
        faulted.metadata["model"] = {**faulted.metadata["model"], "weights_fingerprint": None}
    if record["expected_cause"] == "prompt_mismatch":
        # these logprobs were scored on other prompt tokens than the ids on file, as by an
        # engine that added a BOS or a template to what it was given: the ids are no longer
        # evidence of what was consumed
        faulted.metadata["prompts_consumed_as_recorded"] = False
    return faulted


OTHER_WEIGHTS = ("stale_weights", "version_change", "version_change_unrecorded")


_DATA_CAUSES = {
    "token_shift": "token_shift",
    "mask": "mask_padding",
    "dtype": "dtype",
    # the same size on every token, confident ones too: no precision does that (bf16 barely
    # moves a token at p ~ 1), so the precision gate and re-scoring leave it unexplained
    "noise": "unexplained",
}


def _data_fault(values: np.ndarray, kind: str, from_position: int, row: int) -> None:
    if kind == "token_shift":
        values[from_position:-1] = values[from_position + 1 :].copy()
    elif kind == "mask":
        values[from_position:] = PAD_FILL_VALUE
    elif kind == "dtype":
        values[from_position:] = _round_to_bfloat16(values[from_position:])
    else:  # noise, the same on every token (unlike precision): seeded per row
        rng = np.random.default_rng([NOISE_SEED, row])
        values[:] = np.minimum(values + rng.normal(0, NOISE_SIGMA, len(values)), 0.0)


def _rows(table: TokenTable, sequence_ids) -> list[int]:
    index = table.index_of()
    if sequence_ids == "all" or sequence_ids == ["all"]:
        return list(range(len(table.sequence_ids)))
    rows = []
    for sequence_id in [sequence_ids] if isinstance(sequence_ids, str) else sequence_ids:
        row = index.get(str(sequence_id))
        if row is None:
            raise BadInput(
                f"no sequence {sequence_id!r} in this {table.kind}; see `lpx fixture show`."
            )
        rows.append(row)
    return sorted(set(rows))


def _settings_for(table: TokenTable, kind: str, from_position: int, settings: FaultSettings):
    """Processing faults use the sampling the fixture records: a rollout that sampled with
    top-k returns top-k-processed logprobs, never another k."""
    sampling = table.metadata.get("sampling") or {}
    changes = {}
    if kind in ("version_change", "version_change_unrecorded") and from_position:
        changes["at"] = from_position
    if kind == "position_ids":
        changes["at"] = from_position
    if kind == "temperature" and float(sampling.get("temperature") or 1.0) not in (0.0, 1.0):
        changes["temperature"] = float(sampling["temperature"])
    if kind in ("top_k", "top_k_top_p") and int(sampling.get("top_k") or 0) > 0:
        changes["top_k"] = int(sampling["top_k"])
    if kind in ("top_p", "top_k_top_p") and float(sampling.get("top_p") or 1.0) < 1.0:
        changes["top_p"] = float(sampling["top_p"])
    return replace(settings, **changes)


def _refuse_impossible(table: TokenTable, row: int, kind: str, scored: np.ndarray) -> None:
    if np.isfinite(scored).all():
        return
    position = int(np.flatnonzero(~np.isfinite(scored))[0])
    raise BadInput(
        f"sequence {table.sequence_ids[row]!r}: the token at completion position {position} lies "
        f"outside the {kind} set, so no rollout that sampled with it could have produced it; "
        "inject this kind into a fixture sampled with the same setting (lpx rollout --top-k K "
        "--top-p P)."
    )


def _mark_new_version(table: TokenTable, span: slice, at: int) -> None:
    """Tokens from ``at`` on were sampled under the next weight version."""
    if table.weight_versions is None:
        table.weight_versions = np.full(table.num_completion_tokens, "1", dtype=object)
    versions = table.weight_versions[span]
    current = str(versions[0])
    versions[at:] = str(int(current) + 1) if current.isdigit() else f"{current}-next"


def _load(model_dir: Path, device: str, dtype: str = "float32"):
    from pipeline.engines.hf.model import load_model

    model = load_model(model_dir, dtype, device=device)
    set_tf32(device, False)  # fp32 re-scores are IEEE fp32 on a GPU too
    return model


def _dtype_of(model) -> str:
    return str(next(model.parameters()).dtype).removeprefix("torch.")


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
