"""Line up a fixture and a replay token by token, refusing anything that is not the same tokens."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeline.errors import BadInput
from pipeline.fixture.table import (
    REPLAY_CHANNEL,
    REPLAY_TOP1_CHANNEL,
    VERSION_CHANNEL_PREFIX,
    TokenTable,
    offsets_from_lengths,
    positions_within,
)

KL_CHANNELS = ("old", "ref", "current")


@dataclass
class Region:
    """Compared tokens of one region (completion or prompt), flat, grouped by sequence."""

    offsets: np.ndarray
    positions: np.ndarray
    token_ids: np.ndarray
    rollout: np.ndarray
    train: np.ndarray


@dataclass
class Aligned:
    sequence_ids: list[str]
    completion: Region
    prompt: Region | None
    kl_channels: dict[str, np.ndarray]
    weight_versions: np.ndarray | None
    # Most likely token per compared completion position on each side, when both recorded it
    # (-1 on the train side: a token other than the rollout's top-k ids the replay scored).
    top1_rollout: np.ndarray | None = None
    top1_train: np.ndarray | None = None
    # [compared tokens, k >= 2] logprobs of the same token ids on both sides: the rollout's
    # recorded top-k and the replay's logprobs at those ids (pipeline/compare/topk.py).
    topk_rollout: np.ndarray | None = None
    topk_train: np.ndarray | None = None
    # A multi-version replay: the train side under each store version it scored (NaN where
    # it did not score that token), and how many tokens it left unscored (version missing).
    version_channels: dict[str, np.ndarray] | None = None
    unscored_tokens: int = 0
    # MoE, when both sides recorded routing over the same layers and k: the experts that
    # produced each compared completion token, [compared tokens, MoE layers, k] per side
    routing_rollout: np.ndarray | None = None
    routing_train: np.ndarray | None = None
    routing_layers: list[int] | None = None


def align(
    fixture: TokenTable, replay: TokenTable, channel: str, fixture_path: Path, replay_path: Path
) -> Aligned:
    if channel not in fixture.channels:
        have = ", ".join(fixture.channels) or "none"
        raise BadInput(f"{fixture_path}: no logprob channel {channel!r} (it has: {have}).")
    if REPLAY_CHANNEL not in replay.channels:
        raise BadInput(f"{replay_path}: no `replay` logprobs; it is not a replay output.")
    order = _replay_order(fixture, replay, fixture_path, replay_path)
    completion_index, completion_offsets = _gather_index(replay.completion_offsets, order)
    prompt_index, prompt_offsets = _gather_index(replay.prompt_offsets, order)
    for name, ours, theirs in (
        ("prompt", fixture.prompt_offsets, prompt_offsets),
        ("completion", fixture.completion_offsets, completion_offsets),
    ):
        lengths_differ = np.flatnonzero(np.diff(ours) != np.diff(theirs))
        if len(lengths_differ):
            i = int(lengths_differ[0])
            raise BadInput(
                f"{replay_path}: sequence {fixture.sequence_ids[i]!r} has a {name} of "
                f"{int(np.diff(theirs)[i])} tokens, the fixture {int(np.diff(ours)[i])}; the replay "
                f"was not made from {fixture_path}."
            )
    _same_tokens(fixture, "prompt", replay.prompt_ids[prompt_index], replay_path)
    _same_tokens(fixture, "completion", replay.completion_ids[completion_index], replay_path)
    active = fixture.completion_mask
    unscored = 0
    if (replay.metadata.get("weights_store") or {}).get("unscored_tokens"):
        # their recorded version is not in the store: the replay masked them and says so
        scored = replay.completion_mask[completion_index]
        unscored = int((active & ~scored).sum())
        active = active & scored
    active_offsets = offsets_from_lengths(_segment_count(active, fixture.completion_offsets))
    completion = Region(
        offsets=active_offsets,
        positions=fixture.completion_positions()[active],
        token_ids=fixture.completion_ids[active],
        rollout=fixture.channels[channel][active],
        train=replay.channels[REPLAY_CHANNEL][completion_index][active],
    )
    prompt = None
    if fixture.prompt_logprobs is not None and replay.prompt_logprobs is not None:
        # The first prompt token has no logprob on either side.
        scored = positions_within(fixture.prompt_offsets) > 0
        prompt = Region(
            offsets=offsets_from_lengths(_segment_count(scored, fixture.prompt_offsets)),
            positions=positions_within(fixture.prompt_offsets)[scored],
            token_ids=fixture.prompt_ids[scored],
            rollout=fixture.prompt_logprobs[scored],
            train=replay.prompt_logprobs[prompt_index][scored],
        )
    replay_rows = completion_index[active]
    top1_rollout, top1_train = _top1(fixture, replay, active, replay_rows)
    topk_rollout, topk_train = _same_topk(fixture, replay, active, replay_rows)
    routing = _same_routing(fixture, replay, active, completion_index)
    return Aligned(
        sequence_ids=fixture.sequence_ids,
        completion=completion,
        prompt=prompt,
        kl_channels={c: fixture.channels[c][active] for c in KL_CHANNELS if c in fixture.channels},
        weight_versions=None
        if fixture.weight_versions is None
        else fixture.weight_versions[active],
        top1_rollout=top1_rollout,
        top1_train=top1_train,
        topk_rollout=topk_rollout,
        topk_train=topk_train,
        version_channels={
            name[len(VERSION_CHANNEL_PREFIX) :]: values[completion_index][active]
            for name, values in replay.channels.items()
            if name.startswith(VERSION_CHANNEL_PREFIX)
        }
        or None,
        unscored_tokens=unscored,
        **routing,
    )


def _same_routing(fixture: TokenTable, replay: TokenTable, active, completion_index) -> dict:
    """Both sides' routing of the compared tokens, when both recorded the same layers and k."""
    from pipeline.routing import completion_rows

    if fixture.routed_experts is None or replay.routed_experts is None:
        return {}
    ours, theirs = fixture.metadata.get("routing") or {}, replay.metadata.get("routing") or {}
    if ours.get("layers") != theirs.get("layers") or ours.get("top_k") != theirs.get("top_k"):
        return {}
    fixture_rows = completion_rows(fixture.prompt_offsets, fixture.completion_offsets)
    replay_rows = completion_rows(replay.prompt_offsets, replay.completion_offsets)
    return {
        "routing_rollout": fixture.routed_experts[fixture_rows[active]],
        "routing_train": replay.routed_experts[replay_rows[completion_index][active]],
        "routing_layers": list(ours["layers"]),
    }


