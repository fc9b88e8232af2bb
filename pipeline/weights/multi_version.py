"""Multi-version replay: score every completion token under the weight version recorded for
it, loading each needed version from a weight store once.

With in-flight weight updates one trajectory holds tokens of several policy versions
(PipelineRL); a check must compare each token with the version that produced it. Tokens
whose version the store does not hold are left unscored and reported, never scored with
another version. With claim checking on, each sequence is also scored under the store's
versions next to the ones it claims, so `lpx compare` can tell a fleet that claims version
v but served another (channels ``replay@<version>``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeline.errors import BadInput
from pipeline.fixture.table import (
    REPLAY_CHANNEL,
    VERSION_CHANNEL_PREFIX,
    TokenTable,
    select_sequences,
)


def version_channel(name: str) -> str:
    return VERSION_CHANNEL_PREFIX + name


@dataclass
class VersionPlan:
    """Which sequences to score under which store version, how much of each, and what
    cannot be scored."""

    sequences_by_version: dict[str, np.ndarray]  # store order; sequence indices, ascending
    # per version, per sequence above: completion tokens to score. Teacher forcing is causal,
    # so a version needed only by a sequence's early tokens scores only up to the last of
    # them (the tokens after an in-flight update cost the old version nothing).
    lengths_by_version: dict[str, np.ndarray]
    claimed_in_store: np.ndarray  # per token: its recorded version is in the store
    missing: dict[str, int]  # recorded version not in the store -> tokens


def plan_versions(
    claimed: np.ndarray, offsets: np.ndarray, store_versions: list[str], check_claims: bool
) -> VersionPlan:
    """Pure planning. ``claimed``: each completion token's recorded version (None when the
    rollout recorded none); ``store_versions``: the store's versions, oldest first. A token
    is scored under the version it claims and, when checking claims, under the store's
    neighbours of it (a fleet that lags or leads by a version)."""
    names = np.asarray([None if v is None else str(v) for v in claimed], dtype=object)
    rank_of = {name: i for i, name in enumerate(store_versions)}
    rank = np.fromiter((rank_of.get(n, -1) for n in names), dtype=np.int64, count=len(names))
    in_store = rank >= 0
    missing: dict[str, int] = {}
    for name in names[~in_store]:
        key = "(none recorded)" if name is None or name == "unknown" else name
        missing[key] = missing.get(key, 0) + 1
    sequence_of = np.repeat(np.arange(len(offsets) - 1), np.diff(offsets))
    within = np.arange(len(names)) - np.repeat(offsets[:-1], np.diff(offsets))
    reach = (-1, 0, 1) if check_claims else (0,)
    sequences: dict[str, np.ndarray] = {}
    lengths: dict[str, np.ndarray] = {}
    for r, name in enumerate(store_versions):
        needs = in_store & np.isin(rank - r, reach)
        if not needs.any():
            continue
        # per sequence, one past the last token that needs this version
        ends = np.zeros(len(offsets) - 1, dtype=np.int64)
        np.maximum.at(ends, sequence_of[needs], within[needs] + 1)
        (wanted,) = np.nonzero(ends)
        sequences[name], lengths[name] = wanted, ends[wanted]
    return VersionPlan(
        sequences_by_version=sequences,
        lengths_by_version=lengths,
        claimed_in_store=in_store,
        missing=dict(sorted(missing.items())),
    )


def replay_by_version(
    fixture: TokenTable,
    store: Path,
    score: Callable[[TokenTable, Path], TokenTable],
    check_claims: bool = True,
    say: Callable[[str], None] = lambda _: None,
) -> TokenTable:
    """The replay of ``fixture`` with each token scored under its recorded version.

    ``score(sub_fixture, model_dir)`` is one scoring engine's teacher-forced replay."""
    from pipeline.weights.store import list_versions, materialize

    if fixture.weight_versions is None:
        raise BadInput(
            "the fixture records no per-token weight_version, so there is nothing to replay "
            "version by version; roll out with the http engine (it records the server's "
            "versions) or ingest a dump with a weight-version field, or replay one version "
            "with --model."
        )
    listed = list_versions(store)
    store_versions = [v["name"] for v in listed]
    fingerprints = {v["name"]: v["fingerprint"] for v in listed}
    plan = plan_versions(
        fixture.weight_versions, fixture.completion_offsets, store_versions, check_claims
    )
    if not plan.sequences_by_version:
        raise BadInput(
            f"{store}: holds none of the weight versions the fixture records "
            f"({named_counts(plan.missing)}); the store has {', '.join(store_versions) or 'nothing'}."
        )
    index = fixture.index_of()
    total = fixture.num_completion_tokens
    by_version: dict[str, np.ndarray] = {}
    prompt_by_version: dict[str, np.ndarray] = {}
    replays: dict[str, TokenTable] = {}
    for name, sequences in plan.sequences_by_version.items():
        lengths = plan.lengths_by_version[name]
        model_dir = materialize(store, name)
        say(f"version {name}: {len(sequences)} sequences, {int(lengths.sum())} tokens")
        replay = score(select_sequences(fixture, sequences, lengths), model_dir)
        values = np.full(total, np.nan, dtype=np.float32)
        rows = np.array([index[s] for s in replay.sequence_ids], dtype=np.int64)
        starts = fixture.completion_offsets[rows]
        values[_token_index(np.stack([starts, starts + np.diff(replay.completion_offsets)]))] = (
            replay.channels[REPLAY_CHANNEL]
        )
        by_version[name] = values
        if replay.prompt_logprobs is not None:
            prompts = np.full(len(fixture.prompt_ids), np.nan, dtype=np.float32)
            spans = fixture.prompt_offsets[rows], fixture.prompt_offsets[rows + 1]
            prompts[_token_index(np.stack(spans))] = replay.prompt_logprobs
            prompt_by_version[name] = prompts
        replays[name] = replay

    claimed = np.asarray([str(v) for v in fixture.weight_versions], dtype=object)
    own = np.full(total, np.nan, dtype=np.float32)
    for name, values in by_version.items():
        mine = plan.claimed_in_store & (claimed == name)
        own[mine] = values[mine]
    first = next(iter(replays.values()))
    return TokenTable(
        kind="replay",
        sequence_ids=list(fixture.sequence_ids),
        prompt_offsets=fixture.prompt_offsets,
        prompt_ids=fixture.prompt_ids,
        completion_offsets=fixture.completion_offsets,
        completion_ids=fixture.completion_ids,
        # unscored tokens (their version is not in the store) are masked out, and NaN
        completion_mask=fixture.completion_mask & plan.claimed_in_store,
        channels={
            REPLAY_CHANNEL: own,
            **({version_channel(n): v for n, v in by_version.items()} if check_claims else {}),
        },
        prompt_logprobs=_prompts_of_first_version(fixture, claimed, prompt_by_version),
        weight_versions=fixture.weight_versions,
        metadata={
            **first.metadata,
            "model": {
                **(first.metadata.get("model") or {}),
                "path": str(store),
                "weights_fingerprint": None,
            },  # fmt: skip
            "weights": None,
            "weight_version": None,  # per token: `weight_versions`
            "weights_store": {
                "path": str(store),
                "check_claims": check_claims,
                "versions": {
                    name: {
                        "fingerprint": fingerprints[name],
                        "sequences": len(plan.sequences_by_version[name]),
                        "tokens_claimed": int((plan.claimed_in_store & (claimed == name)).sum()),
                        "held_tensor_fingerprint": (
                            (replays[name].metadata.get("weights") or {}).get(
                                "held_tensor_fingerprint"
                            )
                        ),
                    }
                    for name in by_version
                },
                "missing": plan.missing,
                "unscored_tokens": int((~plan.claimed_in_store).sum()),
            },
        },
    )


