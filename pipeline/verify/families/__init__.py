"""The hypothesis families, in the order their alternatives are tried on drift no signature
explained: the sampler's (truncation, temperature, the rollout's whole processing) and
routing first, then what edits the input, what moves positions, labels or padding, then
how the model config was read (a window, RoPE, eps, soft-caps, a tied head), then
precisions and numerics other than declared (a plain dtype first: its finding is never taken
away by a format), and other weights last (they explain any drift, so every cheaper reading
goes first). Data bugs
(no model) are tried before all of them by the flow.

The sampler's families re-process one forward's head logits; the input and position
families re-score the sequences under each setting they search (a position offset search
is tens of forwards at 16 x 1024), so a processing the signatures took for a truncation
is reached first (min-p at 16 x 1024: 177 s before, with 100 s of position and padding
searches ahead of it)."""

from __future__ import annotations

from pipeline.verify.families.registry import (
    families,
    family_of,
    for_cause,
    is_data,
    register,
    unregister,
)

# FAMILIES itself is not handed on: `register` rebinds it, so a copy here would go stale;
# `families()` is always the current order.
__all__ = ["families", "family_of", "for_cause", "is_data", "register", "unregister"]
