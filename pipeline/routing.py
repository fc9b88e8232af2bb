"""Routing as data: which experts each token went to, on each MoE layer, and how two sides'
routing agree.

A table's ``routed_experts`` is int16 [scored positions, MoE layers, k]: for every sequence,
the positions 0 .. prompt + completion - 2 of its prompt + completion (every position whose
next-token logits exist), each row the k expert ids that position's router chose, sorted
ascending (routing is a set: the order a kernel returns them in is not a difference). The
last ``completion`` rows of a sequence are the positions that produced its completion
tokens' logprobs. ``metadata["routing"]`` says which layers the columns are, k and the
expert count. A row that is not a set of k distinct experts (an id of -1, or an id twice, as
the zeros an engine returns for positions it did not route: prefix-cached or skipped
chunked-prefill tokens) is *unrecorded*: it counts as no flip, comparisons report how many
there are, and router replay leaves those positions to the replaying router. SGLang's return_routed_experts, vLLM's routed-experts capture and the verl
and slime dumps carry the same rows.

Router replay (R3): a replay engine given ``router_replay=true`` routes every position to
the fixture's experts, with the gate weights its own router gives those experts; a replay
that then agrees where the plain one did not shows the gap was routing, not arithmetic.
"""

from __future__ import annotations

import numpy as np

ROUTING_DTYPE = np.int16


def routing_offsets(prompt_offsets: np.ndarray, completion_offsets: np.ndarray) -> np.ndarray:
    """Start of each sequence's rows in ``routed_experts`` (prompt + completion - 1 each)."""
    lengths = np.diff(prompt_offsets) + np.diff(completion_offsets) - 1
    return np.concatenate([[0], np.cumsum(np.maximum(lengths, 0))]).astype(np.int64)


def completion_rows(prompt_offsets: np.ndarray, completion_offsets: np.ndarray) -> np.ndarray:
    """Indices into ``routed_experts`` of the rows that produced each completion token's
    logprob, in completion-token order."""
    starts = routing_offsets(prompt_offsets, completion_offsets)
    prompts = np.diff(prompt_offsets)
    completions = np.diff(completion_offsets)
    return np.concatenate(
        [starts[i] + prompts[i] - 1 + np.arange(completions[i]) for i in range(len(completions))]
        or [np.zeros(0, np.int64)]
    ).astype(np.int64)


def as_sets(experts: np.ndarray) -> np.ndarray:
    """Expert ids sorted along the last axis, in the stored dtype."""
    return np.sort(np.asarray(experts), axis=-1).astype(ROUTING_DTYPE)


def recorded(experts: np.ndarray) -> np.ndarray:
    """[rows, layers] True where the row is a real top-k choice: k distinct ids, none -1."""
    sets = as_sets(experts)
    return (sets[..., 0] >= 0) & np.all(np.diff(sets, axis=-1) != 0, axis=-1)


