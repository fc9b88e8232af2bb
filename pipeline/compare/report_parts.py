"""The report's summaries of what was compared, made from numpy: the worst tokens, drift
per weight version, the per-position drift map, the workload the history tells nights
apart by, and the generation defaults the recorded sampling leaves unset."""

from __future__ import annotations

import hashlib

import numpy as np

from pipeline.compare.align import Aligned, Region
from pipeline.compare.drift_map import drift_map
from pipeline.compare.metrics import batch_metrics
from pipeline.contracts.metrics import PER_VERSION_METRICS
from pipeline.fingerprint import prompt_set_fingerprint
from pipeline.fixture.table import TokenTable

CONTEXT_TOKENS = 6  # left-context token ids kept with each worst token


def workload_of(fixture: TokenTable) -> dict:
    """What was compared, as the history tells nights apart: the prompt set, and a digest of
    the sampled tokens (sequence ids, completion lengths and ids). Two nights with the same
    digest compared the same tokens; otherwise `lpx record` measures how much they share
    (pipeline/history/workload.py)."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update("\0".join(map(str, fixture.sequence_ids)).encode())
    digest.update(np.asarray(fixture.completion_offsets, dtype=np.int64).tobytes())
    digest.update(np.asarray(fixture.completion_ids, dtype=np.int64).tobytes())
    return {
        "prompt_set": prompt_set_fingerprint(fixture),
        "tokens_digest": digest.hexdigest(),
        "sequences": int(fixture.num_sequences),
        "completion_tokens": int(len(fixture.completion_ids)),
    }


def worst_tokens(aligned: Aligned, k: int) -> list[dict]:
    """The k tokens with the largest |d| across the compared regions."""
    rows = []
    for region_name, region in _regions(aligned):
        diff = np.abs(region.train.astype(np.float64) - region.rollout.astype(np.float64))
        top = np.argpartition(-diff, min(k, len(diff)) - 1)[:k] if len(diff) else []
        sequence_of = np.searchsorted(region.offsets, top, side="right") - 1
        for flat, seq in zip(top, sequence_of, strict=True):
            context_start = max(int(region.offsets[seq]), int(flat) - CONTEXT_TOKENS)
            rows.append(
                {
                    "sequence_id": aligned.sequence_ids[int(seq)],
                    "position": int(region.positions[flat]),
                    "token_id": int(region.token_ids[flat]),
                    "region": region_name,
                    "logprob_rollout": float(region.rollout[flat]),
                    "logprob_train": float(region.train[flat]),
                    "abs_diff": float(diff[flat]),
                    # the tokens before it in the same region: decoded as context on run pages
                    "context_ids": region.token_ids[context_start:flat].tolist(),
                }
            )
    return sorted(rows, key=lambda row: -row["abs_diff"])[:k]


def _regions(aligned: Aligned) -> list[tuple[str, Region]]:
    regions = [("completion", aligned.completion)]
    return regions + ([("prompt", aligned.prompt)] if aligned.prompt is not None else [])


def by_weight_version(aligned: Aligned, tau: float) -> dict:
    """Drift per recorded weight version: a replay that scored each token under its own
    version is clean per version; a stale or misclaimed one shows which version drifts."""
    versions = aligned.weight_versions
    if versions is None or len(versions) == 0:
        return {}
    region = aligned.completion
    names = np.asarray([str(v) for v in versions], dtype=object)
    seq = np.repeat(np.arange(len(region.offsets) - 1), np.diff(region.offsets))
    rows = {}
    for name in sorted(set(names.tolist())):
        mine = names == name
        metrics = batch_metrics(region.train[mine], region.rollout[mine], tau)
        rows[name] = {
            **{key: metrics[key] for key in PER_VERSION_METRICS if key in metrics},
            "sequences": int(len(np.unique(seq[mine]))),
        }
    return {"by_weight_version": rows}


def drift_map_of(aligned: Aligned, tau: float) -> dict | None:
    region = aligned.completion
    lengths = np.diff(region.offsets)
    sequence_index = np.repeat(np.arange(len(lengths)), lengths)
    abs_diff = np.abs(region.train.astype(np.float64) - region.rollout.astype(np.float64))
    return drift_map(aligned.sequence_ids, sequence_index, region.positions, abs_diff, tau)


def unset_generation_defaults(fixture_meta: dict) -> dict | None:
    """The sampling fields the model's generation_config.json sets that the fixture's
    recorded sampling leaves unset: an engine that applies the model's defaults (vLLM's
    `--generation-config auto`, SGLang's chat API) then sampled, and may have returned
    logprobs, under them. lpx's own rollouts send every field explicitly; a dump (`lpx
    ingest`) or a table with no sampling record does not say. None when nothing is unset."""
    config = (fixture_meta.get("model") or {}).get("generation_config") or {}
    sampling = fixture_meta.get("sampling") or {}
    if not config or (sampling and not fixture_meta.get("ingested_from")):
        return None
    unset = {name: value for name, value in config.items() if name not in sampling}
    if not unset:
        return None
    return {
        "unset": unset,
        "logprobs": str((fixture_meta.get("logprob_channels") or {}).get("rollout", "unknown")),
        "note": "the recorded sampling leaves "
        + ", ".join(f"{k} unset (the model's generation config: {v})" for k, v in unset.items())
        + "; an engine that applies the model's defaults sampled with them, and processed "
        "logprobs carry them (re-scoring searches them first: lpx compare --model)",
    }
