"""Realistic faults: the real model re-scores sequences under a real misconfiguration.

- `registry.py`: every fault kind, its settings, and `rescore` (the sequences under one kind);
- `forward.py`: the reference model's forward as the faults commit it, which the verifier's
  families score their hypotheses with;
- `zoo.py`: the kinds themselves, registered in the order the zoo plants them;
- `processing.py`: what an engine does between the logits and the logprobs, as one value;
- `inject.py`: `lpx inject`; `capture.py`: faults committed in a capture adapter, to prove
  localisation on; `releases.py`: faults patched into real engine releases, to prove bisect.
"""

from __future__ import annotations

from pipeline.faults.forward import (
    completion_logits,
    left_padded,
    offset_positions,
    optimiser_step,
    score_micro_batch,
    score_sequence,
    select_processed,
)
from pipeline.faults.registry import FAULTS, Fault, FaultSettings, register, rescore
from pipeline.faults.zoo import (
    PROCESSING_FAULTS,
    QWEN3_DEFAULTS,
    generation_defaults,
    processing_fault,
)

__all__ = [
    "FAULTS",
    "PROCESSING_FAULTS",
    "QWEN3_DEFAULTS",
    "Fault",
    "FaultSettings",
    "completion_logits",
    "generation_defaults",
    "left_padded",
    "offset_positions",
    "optimiser_step",
    "processing_fault",
    "register",
    "rescore",
    "score_micro_batch",
    "score_sequence",
    "select_processed",
]
