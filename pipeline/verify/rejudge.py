"""compare → verify → re-judge: whether a report's findings need the model, and the report's
findings verified by re-scoring and its verdict judged again."""

from __future__ import annotations

from pathlib import Path

from pipeline.contracts.causes import Cause
from pipeline.contracts.report import Finding, Report
from pipeline.verify.flow import Verifier


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
