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
    "version_change",
    "claimed_version",
    "missing_version",
)
KNOWN_CAUSES = (*FAULT_CAUSES, "dtype", "unexplained")  # what a policy's fail_on_findings may name


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

    def as_dict(self) -> dict:
        # shallow: dataclasses.asdict deep-copies every sequence id (80 ms on 30k sequences)
        return {f.name: getattr(self, f.name) for f in fields(self)}