def _top1(fixture: TokenTable, replay: TokenTable, active, replay_rows):
    """Each side's most likely token at the compared positions, when both recorded top-k."""
    if fixture.top_ids is None or replay.top_ids is None:
        return None, None
    rollout, train = fixture.top_ids[active, 0], replay.top_ids[replay_rows, 0]
    own_best = replay.channels.get(REPLAY_TOP1_CHANNEL)
    if own_best is not None:
        # The replay scored the fixture's ids, not its own top-1: its top-1 is the first of
        # them where that one reaches the replay's own maximum logprob (the same fp32 values,
        # so equality is exact), and some other token elsewhere.
        reaches = replay.top_logprobs[replay_rows, 0] >= own_best[replay_rows]
        train = np.where(reaches, train, -1)
    return rollout, train


def _same_topk(fixture: TokenTable, replay: TokenTable, active, replay_rows):
    """Both sides' logprobs at the same k >= 2 ids per compared token, or (None, None) when
    the sides hold different ids (e.g. a replay that recorded its own top-1)."""
    if fixture.top_ids is None or replay.top_ids is None:
        return None, None
    k = fixture.top_ids.shape[1]
    if k < 2 or replay.top_ids.shape[1] != k:
        return None, None
    if not np.array_equal(fixture.top_ids[active], replay.top_ids[replay_rows]):
        return None, None
    return fixture.top_logprobs[active], replay.top_logprobs[replay_rows]


def _replay_order(fixture, replay, fixture_path, replay_path) -> np.ndarray:
    """For each fixture sequence, the index of the same sequence id in the replay."""
    if replay.sequence_ids == fixture.sequence_ids:
        return np.arange(fixture.num_sequences)
    position = replay.index_of()
    missing = [s for s in fixture.sequence_ids if s not in position]
    extra = sorted(set(position) - set(fixture.sequence_ids))
    if missing or extra:
        side, ids, other = (
            (replay_path, missing, fixture_path) if missing else (fixture_path, extra, replay_path)
        )
        shown = ", ".join(repr(s) for s in ids[:5]) + (" ..." if len(ids) > 5 else "")
        raise BadInput(
            f"{side}: {len(ids)} sequence id(s) of {other} are missing here ({shown}); "
            "compare a replay with the fixture it was made from."
        )
    return np.array([position[s] for s in fixture.sequence_ids], dtype=np.int64)


def _gather_index(offsets: np.ndarray, order: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Flat element index that reorders ragged rows into ``order``, and the new offsets."""
    lengths = np.diff(offsets)[order]
    new_offsets = offsets_from_lengths(lengths)
    index = positions_within(new_offsets) + np.repeat(offsets[:-1][order], lengths)
    return index, new_offsets


def _same_tokens(fixture: TokenTable, region: str, theirs: np.ndarray, replay_path) -> None:
    ours = fixture.prompt_ids if region == "prompt" else fixture.completion_ids
    offsets = fixture.prompt_offsets if region == "prompt" else fixture.completion_offsets
    differ = np.flatnonzero(ours != theirs)
    if len(differ):
        flat = int(differ[0])
        seq = int(np.searchsorted(offsets, flat, side="right") - 1)
        raise BadInput(
            f"{replay_path}: sequence {fixture.sequence_ids[seq]!r} {region} position "
            f"{flat - int(offsets[seq])} holds token {int(theirs[flat])} where the fixture has "
            f"{int(ours[flat])}; a replay must score the fixture's exact tokens."
        )


def _segment_count(flags: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    cumulative = np.concatenate([[0], np.cumsum(flags, dtype=np.int64)])
    return cumulative[offsets[1:]] - cumulative[offsets[:-1]]
