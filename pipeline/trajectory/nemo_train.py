"""NeMo-RL's GRPO training batch as it logs it: `train_data_step{N}.jsonl`.

GRPO (nemo_rl/algorithms/grpo.py at 7ea279ab) flattens each message_log into one sequence and
logs the batch row by row: `token_ids` (prompt and every turn, right-padded to the batch's
longest), `input_lengths` (the real length), `token_loss_mask` (1 on generated tokens),
`generation_logprobs` (the engine's, 0.0 elsewhere) and `prev_logprobs` (the trainer's, the
`old` logprobs of the policy loss). All per-token arrays are aligned to `token_ids`: GRPO's
`token_mult_prob_error` compares generation and prev logprobs token for token.

The prompt is every token before the first 1 of the mask; the completion the rest, masked as
dumped. The turns come from the mask's runs (pipeline/trajectory/fixture.py).
"""

from __future__ import annotations

import math
from pathlib import Path

from pipeline.errors import BadInput

TOKENS, LENGTH, MASK = "token_ids", "input_lengths", "token_loss_mask"
ROLLOUT, OLD = "generation_logprobs", "prev_logprobs"


def read_train_data(path: Path, metadata: dict):
    from pipeline.fixture.ingest import json_objects
    from pipeline.fixture.table import table_from_sequences

    ids, prompts, completions, masks = [], [], [], []
    channels: dict[str, list] = {"rollout": [], "old": []}
    for number, where, record in json_objects(path):
        tokens = _ids(record, where)
        length = _length(record, len(tokens), where)
        tokens = tokens[:length]
        mask = _per_token(record, MASK, len(tokens), where, flags=True)
        first = next((i for i, v in enumerate(mask) if v), None)
        if first is None or first == 0:
            what = "no generated token (all 0)" if first is None else "a 1 on the first token"
            raise BadInput(
                f"{where}: `{MASK}` has {what}; a sequence is a prompt, then generated turns"
            )
        ids.append(str(record.get("idx", number)))
        prompts.append(tokens[:first])
        completions.append(tokens[first:])
        masks.append([bool(v) for v in mask[first:]])
        channels["rollout"].append(_per_token(record, ROLLOUT, len(tokens), where)[first:])
        if record.get(OLD) is not None:
            channels["old"].append(_per_token(record, OLD, len(tokens), where)[first:])
    if not ids:
        raise BadInput(f"{path}: no sequences found.")
    if channels["old"] and len(channels["old"]) != len(ids):
        raise BadInput(f"{path}: `{OLD}` on some lines only; a batch logs it on all or none")
    kept = {name: values for name, values in channels.items() if values}
    return table_from_sequences(
        "fixture", ids, prompts, completions, kept, masks=masks,
        metadata={**metadata, "position_id_rule": "arange", "ingested_from": str(path),
                  "logprob_channels": {"rollout": f"as dumped in {ROLLOUT!r}",
                                       **({"old": f"as dumped in {OLD!r}"} if "old" in kept
                                          else {})}},
    )  # fmt: skip


def _ids(record: dict, where: str) -> list[int]:
    tokens = record.get(TOKENS)
    if not isinstance(tokens, list) or not tokens:
        raise BadInput(f"{where}: no `{TOKENS}` list")
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in tokens):
        raise BadInput(f"{where}: `{TOKENS}` must hold token ids (whole numbers, 0 or more)")
    return tokens


def _length(record: dict, n: int, where: str) -> int:
    length = record.get(LENGTH, n)
    if not isinstance(length, int) or isinstance(length, bool) or not 0 < length <= n:
        raise BadInput(f"{where}: `{LENGTH}`={length!r} does not fit {n} `{TOKENS}`")
    return length


def _per_token(record: dict, key: str, n: int, where: str, flags: bool = False) -> list:
    values = record.get(key)
    if not isinstance(values, list) or len(values) < n:
        count = "none" if not isinstance(values, list) else len(values)
        raise BadInput(f"{where}: {count} `{key}` for {n} tokens; one per token")
    values = values[:n]  # the row's padding cut as the tokens' was
    if flags:
        if not all(isinstance(v, int | float) and v in (0, 1) for v in values):
            raise BadInput(f"{where}: `{key}` is a mask: it must hold 0 or 1")
        return [int(v) for v in values]
    if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in values):
        raise BadInput(f"{where}: `{key}` must hold numbers")
    floats = [float(v) for v in values]
    if not all(math.isfinite(v) for v in floats):
        raise BadInput(f"{where}: `{key}` holds a value that is not finite")
    return floats
