"""What the diagnosis reads beside the logprobs (compare/hypotheses/batch.py:Context), from
both sides' records: precisions, the weight version the replay scored with, sampling and
temperature, weight fingerprints, sequence lengths, and the calibrated floor."""

from __future__ import annotations

from collections import Counter

import numpy as np

from pipeline.compare.align import Aligned
from pipeline.compare.calibrated import side_precision
from pipeline.compare.hypotheses.batch import Context
from pipeline.compare.policy import profile_for
from pipeline.fixture.table import TokenTable


def diagnosis_context(
    fixture: TokenTable,
    replay: TokenTable,
    aligned: Aligned,
    dtypes: list[str],
    floor=None,
    gate: dict | None = None,
) -> Context:
    """What the diagnosis reads beside the logprobs, from both sides' records. ``floor`` and
    ``gate``: the calibrated floor (compare/calibrated.py:calibrated_judging) and its
    precision gate's result, None when judged by the profile's constants."""
    fixture_meta, replay_meta = fixture.metadata, replay.metadata
    sides = (side_precision(fixture_meta), side_precision(replay_meta))
    reference = replay_meta.get("weight_version")
    multi_version = replay_meta.get("weights_store") is not None  # each token its own version
    if (
        reference is None
        and not multi_version
        and aligned.weight_versions is not None
        and len(aligned.weight_versions)
    ):
        reference = _agreeing_version(aligned)
    sampling = fixture_meta.get("sampling") or {}
    holds = str((fixture_meta.get("logprob_channels") or {}).get("rollout", ""))
    replay_temperature = (replay_meta.get("knobs") or {}).get("temperature", 1.0)
    rollout_temperature = sampling.get("temperature", 1.0) if holds.startswith("processed") else 1.0
    hint = None
    if sampling and rollout_temperature != replay_temperature:
        hint = (
            f"the fixture's rollout channel holds {holds or 'unknown'} (sampling temperature "
            f"{sampling.get('temperature')}) and the replay applied temperature {replay_temperature}"
        )
    held = replay_meta.get("weights") or {}
    calibrated = floor is not None
    return Context(
        low_precision_dtype=profile_for(dtypes),
        sampling=fixture_meta.get("sampling"),
        tf32_side="float32+tf32" in sides,
        reference_weight_version=reference,
        temperature_hint=hint,
        fixture_weights=(fixture_meta.get("model") or {}).get("weights_fingerprint"),
        replay_weights=(replay_meta.get("model") or {}).get("weights_fingerprint"),
        checkpoint_tensors=held.get("checkpoint_tensor_fingerprint"),
        held_tensors=held.get("held_tensor_fingerprint"),
        version_channels=aligned.version_channels,
        **_lengths(fixture, aligned),
        noise_expected=floor.expected_mean if calibrated else None,
        # the batch is beyond what precision gives at its size: precision cannot explain it
        beyond_precision=calibrated and not gate["passed"],
    )


def _lengths(fixture: TokenTable, aligned: Aligned) -> dict:
    """Prompt and whole-sequence lengths in the aligned order: padding and truncation bugs
    pick their victims by length."""
    index = fixture.index_of()
    rows = np.array([index[s] for s in aligned.sequence_ids], dtype=np.int64)
    prompt = np.diff(fixture.prompt_offsets)[rows]
    return {
        "prompt_lengths": prompt,
        "sequence_lengths": prompt + np.diff(fixture.completion_offsets)[rows],
    }


def _agreeing_version(aligned: Aligned):
    """The weight version the replay scored with, when it records none: the one whose tokens
    the replay agrees with best (ties: the most common)."""
    region = aligned.completion
    names = np.asarray([str(v) for v in aligned.weight_versions], dtype=object)
    gap = np.abs(region.train.astype(np.float64) - region.rollout.astype(np.float64))
    counts = Counter(names.tolist())
    scores = {name: float(np.nanmean(gap[names == name])) for name in counts}
    best = min(scores.values())
    tied = [name for name, score in scores.items() if score <= best * 1.0001]
    choice = max(tied, key=counts.get)
    return next(v for v in aligned.weight_versions if str(v) == choice)
