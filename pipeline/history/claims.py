"""What a diagnosis finding claims and how sure lpx is of it: one wording for every page and
command that shows a finding (run, index and series pages, `lpx history`, `lpx gate`).

A finding's ``status`` (pipeline/contracts/causes.py) says how far it was checked:
``verified`` (re-scoring with the bug committed in the reference model reproduced the
drift), ``plausible`` (the drift's signatures fit; nothing reproduced it) or ``ruled_out``
(re-scoring did not reproduce it). The cause ``unexplained`` is a status of its own: no
cause explains the drift. A report written before findings carried a status was never
re-scored, and a status this lpx does not know proves nothing, so both read as plausible:
a cause is never shown as established unless the report says it was verified.

Pure: dicts in, small frozen objects and strings out; no database, no engine.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from pipeline.contracts.causes import Cause, Status

# a finding's status, and the cause that is a status of its own (no cause explains it)
VERIFIED, PLAUSIBLE, RULED_OUT = Status.VERIFIED, Status.PLAUSIBLE, Status.RULED_OUT
UNEXPLAINED = Cause.UNEXPLAINED
STATUSES = (VERIFIED, PLAUSIBLE, UNEXPLAINED, RULED_OUT)
LABELS = {
    VERIFIED: "verified",
    PLAUSIBLE: "plausible",
    UNEXPLAINED: "unexplained",
    RULED_OUT: "ruled out",
}
MEANINGS = {
    VERIFIED: "Verified: lpx re-scored these sequences with this cause committed in the "
    "reference model, and that reproduced the drift down to the noise floor.",
    PLAUSIBLE: "Plausible: the drift's signatures fit this cause, but no re-scoring "
    "reproduced it. It is a guess, not an established cause.",
    UNEXPLAINED: "Unexplained: no cause lpx knows explains this drift.",
    RULED_OUT: "Ruled out: re-scoring with this cause committed did not reproduce the drift, "
    "so it is not the cause.",
}
# How to turn a plausible claim into a verified or ruled-out one. The causes named here are
# the ones a plain re-score of the fixture's model cannot decide (pipeline/verify/flow.py's
# NOT_REPRODUCIBLE; history/ may not import it, so the advice is kept here).
RESCORING = (
    "`lpx compare` re-scores by default when the fixture's model is on this machine with the "
    "fixture's weights (unless --no-verify); otherwise give the model with `lpx compare "
    "FIXTURE REPLAY --model DIR` or `lpx diagnose FIXTURE REPLAY --model DIR`."
)
VERIFY_BY_DEFAULT = f"To verify it, re-score: {RESCORING}"
VERIFY_WEIGHTS = (
    "Other weights cannot be re-created from logprobs: to verify it, re-score under the "
    "versions the trainer published with `lpx compare FIXTURE REPLAY --model DIR "
    "--weights-store STORE` (or `lpx diagnose`)."
)
HOW_TO_VERIFY = {
    Cause.STALE_WEIGHTS: VERIFY_WEIGHTS,
    Cause.WEIGHTS_DIFFER: VERIFY_WEIGHTS,
    Cause.VERSION_CHANGE: VERIFY_WEIGHTS,
    Cause.MISSING_VERSION: "Publish the missing versions to the store (or retain more: "
    "`lpx weights publish --keep`) and compare again.",
    Cause.ROUTING_FLIP: "Re-scoring forces the drifting side's recorded experts, so both the "
    f"fixture and the replay must carry routed experts (docs/routing.md). {RESCORING}",
    Cause.CLAIMED_VERSION: "Read from the versions the tokens claim, re-scored under the store's "
    "versions; compare again with `--weights-store STORE` to re-check it.",
}


@dataclass(frozen=True, slots=True)
class Claim:
    """One finding as shown: its cause, its status and whether re-scoring was tried on it."""

    cause: str
    status: str  # one of STATUSES
    severity: str  # fault | info; a ruled-out finding is never a fault
    rescored: bool  # re-scoring was tried (what it gave is in the finding's evidence)

    @property
    def label(self) -> str:
        """The status in words: "verified", "plausible", "unexplained", "ruled out"."""
        return LABELS[self.status]

    @property
    def short(self) -> str:
        """`stale_weights (plausible)`: a cause never printed without its status."""
        return short_text({"cause": self.cause, "status": self.status})

    @property
    def headline(self) -> str:
        """The claim as a sentence's subject: a guess is worded as a guess."""
        if self.status == VERIFIED:
            return f"{self.cause}, verified by re-scoring"
        if self.status == RULED_OUT:
            return f"ruled out by re-scoring: {self.cause}"
        if self.status == UNEXPLAINED:
            if self.rescored:
                return "unexplained: no re-scored cause reproduces this drift"
            return "unexplained: no known cause's signature fits this drift"
        if self.rescored:
            return f"plausible, not reproduced by re-scoring: {self.cause}"
        return f"plausible, not reproduced: {self.cause}"

    @property
    def next_step(self) -> str:
        """What would settle a claim that is not settled (plausible, unexplained); else ""."""
        if self.status == PLAUSIBLE:
            if self.rescored and self.cause not in HOW_TO_VERIFY:
                return (
                    "Re-scoring was tried and reproduced nothing it could test (see the "
                    "evidence): the signatures' guess stands, unconfirmed."
                )
            return HOW_TO_VERIFY.get(self.cause, VERIFY_BY_DEFAULT)
        if self.status == UNEXPLAINED:
            if self.rescored:
                return "Inspect the worst tokens and the drift heatmap."
            return f"Re-scoring may still name a cause: {RESCORING}"
        return ""

    @property
    def meaning(self) -> str:
        """What the status means and, where unsettled, how to settle it (a tooltip)."""
        return f"{MEANINGS[self.status]} {self.next_step}".strip()

    def as_dict(self) -> dict:
        """The claim in JSON output (`lpx history --json`)."""
        return {
            "cause": self.cause,
            "status": self.status,
            "severity": self.severity,
            "claim": self.headline,
        }