def _token_index(spans: np.ndarray) -> np.ndarray:
    """Flat indices of the ragged array elements in ``spans`` ([starts, ends]), in order."""
    starts, ends = spans
    lengths = ends - starts
    within = np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    return np.repeat(starts, lengths) + within


def _prompts_of_first_version(fixture, claimed, prompt_by_version) -> np.ndarray | None:
    """A prompt is scored under the version its first completion token claims: the one live
    when the sequence started."""
    if not prompt_by_version:
        return None
    out = np.full(len(fixture.prompt_ids), np.nan, dtype=np.float32)
    for i in range(fixture.num_sequences):
        start = int(fixture.completion_offsets[i])
        if start == int(fixture.completion_offsets[i + 1]):
            continue
        values = prompt_by_version.get(claimed[start])
        if values is not None:
            out[fixture.prompt_slice(i)] = values[fixture.prompt_slice(i)]
    return out


def named_counts(missing: dict[str, int]) -> str:
    """Missing versions and their token counts, as in `4 (12 tokens), 7 (3 tokens)`."""
    return ", ".join(f"{name} ({tokens} tokens)" for name, tokens in missing.items())


def missing_summary(table: TokenTable) -> str | None:
    """One line on tokens left unscored, for the replay command to print, or None."""
    store = table.metadata.get("weights_store") or {}
    if not store.get("unscored_tokens"):
        return None
    return (
        f"{store['unscored_tokens']} completion tokens were left unscored: their weight "
        f"versions are not in {store['path']} ({named_counts(store['missing'])}). Publish those "
        "versions or retain more (lpx weights publish --keep); compare masks these tokens "
        "and reports them."
    )
