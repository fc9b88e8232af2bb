"""The zoo: every fault kind, the cause the diagnosis should name, the real bug it stands for
and how it is committed, registered in the order the zoo plants them.

Each fault is the bug as an engine would commit it (padding attended, positions restarted,
labels off by one, a prompt with a second BOS, logprobs after top-k renormalisation, weights
one optimiser step away, a head in bf16). `lpx inject` writes the results into a fixture or
replay; `bench/diagnosis.py` builds its confusion matrix from them.

Batch-composition faults (padding, packing) act on micro-batches of the chosen sequences in
table order, as a replay engine's micro-batches would: a sequence as long as the longest in
its micro-batch gets no padding and stays clean, as it would in the real bug.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import numpy as np

from pipeline.faults.forward import optimiser_step, score_micro_batch, score_sequence
from pipeline.faults.processing import Processing, model_cap
from pipeline.faults.registry import FaultSettings, register

PROCESSING_FAULTS = (
    "penalties",
    "repetition_penalty",
    "soft_cap",
    "min_p",
    "logit_bias",
    "generation_defaults",
)
# Qwen3's generation_config.json (thinking mode): what vLLM and SGLang apply by default
QWEN3_DEFAULTS = {"temperature": 0.6, "top_k": 20, "top_p": 0.95}


def processing_fault(kind: str, settings: FaultSettings, pairs, model) -> Processing:
    """The processing a logits-processing fault commits (one per batch, as an engine's
    sampling parameters are one per request)."""
    if kind == "penalties":
        return Processing(
            presence_penalty=settings.presence_penalty,
            frequency_penalty=settings.frequency_penalty,
        )
    if kind == "repetition_penalty":
        return Processing(
            repetition_penalty=settings.repetition_penalty, penalty_scope="prompt+output"
        )
    if kind == "soft_cap":  # an extra cap, or the model's own one skipped
        return Processing(soft_cap=0.0 if model_cap(model) else settings.soft_cap)
    if kind == "min_p":
        return Processing(min_p=settings.min_p)
    if kind == "logit_bias":
        tokens = np.concatenate([np.asarray(c) for _, c in pairs]).astype(np.int64)
        commonest = np.argsort(-np.bincount(tokens), kind="stable")[:4]
        return Processing(logit_bias=tuple((int(t), settings.logit_bias) for t in commonest))
    defaults = generation_defaults(model) or QWEN3_DEFAULTS
    return Processing(**{k: v for k, v in defaults.items() if k in QWEN3_DEFAULTS})


def generation_defaults(model) -> dict:
    """The sampling fields the model's generation_config.json sets (what an engine applies
    where a request leaves them unset)."""
    from pipeline.engines.metadata import generation_sampling

    return generation_sampling(getattr(model, "name_or_path", "") or "")


def _each(score: Callable) -> Callable:
    """A fault committed on each sequence alone, in its own row."""

    def commit(model, pairs, settings: FaultSettings):
        return [score(model, np.asarray(p, dtype=np.int64), c, settings) for p, c in pairs]

    return commit


def _bos_extra(model, prompt, completion, settings):
    return score_sequence(model, np.concatenate([[settings.bos_id], prompt]), completion)


def _bos_missing(model, prompt, completion, settings):
    return score_sequence(model, prompt[1:] if prompt[0] == settings.bos_id else prompt, completion)


def _positions_restart(model, prompt, completion, settings):
    positions = np.concatenate([np.arange(len(prompt)), np.arange(len(completion))])
    return score_sequence(model, prompt, completion, positions=positions)


def _positions_offset(model, prompt, completion, settings):
    positions = np.arange(len(prompt) + len(completion))
    # offset from the input that predicts completion token ``at``: its logprob is the first
    # one wrong; or from one prompt index in every sequence
    start = len(prompt) + settings.at - 1
    if settings.prompt_start >= 0:
        start = min(settings.prompt_start, len(prompt))
    positions[start:] += settings.position_offset
    return score_sequence(model, prompt, completion, positions=positions)


def _label_shift(model, prompt, completion, settings):
    return score_sequence(model, prompt, completion, label_shift=True)


def _head_bf16(model, prompt, completion, settings):
    return score_sequence(model, prompt, completion, head_dtype="bfloat16")


def _sampler(*knobs: str) -> Callable:
    """Processed logprobs under the settings' values of a sampler's ``knobs``."""

    def score(model, prompt, completion, settings):
        processing = {knob: getattr(settings, knob) for knob in knobs}
        return score_sequence(model, prompt, completion, processing=processing)

    return score


def _in_micro_batches(kind: str) -> Callable:
    """A batch-composition fault: the sequences in micro-batches of the settings' size, in
    table order, as a replay engine batches them."""

    def commit(model, pairs, settings: FaultSettings):
        results = []
        for start in range(0, len(pairs), settings.micro_batch):
            results += score_micro_batch(model, pairs[start : start + settings.micro_batch], kind)
        return results

    return commit


def _in_precision(name: str) -> Callable:
    """The whole forward in a lower precision."""

    def commit(model, pairs, settings: FaultSettings):
        import torch

        low = copy.deepcopy(model).to(getattr(torch, name))
        return [score_sequence(low, p, c) for p, c in pairs]

    return commit


def _processed(kind: str) -> Callable:
    """A logits-processing fault: one processing for the batch (one request's sampling)."""

    def commit(model, pairs, settings: FaultSettings):
        processing = processing_fault(kind, settings, pairs, model)
        return [score_sequence(model, p, c, processing=processing) for p, c in pairs]

    return commit


def _prompt_truncated(model, pairs, settings: FaultSettings):
    """A max prompt length: only longer prompts are cut, from the left."""
    limit = settings.max_prompt or max(1, int(max(len(p) for p, _ in pairs) * settings.keep_prompt))
    return [score_sequence(model, np.asarray(p)[-limit:], c) for p, c in pairs]


def _weights(kind: str) -> Callable:
    def commit(model, pairs, settings: FaultSettings):
        return _other_weights(model, pairs, kind, settings)

    return commit


def _other_weights(model, pairs, kind: str, settings: FaultSettings):
    """Scores under the weights one AdamW step away (a step on these very sequences, as the
    trainer would take); version_change switches to them at completion index ``at``."""
    stepped = optimiser_step(model, pairs, settings.step_lr)
    results = []
    for prompt, completion in pairs:
        moved = score_sequence(stepped, prompt, completion)
        if kind != "stale_weights":
            at = min(settings.at, len(completion))
            moved = np.concatenate([score_sequence(model, prompt, completion)[:at], moved[at:]])
        results.append(moved)
    return results


# The zoo: each fault kind, the cause the diagnosis should name, the real bug it stands for
# and how it is committed (in the order the zoo plants them).
register(
    "pad_attended",
    "mask_padding",
    "left padding attended: the attention mask was lost after position ids were built",
    _in_micro_batches("pad_attended"),
)
register(
    "mask_dropped",
    "mask_padding",
    "no attention mask on a left-padded batch: pads attended and counted in positions",
    _in_micro_batches("mask_dropped"),
)
register(
    "pad_positions",
    None,
    "pads masked but counted in position ids: a constant offset, invisible to RoPE",
    _in_micro_batches("pad_positions"),
)
register(
    "packed_no_reset",
    "mask_padding",
    "packed sequences whose position ids do not reset: attention crosses the segments",
    _in_micro_batches("packed_no_reset"),
)
register(
    "positions_restart",
    "position_ids",
    "position ids restart at 0 at the completion",
    _each(_positions_restart),
)
register(
    "position_ids",
    "position_ids",
    "position ids offset by +16 from a completion index on (a KV-cache or cache-reuse bug)",
    _each(_positions_offset),
)
register(
    "label_shift",
    "token_shift",
    "labels off by one: logits[t] scored against token t",
    _each(_label_shift),
)
register(
    "bos_extra",
    "prompt_mismatch",
    "a second BOS token before the prompt",
    _each(_bos_extra),
)
register(
    "bos_missing",
    "prompt_mismatch",
    "the prompt's BOS token dropped",
    _each(_bos_missing),
)
register(
    "prompt_truncated",
    "prompt_mismatch",
    "the prompt truncated from the left on one side",
    _prompt_truncated,
)
register(
    "temperature",
    "temperature",
    "processed logprobs at temperature 0.7 on one side",
    _each(_sampler("temperature")),
)
register(
    "top_k",
    "top_k",
    "processed logprobs after top-k truncation on one side",
    _each(_sampler("top_k")),
)
register(
    "top_p",
    "top_p",
    "processed logprobs after top-p truncation on one side",
    _each(_sampler("top_p")),
)
register(
    "top_k_top_p",
    "top_k+top_p",
    "processed logprobs after top-k then top-p on one side",
    _each(_sampler("top_k", "top_p")),
)
register(
    "stale_weights",
    "stale_weights",
    "weights one optimiser step away from the other side",
    _weights("stale_weights"),
)
register(
    "version_change",
    "version_change",
    "an in-flight weight update at token k, weight versions recorded",
    _weights("version_change"),
)
register(
    "version_change_unrecorded",
    "version_change",
    "an in-flight weight update at token k, no weight versions recorded",
    _weights("version_change_unrecorded"),
)
register(
    "penalties",
    "logits_processing",
    "presence 0.5 and frequency 0.3 penalties over the output in the logprobs",
    _processed("penalties"),
)
register(
    "repetition_penalty",
    "logits_processing",
    "a repetition penalty of 1.3 over prompt and output in the logprobs",
    _processed("repetition_penalty"),
)
register(
    "soft_cap",
    "logits_processing",
    "a final-logit soft-cap the other side does not apply",
    _processed("soft_cap"),
)
register(
    "min_p",
    "logits_processing",
    "processed logprobs after min-p 0.1 on one side",
    _processed("min_p"),
)
register(
    "logit_bias",
    "logits_processing",
    "a logit bias of +2 on the four commonest tokens",
    _processed("logit_bias"),
)
register(
    "generation_defaults",
    "logits_processing",
    "processed logprobs under the model's generation defaults (Qwen3's: temperature 0.6, "
    "top-k 20, top-p 0.95, where generation_config.json sets none)",
    _processed("generation_defaults"),
)
register(
    "lm_head_bf16",
    "dtype",
    "the LM head computed in bf16, the rest in fp32",
    _each(_head_bf16),
)
register(
    "bf16",
    "dtype",
    "the whole forward in bf16",
    _in_precision("bfloat16"),
)
register(
    "fp16",
    "dtype",
    "the whole forward in fp16",
    _in_precision("float16"),
)
