"""Weights: the two sides hold different weights. With a weight store, the fixture is
re-scored whole under each published version (newest first). Without one, other weights
cannot be re-created from one side's logprobs: `weights_differ` is what remains when every
data and sampling family was ruled out and the batch's sequences each move their own way
throughout (the per-sequence sign test a weight step passes and noise or a prompt edit
does not)."""

from __future__ import annotations

import numpy as np

from pipeline.contracts.causes import Cause, Severity, Status
from pipeline.contracts.report import Finding
from pipeline.faults import rescore
from pipeline.verify.hypothesis import Candidate, Family

MAX_VERSIONS = 8  # published versions re-scored for a weights finding, newest first
WEIGHT_LIKE_SEQUENCES = 3  # the sign test needs a few sequences to say "weights"
WEIGHT_SIGN_Z = 8.0  # as the signature rule: standard errors above chance
Z2_CAP = 100.0  # one sequence's z^2 counts at most this much toward the batch's mean


class Weights(Family):
    name = "weights"
    causes = (Cause.STALE_WEIGHTS,)
    kinds = ("store_version",)

    def hypotheses(self, ref, finding: Finding) -> list[Candidate]:
        return [
            Candidate(finding.cause, "store_version", ref.base, {"version": name})
            for name in published(ref)
        ]

    def any_shape(self, ref, finding: Finding) -> list[Candidate]:
        # other weights explain any drift when the store holds them
        return self.hypotheses(ref, finding.but(cause=Cause.STALE_WEIGHTS))

    def untestable(self, ref, finding: Finding) -> Finding | None:
        return weights_differ(ref, finding)

    def commit(self, ref, candidate, rows):
        return scored_under(ref, candidate.params["version"], rows)


def published(ref) -> list[str]:
    """The store's versions, newest first, at most MAX_VERSIONS (none without a store)."""
    if ref.weights_store is None:
        return []
    from pipeline.weights.store import list_versions

    return [v["name"] for v in reversed(list_versions(ref.weights_store))][:MAX_VERSIONS]


def scored_under(ref, name: str, rows: list[int]) -> list[np.ndarray]:
    """The rows re-scored under a published version (one version in memory at a time)."""
    if ref.version_model[0] != name:
        from pipeline.engines.hf.model import load_model
        from pipeline.weights.store import materialize

        ref.version_model = (None, None)
        path = materialize(ref.weights_store, name)
        ref.version_model = (name, load_model(path, "float32", device=ref.device))
    values = rescore(ref.version_model[1], ref.pairs(rows), "clean", ref.base)
    return ref.compared(values, rows)


def weights_differ(ref, finding: Finding) -> Finding | None:
    """After every reproduction failed: `weights_differ` when the drift covers the batch
    and moves whole sequences one way; else None."""
    rows = ref.comparable(finding.sequences)
    # weights move the batch: most sequences past the floor (a small step hides in some
    # under noise), and the sign test over every sequence, drifting or not
    if len(rows) < max(WEIGHT_LIKE_SEQUENCES, 0.5 * ref.fixture.num_sequences):
        return None
    rollout, replay, _ = ref.observed(ref.comparable(ref.fixture.sequence_ids))
    z2 = np.array([sign_z(r, p) ** 2 for r, p in zip(rollout, replay, strict=True)])
    needed = 1.0 + WEIGHT_SIGN_Z * np.sqrt(2.0 / len(z2))
    mean = float(np.minimum(z2, Z2_CAP).mean())
    if mean <= needed:
        return None
    return finding.but(
        cause=Cause.WEIGHTS_DIFFER,
        severity=Severity.FAULT,
        status=Status.PLAUSIBLE,
        evidence=f"no reproducible cause reproduces the drift of these {len(rows)} "
        f"sequences, and the batch's {len(z2)} sequences each move their own way "
        f"throughout (sign test: mean z^2 {mean:.2f} > {needed:.2f}), as a weight step "
        "does: the two sides likely hold different weights (give --weights-store to "
        "re-score under the published versions)",
    )


def sign_z(rollout: np.ndarray, replay: np.ndarray) -> float:
    """A sequence's direction: (tokens up - tokens down) / sqrt(tokens)."""
    d = np.asarray(replay) - np.asarray(rollout)
    d = d[np.isfinite(d) & (d != 0)]
    return float(np.sum(np.sign(d)) / np.sqrt(len(d))) if len(d) else 0.0
