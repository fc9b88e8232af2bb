"""The reference model's forward as the faults commit it: one sequence in its own row, a
micro-batch padded or packed the way a buggy engine builds it, the logits that score the
completion, and one optimiser step. The verifier's families score their hypotheses with
these same helpers, so a fault and its re-score compute alike.
"""

from __future__ import annotations

import copy

import numpy as np

from pipeline.faults.processing import Processing, apply, model_cap


def score_sequence(
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


def score_micro_batch(model, batch, kind: str):
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
