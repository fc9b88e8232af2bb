"""Per-token divergence between two captures of one boundary, and its summaries. Pure numpy.

A continuous boundary's divergence at token t is the relative L2 distance of the two rows,
|a_t - b_t| / max(|a_t|, |b_t|): scale-free, so one rule holds for embeddings of norm 0.02
and logits of norm 100. A discrete one (the chosen experts) diverges where the choices differ.
"""

from __future__ import annotations

import numpy as np

from pipeline.localize.boundaries import DISCRETE, kind_of

# The smallest relative difference each precision can explain: half an ulp at 1.0 (unit
# roundoff). A floor measured as exactly zero (an embedding lookup in fp32 against fp64) is
# raised to this, so one rounding is never called a divergence.
UNIT_ROUNDOFF = {"float64": 2.0**-53, "float32": 2.0**-24, "bfloat16": 2.0**-8, "float16": 2.0**-11}


def token_divergence(name: str, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """One number per token position for boundary `name` ([T] float64)."""
    if a.shape != b.shape:
        raise ValueError(f"{name}: shapes differ ({a.shape} vs {b.shape})")
    if kind_of(name) in DISCRETE:
        return np.any(np.sort(a, axis=-1) != np.sort(b, axis=-1), axis=-1).astype(np.float64)
    a = a.reshape(a.shape[0], -1).astype(np.float64)
    b = b.reshape(b.shape[0], -1).astype(np.float64)
    scale = np.maximum(np.linalg.norm(a, axis=1), np.linalg.norm(b, axis=1))
    distance = np.linalg.norm(a - b, axis=1)
    return np.divide(distance, scale, out=np.zeros_like(distance), where=scale > 0)


class Summary:
    """Running max, sum of squares, sum and count of per-token divergences at one boundary,
    fed sequence by sequence so no capture is held whole."""

    __slots__ = ("count", "max", "sum", "sum_squares", "worst")

    def __init__(self) -> None:
        self.count = 0
        self.max = 0.0
        self.sum = 0.0
        self.sum_squares = 0.0
        self.worst: tuple[str, int] | None = None  # (sequence id, position) of the max

    def add(self, sequence_id: str, values: np.ndarray) -> None:
        if values.size == 0:
            return
        top = int(np.argmax(values))
        if self.worst is None or values[top] > self.max:
            self.max = float(values[top])
            self.worst = (sequence_id, top)
        self.count += int(values.size)
        self.sum += float(values.sum())
        self.sum_squares += float(np.square(values).sum())

    @property
    def rms(self) -> float:
        return (self.sum_squares / self.count) ** 0.5 if self.count else 0.0

    @property
    def mean(self) -> float:
        return self.sum / self.count if self.count else 0.0

    def as_dict(self) -> dict:
        out = {"max": self.max, "rms": self.rms, "mean": self.mean, "tokens": self.count}
        if self.worst is not None:
            out["worst"] = {"sequence_id": self.worst[0], "position": self.worst[1]}
        return out
