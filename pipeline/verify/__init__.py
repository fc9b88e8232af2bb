"""Verify a comparison's findings by reproducing them with the model.

A finding is a hypothesis the signatures propose: a cause, its parameters (a temperature,
an onset, a shift, a truncation length) and the sequences it explains. Verification commits
that bug in the reference model, in fp32, and asks whether one side now matches the
re-score down to the noise floor, the mean |d| this model's precision alone gives those
tokens (`lpx calibrate`; without one, the profile's constant floor). Then the finding is
`verified`, and the side that committed the bug is named.

The package reads top to bottom:
- `hypothesis.py`: a hypothesis, its outcome, the family interface and the margins;
- `families/`: one module per family of bugs (its parameter space, how to commit it in the
  reference model, what it offers for drift no signature explained);
- `reference.py`: the model, the observations, the noise floors and the shared re-score;
- `search.py`: the shared search over a family's free parameters;
- `judge.py`: one hypothesis re-scored and judged; `report.py`: the shared outcome format;
- `flow.py`: the order hypotheses are tried in, and what a finding becomes.

A flow beside inject and faults: it calls an engine and hands compare/ back findings;
compare/ never runs a model.
"""

from __future__ import annotations

from pathlib import Path

from pipeline.contracts.causes import Cause
from pipeline.contracts.report import Finding, Report
from pipeline.verify.families.shifts import shift_onset
from pipeline.verify.flow import Verifier

__all__ = ["Verifier", "needs_verifying", "shift_onset", "verify_report"]


def needs_verifying(findings: list[Finding]) -> bool:
    """Whether any finding is a fault, unexplained drift or a precision claim a re-score
    could decide."""
    return any(f.is_fault or (f.cause == Cause.DTYPE and f.sequences) for f in findings)


def verify_report(
    report: Report, fixture, replay, model_dir: Path, policy=None, **options
) -> dict | None:
    """compare → verify → re-judge: the report's findings verified by re-scoring with the
    model in ``model_dir`` (options as `Verifier`'s, ``budget_s`` included), and its verdict
    judged again by the policy (the default one when none is given). What verification adds
    to report.json's `verification` note (the budget and what it left untried, where one was
    given); None, and the report untouched, where no finding needs it."""
    from pipeline.compare.contradicted import evidence_on_file, rule_out_contradicted
    from pipeline.compare.policy import load_policy
    from pipeline.compare.run import rejudge

    if not needs_verifying(report.diagnosis):
        return None
    verifier = Verifier(fixture, replay, model_dir, **options)
    verified = verifier.verify(report.diagnosis)
    # what verification left plausible is set against the evidence on file again
    report.diagnosis = rule_out_contradicted(verified, evidence_on_file(fixture, replay))
    rejudge(report, policy if policy is not None else load_policy())
    if options.get("budget_s") is None:
        return {}
    return {
        "budget_s": options["budget_s"],
        "out_of_budget": bool(verifier.not_tried),
        "not_tried": verifier.not_tried,
    }
