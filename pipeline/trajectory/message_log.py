"""NeMo-RL's `message_log`: a trajectory as a list of turns, each with its role and token ids,
and on the generated (assistant) turns the engine's `generation_logprobs`.

One JSON object per line with a `message_log` list. The prompt is every turn before the first
generated turn; the completion every later one, masked to the generated turns; the turns kept
as the fixture's trajectories (pipeline/trajectory/fixture.py). Any role other than system,
user and assistant (tool, environment, ...) is a tool turn.

A message_log is read as the rollout leaves it and as GRPO's
`add_grpo_token_loss_masks_and_generation_logprobs` (nemo_rl/algorithms/grpo.py, at 7ea279ab)
leaves it: that step gives every turn a `token_loss_mask` (1 only on assistant turns that carry
the engine's logprobs) and zero `generation_logprobs` where a turn had none. So a turn is
generated where its `token_loss_mask` is 1, or, without one, where it is an assistant turn with
`generation_logprobs`; an assistant turn of the prompt's history is context, like a user turn.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pipeline.errors import BadInput
from pipeline.trajectory.shape import MODEL_ROLE

TOKENS, LOGPROBS, LOSS_MASK = "token_ids", "generation_logprobs", "token_loss_mask"


def read_message_logs(path: Path, metadata: dict):
    from pipeline.fixture.ingest import json_objects
    from pipeline.fixture.table import table_from_sequences

    ids, prompts, completions, masks, logprobs, described = [], [], [], [], [], {}
    for number, where, record in json_objects(path):
        turns = record.get("message_log")
        if not isinstance(turns, list) or not turns:
            raise BadInput(f"{where}: no `message_log` list of turns")
        sequence_id = str(record.get("idx", number))
        read = [_turn(turn, f"{where}, turn {k}") for k, turn in enumerate(turns)]
        first = next((k for k, (role, _, _) in enumerate(read) if role == MODEL_ROLE), None)
        if first is None or first == 0:
            what = "no assistant turn" if first is None else "an assistant turn first"
            raise BadInput(
                f"{where}: {what}; a trajectory starts with a prompt and has a model turn"
            )
        prompt = [i for _, tokens, _ in read[:first] for i in tokens]
        completion, mask, values, spans, start = [], [], [], [], 0
        for role, tokens, _ in read:
            spans.append({"role": role, "start": start, "end": start + len(tokens)})
            start += len(tokens)
        for role, tokens, lps in read[first:]:
            completion += tokens
            mask += [role == MODEL_ROLE] * len(tokens)
            values += lps if lps is not None else [np.nan] * len(tokens)
        ids.append(sequence_id)
        prompts.append(prompt)
        completions.append(completion)
        masks.append(mask)
        logprobs.append(values)
        described[sequence_id] = {"turns": spans}
    if not ids:
        raise BadInput(f"{path}: no trajectories found.")
    table = table_from_sequences(
        "fixture", ids, prompts, completions, {"rollout": logprobs}, masks=masks,
        metadata={**metadata, "position_id_rule": "arange", "ingested_from": str(path),
                  "logprob_channels": {"rollout": f"as dumped in each turn's {LOGPROBS!r}"}},
    )  # fmt: skip
    table.metadata["trajectories"] = described
    table.metadata["agent_loop"] = {"mode": "ingested", "preset": "nemo-rl"}
    return table


def _turn(turn, where: str) -> tuple[str, list[int], list[float] | None]:
    if not isinstance(turn, dict):
        raise BadInput(f"{where}: a turn is an object with role and {TOKENS}")
    role = turn.get("role")
    role = role if role in ("system", "user", MODEL_ROLE) else "tool"
    tokens = turn.get(TOKENS)
    if (
        not isinstance(tokens, list)
        or not tokens
        or not all(isinstance(t, int) and t >= 0 for t in tokens)
    ):
        raise BadInput(f"{where} ({turn.get('role')}): `{TOKENS}` must be a non-empty list of ids")
    values = turn.get(LOGPROBS)
    generated = _generated(turn, role, len(tokens), values, where)
    if not generated:
        if values is not None and not _zero_filled(values, len(tokens)):
            raise BadInput(
                f"{where} ({turn.get('role')}): `{LOGPROBS}` on a turn the model did not "
                "generate; only generated assistant turns carry the engine's logprobs (zeros, as "
                "GRPO fills them in, are accepted)"
            )
        # an assistant turn of the prompt's history: context the engine was given
        return ("user" if role == MODEL_ROLE else role), tokens, None
    if not isinstance(values, list) or len(values) != len(tokens):
        count = "none" if not isinstance(values, list) else len(values)
        raise BadInput(
            f"{where} (assistant): {count} `{LOGPROBS}` for {len(tokens)} tokens; one per token"
        )
    try:
        floats = [float(v) for v in values]
    except (TypeError, ValueError):
        raise BadInput(f"{where} (assistant): `{LOGPROBS}` must be numbers") from None
    return role, tokens, floats


def _generated(turn: dict, role: str, n: int, values, where: str) -> bool:
    mask = turn.get(LOSS_MASK)
    if mask is None:
        return role == MODEL_ROLE and values is not None
    if not isinstance(mask, list) or len(mask) != n or not all(v in (0, 1) for v in mask):
        raise BadInput(f"{where} ({turn.get('role')}): `{LOSS_MASK}` must be {n} values of 0 or 1")
    if len(set(mask)) > 1:
        raise BadInput(
            f"{where} ({turn.get('role')}): `{LOSS_MASK}` mixes 0 and 1 inside one turn; a turn is "
            "generated or not"
        )
    if mask[0] == 1 and role != MODEL_ROLE:
        raise BadInput(
            f"{where} ({turn.get('role')}): `{LOSS_MASK}` is 1 on a turn the model did not "
            "generate; only assistant turns are trained on"
        )
    return mask[0] == 1


def _zero_filled(values, n: int) -> bool:
    return isinstance(values, list) and len(values) == n and all(v == 0 for v in values)
