"""What a diagnosis says: the causes it can name and one finding per cause it names."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

FAULT_CAUSES = (
    "token_shift",
    "mask_padding",
    "position_ids",
    "prompt_mismatch",
    "temperature",
    "top_k",
    "top_p",
    "stale_weights",
    "weights_differ",  # no store to re-score under: every data and sampling cause ruled out
    "version_change",
    "claimed_version",
    "missing_version",
    "routing_flip",
)
KNOWN_CAUSES = (*FAULT_CAUSES, "dtype", "unexplained")  # what a policy's fail_on_findings may name
STATUSES = ("verified", "plausible", "ruled_out")


@dataclass
class Finding:
    cause: str
    sequences: list[str]
    first_position: dict
    evidence: str
    severity: str = "fault"
    details: dict = field(default_factory=dict)
    confidence: float = 1.0
    runner_up: dict | None = None  # {"cause", "why_not"}
    # verified: re-scoring with the bug committed reproduced the drift down to the noise
    # floor (or, for precision, the drift is within the calibrated floor); plausible: the
    # signatures fit, nothing re-scored; ruled_out is only ever on what a finding tested.
    status: str = "plausible"
    residual_before: float | None = None  # mean |d| on the finding's tokens
    residual_after: float | None = None  # mean |d| left once the bug is reproduced
    floor: float | None = None  # mean |d| precision alone gives those tokens

    def as_dict(self) -> dict:
        # shallow: dataclasses.asdict deep-copies every sequence id (80 ms on 30k sequences)
        return {f.name: getattr(self, f.name) for f in fields(self)}
