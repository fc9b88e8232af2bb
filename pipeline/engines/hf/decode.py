"""Teacher-forced decoding: a fixture's exact tokens fed one at a time through a KV cache,
the way a rollout engine computed their logprobs while sampling them.

A replay scores all completion tokens in one prefill; a rollout engine scored each while
decoding, with another reduction order for every matmul and attention. What that difference
alone moves is part of the precision noise floor (`lpx calibrate`).
"""

from __future__ import annotations

import numpy as np

from pipeline.engines.hf.model import model_device


def decode_logprobs(model, pairs, batch_size: int = 8, draws=None):
    """Completion logprobs of each (prompt ids, completion ids) pair, decoded with a KV cache
    from left-padded batches of ``batch_size`` (as `lpx rollout --engine hf` batches).
    ``draws`` (one [completion, k] id array per pair): also their logprobs at each step, and
    then (logprobs, drawn logprobs) is returned."""
    import torch

    results: list[np.ndarray] = []
    drawn: list[np.ndarray] = []
    with torch.no_grad():
        for start in range(0, len(pairs), batch_size):
            chunk = slice(start, start + batch_size)
            values, at_draws = _decode_batch(
                model, pairs[chunk], None if draws is None else draws[chunk]
            )
            results.extend(values)
            drawn.extend(at_draws)
    return results if draws is None else (results, drawn)


def _decode_batch(model, pairs, draws=None):
    import torch

    device = model_device(model)
    prompts = [np.asarray(p, dtype=np.int64) for p, _ in pairs]
    completions = [np.asarray(c, dtype=np.int64) for _, c in pairs]
    width = max(len(p) for p in prompts)
    steps = max(len(c) for c in completions)
    pad_id = model.config.pad_token_id or 0
    input_ids = np.full((len(pairs), width), pad_id, dtype=np.int64)
    mask = np.zeros((len(pairs), width), dtype=np.int64)
    forced = np.full((len(pairs), steps), pad_id, dtype=np.int64)
    live = np.zeros((len(pairs), steps), dtype=bool)
    for i, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
        input_ids[i, width - len(prompt) :] = prompt
        mask[i, width - len(prompt) :] = 1
        forced[i, : len(completion)] = completion
        live[i, : len(completion)] = True
    attention = torch.from_numpy(mask).to(device)
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    out = model(
        input_ids=torch.from_numpy(input_ids).to(device),
        attention_mask=attention,
        position_ids=positions,
        use_cache=True,
        logits_to_keep=1,  # the prefill's last row only: all of them are prompt x vocabulary
    )
    tokens = torch.from_numpy(forced).to(device)
    still = torch.from_numpy(live).to(device)
    next_position = positions[:, -1] + 1
    picked, picked_draws = [], []
    if draws is not None:
        k = draws[0].shape[1]
        drawn_ids = np.full((len(pairs), steps, k), pad_id, dtype=np.int64)
        for i, ids in enumerate(draws):
            drawn_ids[i, : len(ids)] = ids
        drawn_ids = torch.from_numpy(drawn_ids).to(device)
    for step in range(steps):
        logprobs = out.logits[:, -1, :].log_softmax(-1, dtype=torch.float32)
        picked.append(logprobs.gather(-1, tokens[:, step : step + 1])[:, 0])
        if draws is not None:
            picked_draws.append(logprobs.gather(-1, drawn_ids[:, step]))
        if step + 1 == steps:
            break
        attention = torch.cat([attention, still[:, step : step + 1].long()], dim=1)
        out = model(
            input_ids=tokens[:, step : step + 1],
            attention_mask=attention,
            position_ids=next_position[:, None],
            past_key_values=out.past_key_values,
            use_cache=True,
        )
        next_position = next_position + 1
    values = torch.stack(picked, dim=1).cpu().numpy()
    out_values = [values[i, : len(c)].astype(np.float32) for i, c in enumerate(completions)]
    if draws is None:
        return out_values, []
    at_draws = torch.stack(picked_draws, dim=1).cpu().numpy()
    return out_values, [at_draws[i, : len(c)].astype(np.float32) for i, c in enumerate(completions)]
