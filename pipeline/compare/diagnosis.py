"""Explain drift: name the cause from the whole batch's evidence, never from one sequence.

Every rule reads the per-sequence signatures (``signatures.py``: arrays over all sequences
at once) and claims the drifting sequences its evidence explains, most specific evidence
first:

1. per-sequence data signatures: a logprob shift by one token, a constant fill, labels
   scored off by one, logprobs rounded to a low precision, recorded weight versions;
2. batch-wide sampling processing (temperature, top-k, top-p), from the one-signed or
   linear gap they leave, checked against the rollout's recorded sampling;
3. onsets: drift that starts after clean tokens (positions; a weight update at index k
   when many sequences share the onset);
4. drift from the first token: precision noise (unbiased, at a numeric level), weights
   (the whole batch, biased per sequence), padding or prompt context (only some sequences;
   the rest clean, which rules weights out, since weights are shared by the batch).

Each finding carries a confidence, the first bad position, the runner-up cause and why it
lost; `unexplained` says what was ruled out. Causes follow shared/notes/metrics.md.

The parts: `signatures.py` (per-sequence arrays), `hypotheses/` (the rules: `records.py`
reads the records and data signatures, `shapes.py` the shape of the drift), the `Finding`
of pipeline/contracts/report.py (what a finding holds), and this module, which runs them over one compared region.
"""

from __future__ import annotations

from pipeline.compare.calibrated import TAU_MARGIN
from pipeline.compare.hypotheses import propose
from pipeline.compare.hypotheses.batch import Batch, Context, weights_evidence
from pipeline.compare.signatures import FLOOR, signatures
from pipeline.contracts.causes import FAULT_CAUSES, KNOWN_CAUSES
from pipeline.contracts.report import Finding

__all__ = [
    "FAULT_CAUSES",
    "KNOWN_CAUSES",
    "Context",
    "Finding",
    "diagnose_region",
    "weights_evidence",
]


def diagnose_region(
    train, rollout, offsets, positions, sequence_ids, weight_versions, tau, context
) -> list[Finding]:
    """Findings for one compared region (the completion), from flat arrays."""
    # A calibrated tau is TAU_MARGIN times each token's q999 noise: |d| under q999 is the floor.
    floor = 1.0 / TAU_MARGIN if context.noise_expected is not None else FLOOR
    batch = Batch(
        signatures(train, rollout, offsets, tau, floor),
        list(sequence_ids),
        positions,
        offsets,
        train,
        rollout,
        tau,
        weight_versions,
        context,
    )
    return propose(batch)
