"""The signature rules in the order they run (the most specific evidence first), and
`propose`: each rule in turn claims the drifting sequences its evidence explains."""

from __future__ import annotations

from pipeline.compare.hypotheses.batch import Batch, unexplained
from pipeline.compare.hypotheses.records import (
    claimed_version_rule,
    constant_fill_rule,
    data_shift_rule,
    fingerprint_rule,
    label_shift_rule,
    precision_rounding_rule,
    weight_version_rule,
)
from pipeline.compare.hypotheses.shapes import (
    from_start_rule,
    onset_rule,
    sampling_rule,
    shared_onset_rule,
)
from pipeline.contracts.report import Finding

RULES = (
    fingerprint_rule,
    data_shift_rule,
    constant_fill_rule,
    label_shift_rule,
    precision_rounding_rule,
    claimed_version_rule,
    weight_version_rule,
    sampling_rule,
    shared_onset_rule,
    onset_rule,
    from_start_rule,
)


def propose(batch: Batch) -> list[Finding]:
    """Every rule in turn over the sequences still unexplained; what none explains is
    `unexplained`, naming what was ruled out."""
    open_ = batch.drifting.copy()
    findings: list[Finding] = []
    for rule in RULES:
        if not open_.any() and rule is not fingerprint_rule:
            continue
        for finding, claimed in rule(batch, open_):
            findings.append(finding)
            open_ &= ~claimed
    if open_.any():
        findings.append(unexplained(batch, open_))
    return findings
