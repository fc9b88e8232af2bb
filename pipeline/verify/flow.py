"""The diagnosis flow over a comparison's findings: each finding's own hypotheses first;
what fails is ruled out, and what reproduced other findings, the precisions beyond the
declared ones, other published weights, its runner-up and every family's alternatives are
tried on its sequences next. Never worse than the signatures: a cause the signature named
and nothing verified stays that cause, plausible, saying what was tried; only a cause that
verifies replaces it. What nothing reproduces is `unexplained`, listing what was ruled out."""

from __future__ import annotations

import time
from pathlib import Path

from pipeline.contracts.causes import Cause, Severity, Status
from pipeline.contracts.report import Finding
from pipeline.fixture.table import TokenTable
from pipeline.verify import alike, report
from pipeline.verify.families import families, family_of, for_cause, is_data
from pipeline.verify.hypothesis import Candidate
from pipeline.verify.judge import judge
from pipeline.verify.reference import Reference

# Weights causes cannot be re-scored without a store; reproducible causes of the same shape
# are tried instead, and the weights cause stays the signatures' answer when none verifies
COMPETED = (Cause.STALE_WEIGHTS, Cause.VERSION_CHANGE)
NOT_REPRODUCIBLE = {
    Cause.STALE_WEIGHTS: "other weights cannot be re-created from one side's logprobs; give "
    "--weights-store to re-score under the published versions",
    Cause.VERSION_CHANGE: "the weights after the update are not at hand; give --weights-store",
    Cause.CLAIMED_VERSION: "already decided by re-scoring under the store's versions",
    Cause.MISSING_VERSION: "the version is not in the store",
    Cause.TRAJECTORY_TOKENS: "a token gap, verified by re-tokenizing with the model's own "
    "tokenizer (pipeline/trajectory/parting.py), not by re-scoring",
    Cause.TURN_GROWTH: "a shape of the drift over the turns, measured with its error rate "
    "(pipeline/compare/turn_growth.py); the findings on the same tokens are what re-scoring "
    "tests",
}


