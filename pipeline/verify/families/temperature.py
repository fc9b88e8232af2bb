"""Temperature: one side's logprobs of logits divided by T. The signatures' linear fit is an
estimate; the reproduction must hold to the noise floor, so T is searched (golden section
on log T around the estimate, moved on while the minimum lands at the bracket's edge, each
try re-processing one forward's logits)."""

from __future__ import annotations

import numpy as np

from pipeline.contracts.causes import Cause
from pipeline.contracts.report import Finding
from pipeline.verify.hypothesis import Candidate, Family
from pipeline.verify.search import Processed, golden_section, with_settings

LOG_SPAN = 0.7  # log T searched this far either side of the estimate (T x/÷ 2)
EDGE = 0.95  # a minimum this close to the bracket's edge may lie beyond it
MAX_SHIFTS = 3  # brackets moved on from one that ended at its edge (T x/÷ 2 each)


class Temperature(Family):
    name = "temperature"
    causes = (Cause.TEMPERATURE,)
    kinds = ("temperature",)

    def hypotheses(self, ref, finding: Finding) -> list[Candidate]:
        fit = finding.details.get("temperature_fit") or {}
        sampling = ref.fixture.metadata.get("sampling") or {}
        t = fit.get("estimated_temperature") or sampling.get("temperature")
        if not t or float(t) == 1.0:
            return []
        return [_at(ref.base, float(t))]

    def alternatives(self, ref, finding: Finding) -> list[Candidate]:
        return [Candidate(Cause.TEMPERATURE, "temperature", ref.base, {})]  # T from the drift

    def search(self, ref, candidate, rows, observed, clean, side) -> Candidate:
        given = candidate.params.get("T")
        guess = (
            float(given)
            if given and float(given) != 1.0
            else slope_temperature(observed[0], clean[0])
        )
        processed = Processed(ref, rows[0], observed[0])
        center = np.log(guess)
        for _ in range(1 + MAX_SHIFTS):
            log_t = golden_section(
                lambda x: processed.gap({"temperature": float(np.exp(x))}),
                center - LOG_SPAN,
                center + LOG_SPAN,
            )
            if abs(log_t - center) < EDGE * LOG_SPAN:
                break
            # the minimum lies at the bracket's edge, so past it: search on around there (a
            # slope estimate off by more than x/÷ 2, as a sampled token's logprob gives when
            # its own log-partition moves with T)
            center = log_t
        t = float(np.exp(log_t))
        return with_settings(candidate, {"T": round(t, 5)}, temperature=t)

    def finished(self, ref, finding: Finding, candidate: Candidate) -> Finding:
        from pipeline.verify.families.processing import raw_where_processed_declared

        side = (finding.details.get("verified_by") or {}).get("side", "")
        raw = raw_where_processed_declared(ref, side)
        return finding.but(evidence=f"{finding.evidence}; {raw}") if raw else finding


def _at(base, t: float) -> Candidate:
    return with_settings(
        Candidate(Cause.TEMPERATURE, "temperature", base, {}), {"T": round(t, 4)}, temperature=t
    )


def slope_temperature(processed, raw) -> float:
    """T from the slope of the processed logprobs on the raw ones (processed = raw / T + c)."""
    x, y = np.asarray(raw, dtype=np.float64), np.asarray(processed, dtype=np.float64)
    keep = np.isfinite(x) & np.isfinite(y)
    if keep.sum() < 3 or x[keep].var() <= 0:
        return 1.0
    slope = np.cov(x[keep], y[keep])[0, 1] / x[keep].var()
    return float(1.0 / slope) if 0.2 <= slope <= 5.0 else 1.0
