"""What an engine does between the model's logits and the logprobs it returns, as one value:
logit bias, repetition/presence/frequency penalties, the final-logit soft-cap, temperature,
min-p, top-k and top-p, in the order vLLM's and SGLang's samplers apply them (bias and
penalties on the logits, then temperature, then the truncations).

Pure math on fp32 logits: `faults` commits a processing fault with it and the
logits-processing family (`verify/families/processing.py`) searches it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace

import numpy as np

# Which tokens a penalty counts: the output so far (vLLM's and SGLang's presence and
# frequency penalties) or the prompt too (HF's and vLLM's repetition penalty); and, as an
# off-by-one processor counts them, with the token being scored already in its seen set
# ("+scored": the output history appended before the logits are processed, not after) or
# without the last one generated ("-last": a history updated one step late).
BASE_SCOPES = ("output", "prompt+output")
OFF_BY_ONE = {
    "+scored": "the token being scored counted as seen already (an off-by-one processor)",
    "-last": "the last generated token not yet counted (a history one step late)",
}
SCOPES = (*BASE_SCOPES, *(f"{base}{off}" for off in OFF_BY_ONE for base in BASE_SCOPES))
MODEL_CAP = -1.0  # soft_cap: the model's own final-logit soft-cap (its config's), if any


@dataclass(frozen=True)
class Processing:
    temperature: float = 1.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # a seen token's logit divided (>0) or multiplied (<0)
    presence_penalty: float = 0.0  # subtracted once from a seen token's logit
    frequency_penalty: float = 0.0  # subtracted per occurrence
    penalty_scope: str = "output"
    # cap * tanh(logits / cap) on the head's logits; MODEL_CAP: as the model's config says,
    # 0: none (an engine that skips the model's cap)
    soft_cap: float = MODEL_CAP
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) added to the logits

    def changed(self) -> dict:
        """The fields that differ from no processing at all, as plain values."""
        default = Processing()
        out = {}
        for field in fields(self):
            value = getattr(self, field.name)
            if value != getattr(default, field.name):
                out[field.name] = [list(b) for b in value] if field.name == "logit_bias" else value
        if not self.penalises:
            out.pop("penalty_scope", None)
        return out

    @property
    def penalises(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    def but(self, **changes) -> Processing:
        return replace(self, **changes)

    @classmethod
    def from_dict(cls, values: dict) -> Processing:
        known = {f.name for f in fields(cls)}
        kept = {k: v for k, v in values.items() if k in known}
        if "logit_bias" in kept:
            kept["logit_bias"] = tuple((int(t), float(b)) for t, b in kept["logit_bias"])
        return cls(**kept)

    def as_dict(self) -> dict:
        return asdict(self)


def model_cap(model) -> float:
    """The model's final-logit soft-cap (Gemma 2's `final_logit_softcapping`), 0 if none."""
    config = getattr(model, "config", None)
    cap = getattr(config, "final_logit_softcapping", None) or 0.0
    return float(cap)


def apply(logits, prompt, completion, processing: Processing, cap_of_model: float = 0.0):
    """The head's fp32 logits [completion tokens, vocab] (before any soft-cap) after
    ``processing``: row t is what scores completion token t, so the penalties count the
    completion before t (and the prompt, in the prompt+output scope)."""
    history = seen_before(prompt, completion, logits.shape[0], processing.penalty_scope)
    return apply_seen(logits, processing, cap_of_model, history)


def apply_seen(logits, processing: Processing, cap_of_model: float, history=None):
    """`apply` with the penalties' history given: (the tokens seen, their counts before each
    row) in ``processing``'s scope (`seen_before`); rows may come from several sequences."""
    import torch

    from pipeline.engines.hf.model import process_logits

    cap = cap_of_model if processing.soft_cap == MODEL_CAP else processing.soft_cap
    if cap:
        logits = cap * torch.tanh(logits / cap)
    if processing.logit_bias:
        logits = logits.clone()
        for token, bias in processing.logit_bias:
            logits[:, int(token)] += float(bias)
    if processing.penalises:
        logits = _penalised(logits, *history, processing)
    if processing.temperature != 1.0:
        logits = logits / processing.temperature
    if processing.min_p > 0.0:
        probs = logits.softmax(-1)
        floor = processing.min_p * probs.max(-1, keepdim=True).values
        logits = logits.masked_fill(probs < floor, float("-inf"))
    return process_logits(logits, top_k=processing.top_k, top_p=processing.top_p)


def split_scope(scope: str) -> tuple[str, str]:
    """("output" or "prompt+output", "" or an OFF_BY_ONE key)."""
    for off in OFF_BY_ONE:
        if scope.endswith(off):
            return scope[: -len(off)], off
    return scope, ""


def seen_before(prompt, completion, rows: int, scope: str, device=None):
    """(the distinct tokens seen, [rows, seen] counts of each before row t): the output
    before t, and the prompt too in the prompt+output scope; with "+scored", the output
    through t; with "-last", the output before t - 1."""
    import torch

    base, off = split_scope(scope)
    output = torch.as_tensor(np.asarray(completion[:rows], dtype=np.int64), device=device)
    before = (
        torch.as_tensor(np.asarray(prompt, dtype=np.int64), device=device)
        if base == "prompt+output"
        else output[:0]
    )
    seen, inverse = torch.unique(torch.cat([before, output]), return_inverse=True)
    in_prompt, in_output = inverse[: len(before)], inverse[len(before) :]
    step = torch.zeros((rows, len(seen)), dtype=torch.float64, device=device)
    step[torch.arange(rows, device=device), in_output] = 1.0
    counts = step.cumsum(0)  # each row counts the output through it
    if off != "+scored":
        counts = counts - step  # before it
    if off == "-last":
        counts[1:] -= step[:-1]  # before the one before it
    counts += torch.bincount(in_prompt, minlength=len(seen)).to(torch.float64)[None]
    return seen, counts


def stacked(histories: list, widths: list[int], device=None):
    """Several sequences' `seen_before`, their rows stacked: one seen set, counts aligned."""
    import torch

    seen = torch.unique(torch.cat([h[0] for h in histories]))
    counts = torch.zeros((sum(widths), len(seen)), dtype=torch.float64, device=device)
    start = 0
    for (own, own_counts), width in zip(histories, widths, strict=True):
        columns = torch.searchsorted(seen, own)
        counts[start : start + width, columns] = own_counts
        start += width
    return seen, counts


def _penalised(logits, seen, counts, processing: Processing):
    """Penalties on the logits of the tokens seen before each row's token."""
    import torch

    counts = counts.to(logits.dtype)
    sub = logits.index_select(1, seen)
    present = counts > 0
    if processing.repetition_penalty != 1.0:
        penalty = processing.repetition_penalty
        sub = torch.where(present, torch.where(sub > 0, sub / penalty, sub * penalty), sub)
    # in the logits' dtype: a float times a bool tensor is float32 in torch
    sub = sub - processing.presence_penalty * present.to(sub.dtype)
    sub = sub - processing.frequency_penalty * counts
    return logits.index_copy(1, seen, sub)
