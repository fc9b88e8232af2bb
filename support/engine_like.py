"""Faults committed the way engines commit them, by code independent of pipeline/faults/: a
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


# --- one sequence at a time, scored by a plain transformers forward ------------------------


def load_fp32(model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def rescored(model_dir, fixture, rows, score):
    """A copy of ``fixture`` whose rollout logprobs of ``rows`` are ``score(model, prompt,
    completion)`` (one float per completion token), the other rows as they were."""
    import torch

    model = load_fp32(model_dir)
    values = fixture.channels["rollout"].copy()
    with torch.no_grad():
        for row in rows:
            prompt = np.asarray(fixture.prompt_of(row), dtype=np.int64)
            completion = np.asarray(fixture.completion_of(row), dtype=np.int64)
            scored = np.asarray(score(model, prompt, completion), dtype=np.float32)
            assert scored.shape == completion.shape
            values[fixture.completion_slice(row)] = scored
    out = copy.copy(fixture)
    out.channels = {"rollout": values}
    return out


def replay_scored_by(replay, model_dir, score):
    """A copy of the replay table ``replay`` whose logprobs are ``score(model, prompt,
    completion)`` on every row (the model in fp32): a trainer that computes them its own way,
    its metadata the replay's."""
    import torch

    from pipeline.fixture.table import REPLAY_CHANNEL

    model = load_fp32(model_dir)
    values = replay.channels[REPLAY_CHANNEL].copy()
    with torch.no_grad():
        for row in range(replay.num_sequences):
            prompt = np.asarray(replay.prompt_of(row), dtype=np.int64)
            completion = np.asarray(replay.completion_of(row), dtype=np.int64)
            values[replay.completion_slice(row)] = score(model, prompt, completion)
    out = copy.copy(replay)
    out.channels = {**replay.channels, REPLAY_CHANNEL: values}
    return out


def _logits(model, ids, positions=None, past=None):
    import torch

    inputs = {"input_ids": torch.as_tensor(ids, dtype=torch.long)[None], "use_cache": True}
    if positions is not None:
        inputs["position_ids"] = torch.as_tensor(positions, dtype=torch.long)[None]
    if past is not None:
        inputs["past_key_values"] = past
    out = model(**inputs)
    return out.logits[0].float(), out.past_key_values


def _gather(logprobs, tokens) -> np.ndarray:
    import torch

    picked = logprobs.gather(-1, torch.as_tensor(tokens, dtype=torch.long)[:, None])[:, 0]
    return picked.double().numpy()


def temperature_after_log_softmax(t: float):
    """An engine that applies its temperature to logprobs, not logits: log_softmax in
    float64, divided by T, normalised again (equal to log_softmax(logits / T) in exact
    arithmetic, another order of operations in floating point)."""

    def score(model, prompt, completion):
        ids = np.concatenate([prompt, completion])
        logits, _ = _logits(model, ids)
        logprobs = (logits.double().log_softmax(-1) / t).log_softmax(-1)
        return _gather(logprobs[len(prompt) - 1 : len(ids) - 1], completion)

    return score


def cached_positions(cut, start):
    """A KV-cache engine: the inputs before index ``cut(prompt, completion)`` are prefilled at
    their true positions; the rest are decoded on that cache with positions from
    ``start(cut)`` (a stale cache length, a restarted segment), where the cached keys keep
    theirs."""

    def score(model, prompt, completion):
        import torch

        ids = np.concatenate([prompt, completion])
        inputs = ids[:-1]  # the input at j scores the token at j + 1
        at = cut(prompt, completion)
        first, past = _logits(model, inputs[:at], np.arange(at))
        rest, _ = _logits(model, inputs[at:], np.arange(len(inputs) - at) + start(at), past)
        logprobs = torch.cat([first, rest]).log_softmax(-1)
        return _gather(logprobs[len(prompt) - 1 :], completion)

    return score


def labels_unshifted(model, prompt, completion):
    """A scorer that gathers logits[t] against token t (labels = input ids, never shifted)."""
    ids = np.concatenate([prompt, completion])
    logits, _ = _logits(model, ids)
    logprobs = logits.log_softmax(-1)
    return _gather(logprobs[len(prompt) :], completion)


def with_prompt(edit):
    """The sequence scored over ``edit(prompt)`` in place of its prompt (a template or a
    tokenizer that adds or drops tokens), by a plain forward."""

    def score(model, prompt, completion):
        edited = np.asarray(edit(prompt), dtype=np.int64)
        ids = np.concatenate([edited, completion])
        logits, _ = _logits(model, ids)
        return _gather(logits.log_softmax(-1)[len(edited) - 1 : len(ids) - 1], completion)

    return score