def claim_of(finding: dict) -> Claim:
    """A report.json diagnosis entry (or the history's stored copy of one) as a claim."""
    cause = str(finding.get("cause", "?"))
    status = finding.get("status")
    if cause == UNEXPLAINED:
        status = UNEXPLAINED
    elif status not in (VERIFIED, RULED_OUT):
        status = PLAUSIBLE  # missing (an older report) or unknown: proves nothing
    severity = "info" if status == RULED_OUT else str(finding.get("severity") or "fault")
    details = finding.get("details")
    rescored = finding.get("residual_after") is not None or (
        isinstance(details, dict) and bool(details.get("ruled_out"))
    )
    return Claim(cause, status, severity, rescored)


def claims_of(findings: Iterable | None) -> list[Claim]:
    """Every well-formed finding of a diagnosis as a claim, in the report's order."""
    return [claim_of(f) for f in findings or () if isinstance(f, dict)]


def failing_claims(failing: Iterable[str], findings: Iterable | None) -> list[str]:
    """The causes a policy failed on (`policy.failing_findings`), each with its status:
    `stale_weights (plausible)`. A cause held with several statuses is listed once per
    status, its faults first (the policy fails on faults); one the diagnosis does not hold
    at all proves nothing (plausible)."""
    claims = claims_of(findings)
    out: list[str] = []
    for cause in dict.fromkeys(failing or ()):
        held = [claim for claim in claims if claim.cause == cause]
        chosen = [claim for claim in held if claim.severity == "fault"] or held
        chosen = chosen or [Claim(cause, PLAUSIBLE, "fault", False)]
        out += dict.fromkeys(claim.short for claim in chosen)
    return out


def short_text(claim: dict) -> str:
    """`stale_weights (plausible)` from a claim's dict (Claim.as_dict, the JSON outputs)."""
    cause, status = claim["cause"], claim["status"]
    return cause if cause == status else f"{cause} ({LABELS[status]})"


def summary(claims: Iterable[dict]) -> str:
    """`temperature (verified), stale_weights (plausible)` from claims' dicts, for a
    terminal line; "" when there are none."""
    return ", ".join(short_text(claim) for claim in claims)