def flipped(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """[rows, layers] True where the two sides' top-k sets differ and both recorded one."""
    return np.any(as_sets(a) != as_sets(b), axis=-1) & recorded(a) & recorded(b)


def unrecorded(table) -> dict | None:
    """How many of a table's routing rows (every position, prompt included) are unrecorded on
    some layer, and where the first is; None when every row is a real top-k choice."""
    if table.routed_experts is None:
        return None
    missing = ~recorded(table.routed_experts).all(axis=1)
    if not missing.any():
        return None
    starts = routing_offsets(table.prompt_offsets, table.completion_offsets)
    row = int(np.flatnonzero(missing)[0])
    sequence = int(np.searchsorted(starts, row, side="right") - 1)
    return {
        "rows": int(missing.sum()),
        "of": int(len(missing)),
        "sequences": int(len(np.unique(np.searchsorted(starts, np.flatnonzero(missing), "right")))),
        "first": {
            "sequence_id": table.sequence_ids[sequence],
            "position": row - int(starts[sequence]),
        },
    }


def agreement(
    rollout: np.ndarray,
    replay: np.ndarray,
    layers: list[int],
    token_sequence: np.ndarray,
    token_position: np.ndarray,
    sequence_ids: list[str],
    abs_diff: np.ndarray,
) -> dict:
    """Routing agreement over completion tokens: per layer the fraction of tokens whose top-k
    set differs; the first flip (sequence, position, layer) in sequence order; and the
    logprob drift on tokens with any flip apart from the rest.

    ``rollout``/``replay`` are the completion rows [tokens, layers, k];
    ``token_sequence``/``token_position`` place each token; ``abs_diff`` is its |dlogp|."""
    flips = flipped(rollout, replay)
    any_flip = flips.any(axis=1)
    # a token either side did not route (unrecorded) is no evidence either way: left out
    compared = recorded(rollout) & recorded(replay)
    per_layer = [
        {"layer": int(layer), "flip_rate": _rate(flips[:, i].sum(), compared[:, i].sum()),
         "flips": int(flips[:, i].sum())}
        for i, layer in enumerate(layers)
    ]  # fmt: skip
    first = None
    if any_flip.any():
        token = int(np.flatnonzero(any_flip)[0])
        first = {
            "sequence_id": sequence_ids[int(token_sequence[token])],
            "position": int(token_position[token]),
            "layer": int(layers[int(np.flatnonzero(flips[token])[0])]),
        }
    diff = np.asarray(abs_diff, dtype=np.float64)
    finite = np.isfinite(diff)

    def drift(where: np.ndarray) -> dict:
        chosen = diff[where & finite]
        if not len(chosen):
            return {"tokens": 0, "mean_abs_diff": None, "max_abs_diff": None}
        return {"tokens": int(len(chosen)), "mean_abs_diff": float(chosen.mean()),
                "max_abs_diff": float(chosen.max())}  # fmt: skip

    return {
        "layers": per_layer,
        "tokens": int(len(flips)),
        "tokens_with_flip": int(any_flip.sum()),
        "flip_rate": _rate(any_flip.sum(), compared.any(axis=1).sum()),
        "unrecorded_tokens": {
            "rollout": int((~recorded(rollout).all(axis=1)).sum()),
            "replay": int((~recorded(replay).all(axis=1)).sum()),
        },
        "first_flip": first,
        "drift_on_flipped": drift(any_flip),
        "drift_on_rest": drift(~any_flip & compared.any(axis=1)),
    }


def _rate(count, total) -> float:
    return float(count) / float(total) if total else 0.0


def sequence_routing(table, index: int) -> np.ndarray:
    """Sequence ``index``'s routed_experts rows [prompt + completion - 1, layers, k], -1 in
    the unrecorded ones; a table without routing is refused (router replay needs the
    rollout's)."""
    from pipeline.errors import BadInput

    if table.routed_experts is None:
        raise BadInput(
            "router_replay needs the fixture's routed experts, and this fixture has none: record "
            "them at rollout (an engine that returns them) or ingest them "
            "(lpx ingest --field routed_experts=KEY)."
        )
    starts = routing_offsets(table.prompt_offsets, table.completion_offsets)
    rows = table.routed_experts[starts[index] : starts[index + 1]]
    return np.where(recorded(rows)[..., None], rows, -1).astype(ROUTING_DTYPE)


def routing_metadata(config: dict, source: str) -> dict | None:
    """metadata["routing"] for a table routed by a model with HF ``config``."""
    from pipeline.families import routing

    spec = routing(config)
    if spec is None:
        return None
    return {"layers": sorted(spec.layers), "top_k": spec.top_k,
            "num_experts": spec.num_experts, "source": source}  # fmt: skip


def routing_misfit(table, config: dict, model: str = "the model") -> str | None:
    """Why a table's routed experts cannot have come from ``model`` (its HF ``config``): it
    has no experts, or other MoE layers or top-k; None when they fit or the table has none.

    A fixture's routing is its rollout model's own: a model that routes otherwise (a dense
    one above all) is not the model that sampled it, and its replay would score another
    model's logprobs beside routing it can neither compare nor force."""
    from pipeline.families import routing

    if table.routed_experts is None:
        return None
    layers, k = (int(n) for n in table.routed_experts.shape[1:])
    carries = f"carries MoE routing for {layers} layer{'s' * (layers != 1)} (top-{k})"
    spec = routing(config)
    if spec is None:
        kind = config.get("model_type") or "unnamed"
        return f"{carries}, but {model} has no experts (config.json: model_type {kind!r}, no expert count)"
    if len(spec.layers) != layers or spec.top_k != k:
        return f"{carries}, but {model} routes {len(spec.layers)} MoE layers (top-{spec.top_k})"
    return None
