"""What /health says about how far a served logprob can move with the other sequences of
its batch: nothing in batch-invariant mode; otherwise the largest deviation from the same
request scored alone that was measured for this engine, dtype and device, or that none was.

The default batches sequences together: the padded width and the number of rows change the
shapes of the matmuls, hence their summation order, so a logprob moves by a few ulps with
the company it keeps. Old-policy logprobs taken from a loaded default server are therefore
not exact, and a client must be able to read so from the server itself.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.devices import device_kind
from pipeline.names import canonical_dtype


@dataclass(frozen=True)
class Measured:
    """A deviation measured by `bench/serve.py --invariance` under concurrent load."""

    max_abs_diff: float  # the largest |served - scored alone| of any completion logprob
    answers: int  # answers compared
    differing: int  # answers not bit-identical to the same request scored alone
    where: str  # the model, load and machine it was measured on


# (engine, dtype, device kind) -> the default mode's measured deviation. Only what was run
# is here; any other combination says that it was not measured. The load: 16 clients for
# 20 s sending 40 requests of 1-4 sequences of 1-64 prompt and completion tokens, a quarter
# asking for prompt logprobs, each answer against the same request sent alone.
ON_THE_TINY_MODEL = "the tiny model (llama 128x2), 2-core CPU, bench/serve.py --invariance"
MEASURED = {
    ("hf", "float32", "cpu"): Measured(9.54e-06, 1346, 971, f"{ON_THE_TINY_MODEL}, seeds 0-4"),
    ("hf", "bfloat16", "cpu"): Measured(0.0758, 5757, 2829, f"{ON_THE_TINY_MODEL}, seeds 0-1"),
    ("fsdp", "float32", "cpu"): Measured(
        5.72e-06, 3312, 2845, f"{ON_THE_TINY_MODEL}, 2 ranks, seed 0"
    ),
    ("megatron", "float32", "cpu"): Measured(
        4.77e-06, 2274, 172, f"{ON_THE_TINY_MODEL}, TP=2 on 2 ranks, seed 0"
    ),
}

INVARIANT = (
    "batch-invariant: each sequence is scored in its own unpadded forward, so its logprobs "
    "are bit-identical to the same request scored alone, whatever else is queued"
)


def logprob_variance(engine: str, dtype: str, device: str, batch_invariant: bool) -> dict:
    """The /health fields: ``batch_invariant``, ``logprob_variance`` (a sentence) and
    ``logprob_variance_max`` (0.0 in batch-invariant mode; the measured deviation, or None
    where none was measured)."""
    if batch_invariant:
        return {"batch_invariant": True, "logprob_variance": INVARIANT, "logprob_variance_max": 0.0}
    where = (engine, canonical_dtype(dtype), device_kind(device))
    measured = MEASURED.get(where)
    if measured is None:
        size = "by an amount not measured for {} {} on {}".format(*where)
    else:
        size = (
            f"by up to {measured.max_abs_diff:.2g} ({measured.differing:,} of "
            f"{measured.answers:,} answers differed, measured on {measured.where})"
        )
    return {
        "batch_invariant": False,
        "logprob_variance": (
            "batch-dependent: a request's logprobs can differ from the same request scored "
            f"alone {size} when it shares a batch; serve with --batch-invariant for "
            "bit-identical answers"
        ),
        "logprob_variance_max": None if measured is None else measured.max_abs_diff,
    }