def stored_one_off(fixture, rows, at: dict, shift: int):
    """The dump's logprobs written one token off from completion index ``at[row]`` on, a
    numpy edit: token t's logprob stored at index t + ``shift`` (+1: written one late, each
    index holds its predecessor's; -1: read one ahead, each holds its successor's). The end
    left without a neighbour keeps its value."""
    values = fixture.channels["rollout"].copy()
    for row in rows:
        span = values[fixture.completion_slice(row)]  # a view
        true = span.copy()
        k = at[row]
        if shift == 1:
            span[k + 1 :] = true[k:-1]
        else:
            span[k:-1] = true[k + 1 :]
    out = copy.copy(fixture)
    out.channels = {"rollout": values}
    return out


# --- a sampler's processed logprobs, by transformers' own generate ------------------------


def generated_rollout(model_dir, fixture, seed: int = 0, processors=None, **sampling):
    """The fixture's prompts sampled again by transformers' `generate` under ``sampling``
    (its own temperature, top_k, top_p, min_p, repetition_penalty, sequence_bias) and the
    extra ``processors(prompt_length)`` (penalties and soft-caps transformers lacks), each
    completion as long as the fixture's (no end-of-sequence stop, which would mask EOS), with
    the processed logprobs the sampler drew from: what an engine that applied that
    processing returns as its logprobs."""
    import torch
    from transformers import LogitsProcessorList

    model = load_fp32(model_dir)
    model.generation_config.eos_token_id = None
    completions, values = [], []
    for row in range(fixture.num_sequences):
        prompt = torch.as_tensor(np.asarray(fixture.prompt_of(row), dtype=np.int64))[None]
        length = len(fixture.completion_of(row))
        torch.manual_seed(seed + row)
        with torch.no_grad():
            out = model.generate(
                prompt,
                attention_mask=torch.ones_like(prompt),
                do_sample=True,
                max_new_tokens=length,
                output_scores=True,
                return_dict_in_generate=True,
                logits_processor=LogitsProcessorList(
                    processors(prompt.shape[1]) if processors else []
                ),
                pad_token_id=0,
                # transformers' defaults off (its top-k of 50 above all): only ``sampling``
                **{"top_k": 0, "top_p": 1.0, "temperature": 1.0, **sampling},
            )
        tokens = out.sequences[0, prompt.shape[1] :]
        scores = torch.stack(out.scores)[:, 0].double().log_softmax(-1)
        completions.append(tokens.numpy())
        values.append(scores.gather(-1, tokens[:, None])[:, 0].float().numpy())
    table = copy.copy(fixture)
    table.completion_ids = np.concatenate(completions).astype(fixture.completion_ids.dtype)
    table.channels = {"rollout": np.concatenate(values).astype(np.float32)}
    table.metadata = {**fixture.metadata, "sampling": {}}  # as a dump that records none
    return table


class PresenceFrequency:
    """vLLM's presence and frequency penalties, over the output so far, in float64."""

    def __init__(self, prompt_length: int, presence: float, frequency: float):
        self.start, self.presence, self.frequency = prompt_length, presence, frequency

    def __call__(self, input_ids, scores):
        import torch

        output = input_ids[0, self.start :]
        counts = torch.bincount(output, minlength=scores.shape[-1]).to(torch.float64)
        moved = scores.double() - self.presence * (counts > 0) - self.frequency * counts
        return moved.to(scores.dtype)


class SoftCap:
    """cap * tanh(logits / cap), as a model with a final-logit soft-cap gives its logits."""

    def __init__(self, cap: float):
        self.cap = cap

    def __call__(self, input_ids, scores):
        return (self.cap * (scores.double() / self.cap).tanh()).to(scores.dtype)


def penalty_counting_the_scored_token(penalty: float, dtype: str = "float32"):
    """A `rescored` score: the logprobs an engine returns when its logprob path runs
    transformers' repetition penalty (prompt and output) over a history that already holds
    the token being scored (the output appended before the processors ran): an off-by-one
    processor. The penalty is transformers' own, applied one row at a time in float64 on the
    model's logits (in ``dtype``'s forward)."""
    return repetition_penalty(penalty, dtype, counting_the_scored_token=True)


def repetition_penalty(penalty: float, dtype: str = "float32", counting_the_scored_token=False):
    """A score: transformers' repetition penalty over the prompt and the output before each
    token (with ``counting_the_scored_token``, the token itself too), applied one row at a
    time in float64 on the model's logits (in ``dtype``'s forward): a trainer or an engine's
    logprob path that penalises as its sampler does."""
    extra = 1 if counting_the_scored_token else 0

    def score(model, prompt, completion):
        import torch
        from transformers import RepetitionPenaltyLogitsProcessor

        ids = np.concatenate([prompt, completion]).astype(np.int64)
        forward = model.to(getattr(torch, dtype))
        logits = forward(torch.as_tensor(ids)[None]).logits[0, len(prompt) - 1 : -1].double()
        processor = RepetitionPenaltyLogitsProcessor(penalty)
        out = []
        for t, token in enumerate(completion):
            through = torch.as_tensor(ids[: len(prompt) + t + extra])[None]
            row = processor(through, logits[t : t + 1].clone())
            out.append(float(row.log_softmax(-1)[0, int(token)]))
        return out

    return score
