"""Realistic faults: the real model re-scores sequences under a real misconfiguration.

Each fault is the bug as an engine would commit it (padding attended, positions restarted,
labels off by one, a prompt with a second BOS, logprobs after top-k renormalisation, weights
one optimiser step away, a head in bf16), run through the model's own forward, so the drift
it plants has exactly the shape the real bug gives. `lpx inject` writes the results into a
fixture or replay; `bench/diagnosis.py` builds its confusion matrix from them.

Batch-composition faults (padding, packing) act on micro-batches of the chosen sequences in
table order, as a replay engine's micro-batches would: a sequence as long as the longest in
its micro-batch gets no padding and stays clean, as it would in the real bug.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from pipeline.faults.processing import Processing, apply, model_cap


class Fault(NamedTuple):
    cause: str | None  # what the diagnosis should name
    bug: str  # the real bug it stands for
    commit: Callable  # (model, pairs, settings) -> each pair's completion logprobs under it


FAULTS: dict[str, Fault] = {}  # kind -> its Fault, in the order the zoo plants them


def register(kind: str, cause: str | None, bug: str, commit: Callable) -> None:
    """A fault kind: `lpx inject`, the zoo and the verifier's re-scoring find it here. A new
    kind is its commit function and this call, nothing else."""
    FAULTS[kind] = Fault(cause, bug, commit)


@dataclass(frozen=True)
class FaultSettings:
    micro_batch: int = 8  # padding and packing faults act within micro-batches of this size
    temperature: float = 0.7
    top_k: int = 8
    top_p: float = 0.8
    at: int = 8  # version_change, position_ids: the completion index where the fault starts
    keep_prompt: float = 0.75  # prompt_truncated: prompts cut to this fraction of the longest
    max_prompt: int | None = None  # prompt_truncated: or to this many tokens, when given
    step_lr: float = 1e-4  # stale_weights / version_change: one AdamW step of this size
    position_offset: int = 16
    # position_ids: where >= 0, the offset starts at this prompt index in every sequence
    # (a system prompt's reserved positions counted twice), not at completion index `at`
    prompt_start: int = -1
    bos_id: int = 1
    presence_penalty: float = 0.5  # penalties
    frequency_penalty: float = 0.3
    repetition_penalty: float = 1.3  # repetition_penalty
    soft_cap: float = 5.0  # soft_cap
    min_p: float = 0.1  # min_p
    logit_bias: float = 2.0  # logit_bias: added to the four commonest completion tokens


def rescore(model, pairs: list, kind: str, settings: FaultSettings) -> list[np.ndarray]:
    """Completion logprobs of every (prompt ids, completion ids) pair under fault ``kind``
    (``clean``: no fault, the reference layout)."""
    import torch

    with torch.no_grad():
        if kind == "clean":  # the reference itself, each sequence in its own row
            return [_single(model, p, c) for p, c in pairs]
        if kind not in FAULTS:
            raise ValueError(f"unknown fault kind {kind!r}; known: {', '.join(FAULTS)}")
        return FAULTS[kind].commit(model, pairs, settings)


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
    return _single(model, np.concatenate([[settings.bos_id], prompt]), completion)


def _bos_missing(model, prompt, completion, settings):
    return _single(model, prompt[1:] if prompt[0] == settings.bos_id else prompt, completion)


def _positions_restart(model, prompt, completion, settings):
    positions = np.concatenate([np.arange(len(prompt)), np.arange(len(completion))])
    return _single(model, prompt, completion, positions=positions)


def _positions_offset(model, prompt, completion, settings):
    positions = np.arange(len(prompt) + len(completion))
    # offset from the input that predicts completion token ``at``: its logprob is the first
    # one wrong; or from one prompt index in every sequence
    start = len(prompt) + settings.at - 1
    if settings.prompt_start >= 0:
        start = min(settings.prompt_start, len(prompt))
    positions[start:] += settings.position_offset
    return _single(model, prompt, completion, positions=positions)


def _label_shift(model, prompt, completion, settings):
    return _single(model, prompt, completion, label_shift=True)


def _head_bf16(model, prompt, completion, settings):
    return _single(model, prompt, completion, head_dtype="bfloat16")


def _sampler(*knobs: str) -> Callable:
    """Processed logprobs under the settings' values of a sampler's ``knobs``."""

    def score(model, prompt, completion, settings):
        processing = {knob: getattr(settings, knob) for knob in knobs}
        return _single(model, prompt, completion, processing=processing)

    return score


def _in_micro_batches(kind: str) -> Callable:
    """A batch-composition fault: the sequences in micro-batches of the settings' size, in
    table order, as a replay engine batches them."""

    def commit(model, pairs, settings: FaultSettings):
        results = []
        for start in range(0, len(pairs), settings.micro_batch):
            results += _batched(model, pairs[start : start + settings.micro_batch], kind)
        return results

    return commit


def _in_precision(name: str) -> Callable:
    """The whole forward in a lower precision."""

    def commit(model, pairs, settings: FaultSettings):
        import torch

        low = copy.deepcopy(model).to(getattr(torch, name))
        return [_single(low, p, c) for p, c in pairs]

    return commit


def _processed(kind: str) -> Callable:
    """A logits-processing fault: one processing for the batch (one request's sampling)."""

    def commit(model, pairs, settings: FaultSettings):
        processing = processing_fault(kind, settings, pairs, model)
        return [_single(model, p, c, processing=processing) for p, c in pairs]

    return commit


def _prompt_truncated(model, pairs, settings: FaultSettings):
    """A max prompt length: only longer prompts are cut, from the left."""
    limit = settings.max_prompt or max(1, int(max(len(p) for p, _ in pairs) * settings.keep_prompt))
    return [_single(model, np.asarray(p)[-limit:], c) for p, c in pairs]


def _weights(kind: str) -> Callable:
    def commit(model, pairs, settings: FaultSettings):
        return _other_weights(model, pairs, kind, settings)

    return commit


def _single(
    model, prompt, completion, positions=None, label_shift=False, head_dtype=None, processing=None
):
    """One sequence in its own row, no padding: the reference layout, with one thing changed."""

    hidden = _completion_hidden(model, prompt, completion, positions, label_shift)
    return _selected(model, hidden, completion, head_dtype, processing, prompt)


def completion_logits(model, prompt, completion, capped: bool = True, at=None):
    """The fp32 logits that score each completion token in the reference layout: what a
    temperature or truncation acts on, so a search over those needs one forward only.
    ``capped``: after the model's own final-logit soft-cap (as its forward gives them), else
    the head's (what `processing.apply` takes). ``at``: only these completion indices go
    through the head (a long completion's full logits do not fit at a large vocabulary)."""
    import torch

    with torch.no_grad():
        hidden = _completion_hidden(model, np.asarray(prompt, dtype=np.int64), completion)
        if at is not None:
            hidden = hidden[torch.as_tensor(np.asarray(at, dtype=np.int64), device=hidden.device)]
        logits = model.get_output_embeddings()(hidden).float()
        cap = model_cap(model) if capped else 0.0
        return cap * torch.tanh(logits / cap) if cap else logits


def select_processed(logits, completion, processing=None) -> np.ndarray:
    """Each completion token's logprob under ``logits`` after optional sampling processing."""
    import torch

    from pipeline.engines.hf.model import process_logits

    if processing:
        logits = process_logits(logits, **processing)
    targets = torch.as_tensor(np.asarray(completion, dtype=np.int64), device=logits.device)
    selected = logits.log_softmax(-1).gather(-1, targets[:, None])[:, 0]
    return selected.cpu().numpy().astype(np.float32)


def _completion_hidden(model, prompt, completion, positions=None, label_shift=False):
    import torch

    ids = np.concatenate([prompt, completion]).astype(np.int64)
    inputs = {"input_ids": torch.from_numpy(ids)[None]}
    if positions is not None:
        inputs["position_ids"] = torch.as_tensor(positions, dtype=torch.long)[None]
    # The hidden state at t predicts token t + 1; label_shift reads the one at t instead.
    columns = np.arange(len(prompt) - 1, len(ids) - 1) + (1 if label_shift else 0)
    hidden = model.base_model(**_on_device(model, inputs)).last_hidden_state[0]
    return hidden[torch.from_numpy(columns).to(hidden.device)]


def _batched(model, batch, kind: str):
    """Left-padded (or packed) micro-batch, scored the way the buggy engine scores it."""
    import torch

    sequences = [np.concatenate([p, c]).astype(np.int64) for p, c in batch]
    if kind == "packed_no_reset":
        # One row, positions running on across segments: with no reset, a varlen kernel
        # sees one long sequence, so every segment attends to the ones before it.
        row = torch.from_numpy(np.concatenate(sequences))[None]
        hidden = model.base_model(**_on_device(model, {"input_ids": row})).last_hidden_state[0]
        starts = np.cumsum([0] + [len(s) for s in sequences[:-1]])
        return [
            _selected(model, hidden[start + len(p) - 1 : start + len(p) + len(c) - 1], c)
            for (p, c), start in zip(batch, starts, strict=True)
        ]
    width = max(len(s) for s in sequences)
    pad_id = model.config.pad_token_id or 0
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    real_positions = torch.zeros((len(sequences), width), dtype=torch.long)
    for i, sequence in enumerate(sequences):
        ids[i, width - len(sequence) :] = torch.from_numpy(sequence)
        mask[i, width - len(sequence) :] = 1
        real_positions[i, width - len(sequence) :] = torch.arange(len(sequence))
    counted_positions = torch.arange(width).expand(len(sequences), width)
    if kind == "pad_attended":
        inputs = {"input_ids": ids, "position_ids": real_positions}  # no mask: pads attended
    elif kind == "mask_dropped":
        inputs = {"input_ids": ids, "position_ids": counted_positions}
    else:  # pad_positions
        inputs = {"input_ids": ids, "attention_mask": mask, "position_ids": counted_positions}
    hidden = model.base_model(**_on_device(model, inputs)).last_hidden_state
    results = []
    for i, ((p, c), sequence) in enumerate(zip(batch, sequences, strict=True)):
        first = width - len(sequence) + len(p) - 1
        results.append(_selected(model, hidden[i, first : first + len(c)], c))
    return results


def left_padded(model, prompt, completion, counts: list[int], shifted: bool, pad_id: int):
    """One sequence scored as it would be in left-padded batches with no attention mask: one
    result per pad count in ``counts``. The pads are attended; ``shifted`` counts them in the
    position ids (positions run from the first pad, as without a mask an engine derives them),
    else the real tokens keep positions 0.. (the mask was lost after positions were built).

    Every count is one row of a single forward: each row is padded on the right to the
    widest, and under the causal mask a real token never sees pads that come after it."""
    import torch

    sequence = np.concatenate([prompt, completion]).astype(np.int64)
    width = len(sequence) + max(counts)
    ids = torch.full((len(counts), width), pad_id, dtype=torch.long)
    positions = torch.zeros((len(counts), width), dtype=torch.long)
    for row, count in enumerate(counts):
        ids[row, count : count + len(sequence)] = torch.from_numpy(sequence)
        positions[row] = torch.arange(width) if shifted else (torch.arange(width) - count).clamp(0)
    with torch.no_grad():
        inputs = _on_device(model, {"input_ids": ids, "position_ids": positions})
        hidden = model.base_model(**inputs).last_hidden_state
    return [
        _selected(
            model, hidden[row, count + len(prompt) - 1 : count + len(sequence) - 1], completion
        )
        for row, count in enumerate(counts)
    ]


def offset_positions(model, prompt, completion, shapes: list[tuple[int, int]]):
    """One sequence scored with its position ids offset: one result per (start, offset) in
    ``shapes``, the positions from sequence index ``start`` on moved by ``offset`` (a KV
    cache of the wrong length, a prefix cache that resumed at the wrong place). Every shape
    is one row of a single forward."""
    import torch

    sequence = np.concatenate([prompt, completion]).astype(np.int64)
    ids = torch.from_numpy(sequence)[None].expand(len(shapes), len(sequence))
    positions = torch.arange(len(sequence)).repeat(len(shapes), 1)
    for row, (start, offset) in enumerate(shapes):
        positions[row, start:] += offset
    with torch.no_grad():
        inputs = _on_device(model, {"input_ids": ids, "position_ids": positions})
        hidden = model.base_model(**inputs).last_hidden_state
    return [
        _selected(model, hidden[row, len(prompt) - 1 : len(sequence) - 1], completion)
        for row in range(len(shapes))
    ]


def _other_weights(model, pairs, kind: str, settings: FaultSettings):
    """Scores under the weights one AdamW step away (a step on these very sequences, as the
    trainer would take); version_change switches to them at completion index ``at``."""
    stepped = optimiser_step(model, pairs, settings.step_lr)
    results = []
    for prompt, completion in pairs:
        moved = _single(stepped, prompt, completion)
        if kind != "stale_weights":
            at = min(settings.at, len(completion))
            moved = np.concatenate([_single(model, prompt, completion)[:at], moved[at:]])
        results.append(moved)
    return results


def optimiser_step(model, pairs, lr: float):
    """A copy of ``model`` after one AdamW step on the pairs' next-token loss."""
    import torch

    stepped = copy.deepcopy(model).requires_grad_(True)
    optimiser = torch.optim.AdamW(stepped.parameters(), lr=lr, weight_decay=0.0)
    with torch.enable_grad():
        loss = 0.0
        for prompt, completion in pairs:
            ids = torch.from_numpy(np.concatenate([prompt, completion]).astype(np.int64))[None]
            logits = stepped(**_on_device(stepped, {"input_ids": ids})).logits
            logits = logits[0, len(prompt) - 1 : -1]
            target = torch.as_tensor(np.asarray(completion, dtype=np.int64), device=logits.device)
            loss = loss + torch.nn.functional.cross_entropy(logits.float(), target)
        (loss / len(pairs)).backward()
    optimiser.step()
    return stepped.requires_grad_(False).eval()


def _selected(model, hidden_rows, completion, head_dtype=None, processing=None, prompt=()):
    """The completion tokens' logprobs from the hidden states that score them: the head, the
    model's own soft-cap, then ``processing`` (a sampler's dict, or a `Processing`)."""
    import torch

    head = model.get_output_embeddings()
    if head_dtype == "bfloat16":
        logits = torch.nn.functional.linear(
            hidden_rows.to(torch.bfloat16), head.weight.to(torch.bfloat16)
        ).float()
    else:
        logits = head(hidden_rows).float()
    if isinstance(processing, Processing):
        logits = apply(logits, prompt, completion, processing, model_cap(model))
        return select_processed(logits, completion)
    cap = model_cap(model)
    if cap:
        logits = cap * torch.tanh(logits / cap)
    return select_processed(logits, completion, processing)


def _on_device(model, inputs: dict) -> dict:
    """The inputs on the device the model computes on (a GPU when inject runs there)."""
    from pipeline.engines.hf.model import model_device

    device = model_device(model)
    return {name: tensor.to(device) for name, tensor in inputs.items()}


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