class Verifier:
    """Re-scores a fixture's sequences under hypothesised bugs and judges each one."""

    def __init__(
        self,
        fixture: TokenTable,
        replay: TokenTable,
        model_dir: Path,
        budget_s: float | None = None,
        **options,
    ):
        """``options`` as `Reference`'s: channel, calibration, device, say, model,
        weights_store. ``budget_s``: no hypothesis is started after this many seconds; what
        was left is listed in `not_tried`, and the findings it would have tested stay as the
        signatures said."""
        self.ref = Reference(fixture, replay, model_dir, **options)
        self.deadline = None if budget_s is None else time.monotonic() + budget_s
        self.not_tried: list[dict] = []

    def _spent(self) -> bool:
        return self.deadline is not None and time.monotonic() >= self.deadline

    def _left(self, finding: Finding, candidates: list[Candidate]) -> None:
        for candidate in candidates:
            self.not_tried.append(
                {
                    "finding": str(finding.cause),
                    "cause": str(candidate.cause),
                    "kind": candidate.kind,
                    "params": {k: v for k, v in candidate.params.items() if _plain(v)},
                }
            )

    @property
    def base(self):
        return self.ref.base

    def verify(self, findings: list[Finding]) -> list[Finding]:
        """The findings with statuses, residuals and floors."""
        ref = self.ref
        ref.drifting = {s for f in findings if f.is_fault for s in f.sequences}
        out: list[Finding] = []
        leftover: list[str] = []
        said: list[str] = []
        ruled_out: list[dict] = []
        reproduced: list[Candidate] = []  # what verified: tried first on the rest
        for finding in findings:
            cause = finding.cause
            if finding.status == Status.RULED_OUT and not finding.is_fault:
                out.append(finding)  # ruled out already (the evidence on file contradicts it)
                continue
            if not finding.sequences or (cause in NOT_REPRODUCIBLE and cause not in COMPETED):
                out.append(finding)
                continue
            own = self.candidates(finding)
            asked: set = set()  # what was judged on this finding, as asked (before a search)
            outcome, tried = self._first_verified(finding, own, asked)
            if outcome is None and self._spent():  # what it did not reach is listed too
                self._left(finding, report.distinct(self._others(finding, reproduced), tried))
                out.append(report.over_budget(finding, tried))
                continue
            if outcome:
                out.append(_finished(ref, report.verified(finding, outcome), outcome))
                reproduced.append(outcome.candidate)
                continue
            if own and not tried:  # nothing could be re-scored: as the signatures said
                out.append(finding)
                continue
            if tried and tried[-1]["params"].get("inconclusive"):
                # consistent with precision, too few tokens to rule out a fault: a claim
                # that stays plausible, worded as one; no other cause to chase in noise
                out.append(report.inconclusive_precision(finding, tried[-1]))
                continue
            runner = (finding.runner_up or {}).get("cause")
            others = self._others(finding, reproduced)
            outcome, also = self._first_verified(finding, report.distinct(others, tried), asked)
            if outcome is None and self._spent():
                out.append(report.over_budget(finding, tried + also))
                continue
            if outcome:
                if tried:
                    out.append(report.ruled_out(finding, tried))
                renamed = report.verified(finding, outcome, renamed_from=cause)
                out.append(_finished(ref, renamed, outcome))
                reproduced.append(outcome.candidate)
                continue
            tried += also
            if cause in COMPETED:  # weights stay the signatures' answer, now with what failed
                out.append(report.not_reproduced(finding, tried))
                continue
            weights = (
                self._untestable(finding, runner) if report.moved_nothing(tried, cause) else None
            )
            if weights is not None:
                # the signature's own bug, committed, left the drift where it was, and the
                # drift has the shape of other weights: that, not the signature, is plausible
                out.append(report.not_reproduced(weights, tried))
                continue
            if cause not in (Cause.UNEXPLAINED, Cause.DTYPE):
                # Never worse than the signatures: a real engine commits a bug in more ways
                # than re-scoring can, so a cause the signature named and nothing verified
                # stays that cause, plausible, with what was tried and how close each came.
                # (Precision is the exception: a drift that fails the precision test is a
                # fault, never "precision".)
                out.append(report.unverified(finding, tried))
                continue
            if cause != Cause.UNEXPLAINED:
                out.append(report.ruled_out(finding, tried))
            untestable = self._untestable(finding, runner)
            if untestable is not None:
                # every reproducible cause failed; weights (which cannot be re-scored without
                # the other weights) remain, and the drift has their shape
                out.append(report.not_reproduced(untestable, tried))
                continue
            leftover += finding.sequences
            if cause == Cause.UNEXPLAINED:  # what the comparison said of it stays said
                said.append(finding.evidence)
            ruled_out += tried
        if leftover:
            out.append(report.unexplained(sorted(set(leftover)), ruled_out, said))
        out = self._fills_the_model_explains(out, reproduced)
        out = [report.only_what_it_moved(f) for f in out]
        merged = report.one_per_reproduction(out)
        for family in families():
            merged = family.merged(merged)
        return merged

    def _others(self, finding: Finding, reproduced: list[Candidate]) -> list[Candidate]:
        """What a finding's drift is tested against once its own cause did not verify: what
        verified on other findings, what explains drift of any shape (a precision below
        the declared ones, other published weights), its runner-up, every other cause."""
        runner = (finding.runner_up or {}).get("cause")
        return [
            *reproduced,
            *(c for family in families() for c in family.any_shape(self.ref, finding)),
            *(self.candidates(finding.but(cause=runner, details={})) if runner else []),
            *self.any_cause(finding),
        ]

    def candidates(self, finding: Finding) -> list[Candidate]:
        """The reproductions a finding's cause and parameters call for."""
        family = for_cause(finding.cause)
        return family.hypotheses(self.ref, finding) if family else []

    def any_cause(self, finding: Finding) -> list[Candidate]:
        """What drift its own cause did not reproduce is tested against: the data bugs first
        (no model), then every family's alternatives in the families' order."""
        offered = [c for family in families() for c in family.alternatives(self.ref, finding)]
        data = [c for c in offered if is_data(c.kind)]
        return [*data, *(c for c in offered if not is_data(c.kind))]

    def _first_verified(self, finding: Finding, candidates: list[Candidate], asked: set):
        """The first candidate that verifies on the finding's sequences, and what was tried
        before it. ``asked`` holds the (kind, parameters) judged on this finding so far: a
        search (top_k_search, logits_processing) is described by what it found, so the same
        search offered again by another family is known by what was asked of it."""
        tried = []
        candidates = [c for c in candidates if report.key_of(c) not in asked]
        for index, candidate in enumerate(candidates):
            if self._spent():
                self._left(finding, candidates[index:])
                break
            asked.add(report.key_of(candidate))
            outcome = judge(self.ref, candidate, finding.sequences)
            if outcome is None:
                continue
            self.ref.say(
                f"verify: {candidate.kind} {candidate.params or ''} on {finding.cause}: "
                f"mean |d| {outcome.before:.3g} -> {outcome.after:.3g} on the {outcome.side} side "
                f"(floor {outcome.floor:.3g}): {'verified' if outcome.verified else 'ruled out'}"
                + (f" on {outcome.screened_on} sequences" if outcome.screened_on else "")
                + f" ({outcome.seconds:.1f} s)"
            )
            if outcome.verified:
                return outcome, tried
            tried.append(report.describe(outcome))
        return None, tried

    def _untestable(self, finding: Finding, runner: str | None) -> Finding | None:
        """After every reproduction failed: the runner-up when it is an in-flight update (a
        position onset's), or what a family says remains plausible without what re-scoring
        would need (`weights_differ` when the drift has a weight step's shape); else
        None."""
        if runner == Cause.VERSION_CHANGE:
            return finding.but(
                cause=Cause.VERSION_CHANGE,
                severity=Severity.FAULT,
                status=Status.PLAUSIBLE,
                evidence=f"{finding.cause} did not reproduce the drift; {runner}, the "
                "runner-up, fits its shape and needs the other weights to re-score "
                "(--weights-store)",
                details={"at": finding.first_position.get("position")},
            )
        for family in families():
            remains = family.untestable(self.ref, finding)
            if remains is not None:
                return remains
        return None

    def _fills_the_model_explains(self, out: list[Finding], reproduced: list[Candidate]):
        """A constant in the logprobs is also what a bug of the model gives: a top-p nucleus
        of one token scores exactly 0. A fill is judged on the median of its tokens, so a
        model reproduction that verifies a fill's sequences on every token, on the same
        side, is the better explanation, and replaces it: what verified elsewhere first,
        then what the families that explain fills offer (a truncation, a sampler's
        processing). Where several verify, `verify/alike.py` chooses among them with what
        the other findings say."""
        models = [c for c in reproduced if not is_data(c.kind)]
        found: dict[int, list] = {}  # per fill finding, the model reproductions that verify
        for index, finding in enumerate(out):
            by = finding.details.get("verified_by") or {}
            if not finding.verified or not is_data(by.get("kind", "")):
                continue
            offered = [
                c
                for family in families()
                if family.explains_fills
                for c in family.alternatives(self.ref, finding)
            ]
            verified = []
            for candidate in report.distinct([*models, *offered], []):
                if self._spent():  # the fill stays verified as the data bug it is
                    self._left(finding, [candidate])
                    continue
                outcome = judge(self.ref, candidate, finding.sequences)
                if outcome is None:
                    continue
                self.ref.say(
                    f"verify: {candidate.kind} {outcome.candidate.params or ''} on the "
                    f"{by['kind']} fill: mean |d| {outcome.before:.3g} -> {outcome.after:.3g} on "
                    f"the {outcome.side} side (floor {outcome.floor:.3g}): "
                    + ("verified" if outcome.verified else "ruled out")
                )
                if outcome.verified and outcome.side == by.get("side"):
                    verified.append(outcome)
            if verified:
                found[index] = verified
        for index, verified in found.items():
            # a min-p and a top-p may both verify where they keep the same tokens on most of
            # these: the one that holds on more tokens, else on more of the batch's findings
            elsewhere = [[o.candidate for o in v] for i, v in found.items() if i != index]
            elsewhere += [[c] for c in models]
            chosen = alike.choose(verified, elsewhere)
            finding = out[index]
            by = finding.details["verified_by"]
            said = finding.details.get("signature_evidence", finding.evidence)
            how = report.params_text(by["params"])
            fill = f"{by['kind']} ({how}) matched the median token only"
            finding = finding.but(evidence=f"{said}; {fill}")
            if len(chosen) == 1:
                out[index] = report.verified(finding, chosen[0])
            else:
                out[index] = report.indistinguishable(finding, chosen)
        return out


def _plain(value) -> bool:
    return isinstance(value, str | int | float | bool) or value is None


def _finished(ref, finding: Finding, outcome) -> Finding:
    """A verified finding as the family of its reproduction completes it."""
    return family_of(outcome.candidate.kind).finished(ref, finding, outcome.candidate)
