"""Faults committed the way engines commit them, by code independent of pipeline/faults.py: a
plain transformers forward over the engine's own batches. Used by the tests of the
hypothesis families and by the zoo (bench/diagnosis_scale.py)."""

from __future__ import annotations

import copy

import numpy as np


def left_padded_rollout(model_dir, fixture, order, size, pad_id, counted_positions):
    """The rollout's logprobs as an engine that lost the attention mask of a left-padded
    batch gives them: the engine's batches are `order` cut into groups of `size`; the pads
    (`pad_id`) are attended; with `counted_positions` the positions run from the first pad
    (transformers' default without a mask), else from the first real token (the mask was
    dropped after the positions were built from it)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    values = fixture.channels["rollout"].copy()
    for start in range(0, len(order), size):
        group = order[start : start + size]
        sequences = [
            np.concatenate([fixture.prompt_of(r), fixture.completion_of(r)]) for r in group
        ]
        width = max(len(s) for s in sequences)
        ids = torch.full((len(group), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(group), width), dtype=torch.long)
        for i, sequence in enumerate(sequences):
            ids[i, width - len(sequence) :] = torch.as_tensor(sequence)
            mask[i, width - len(sequence) :] = 1
        inputs = {"input_ids": ids}
        if not counted_positions:
            inputs["position_ids"] = (mask.cumsum(-1) - 1).clamp(min=0)
        with torch.no_grad():
            logprobs = model(**inputs).logits.float().log_softmax(-1)
        for i, row in enumerate(group):
            completion = torch.tensor(fixture.completion_of(row), dtype=torch.long)
            first = width - len(sequences[i]) + len(fixture.prompt_of(row)) - 1
            scored = logprobs[i, first : first + len(completion)].gather(-1, completion[:, None])
            values[fixture.completion_slice(row)] = scored[:, 0].numpy()
    out = copy.copy(fixture)  # the caller's table stays as it was
    out.channels = {"rollout": values}
    return out
