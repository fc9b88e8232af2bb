"""The outcome format every family shares: a finding verified (named by the cause its
reproduction stands for), ruled out, kept plausible with what was tried and how close each
try came, or gathered as unexplained; and the merges of findings one reproduction verified."""

from __future__ import annotations

from pipeline.compare.precision_gate import FAULT_SIZE
from pipeline.contracts.causes import Cause, Severity, Status
from pipeline.contracts.report import Finding
from pipeline.verify.families import family_of
from pipeline.verify.hypothesis import Candidate, Outcome

# A reproduction that leaves this much of the drift moved nothing toward the observation.
NOTHING_MOVED = 0.9


def describe(outcome: Outcome) -> dict:
    return {
        "cause": outcome.candidate.cause,
        "kind": outcome.candidate.kind,
        "params": outcome.candidate.params,
        "residual_before": outcome.before,
        "residual_after": outcome.after,
        "floor": outcome.floor,
        "side": outcome.side,
        **({"screened_on": outcome.screened_on} if outcome.screened_on else {}),
    }


def verified(finding: Finding, outcome: Outcome, renamed_from: str | None = None) -> Finding:
    """The finding, verified, named by the cause its reproduction stands for; a renamed one
    says what did not reproduce the drift first."""
    params = outcome.candidate.params
    how = (
        f"re-scored with {outcome.candidate.kind}"
        + (f" ({params_text(params)})" if params else "")
        + f", the {outcome.side} side matches to mean |d| {outcome.after:.3g} (floor "
        f"{outcome.floor:.3g}; the drift was {outcome.before:.3g}): the bug is on the "
        f"{outcome.side} side"
    )
    cause = outcome.candidate.cause
    how, severity = family_of(outcome.candidate.kind).words(outcome, how)
    if renamed_from and renamed_from != cause:
        how = f"{renamed_from} did not reproduce the drift; {how}"
    return finding.but(
        cause=cause,
        evidence=f"{finding.evidence}; {how}",
        severity=severity,
        status=Status.VERIFIED,
        residual_before=outcome.before,
        residual_after=outcome.after,
        floor=outcome.floor,
        details={
            "signature_evidence": finding.evidence,  # kept, should a better one replace it
            **finding.details,
            "verified_by": describe(outcome),
            **(
                {"renamed_from": str(renamed_from)}
                if renamed_from and renamed_from != cause
                else {}
            ),
        },
    )


def only_what_it_moved(finding: Finding) -> Finding:
    """A verified finding names the sequences its bug moved: a searched left padding whose
    count for a sequence is 0 re-scored it as it was (its drift is noise), so it is not
    among them. Sequences the search did not see stay."""
    by = finding.details.get("verified_by") or {}
    counts = (by.get("params") or {}).get("counts")
    if not finding.verified or not isinstance(counts, dict):
        return finding
    kept = [s for s in finding.sequences if counts.get(s, 1) != 0]
    return finding.but(sequences=kept) if kept else finding


def not_reproduced(finding: Finding, tried: list[dict]) -> Finding:
    return finding.but(
        details={**finding.details, "ruled_out": tried},
        evidence=f"{finding.evidence}; re-scoring reproduces none of: "
        + ", ".join(t["kind"] for t in tried),
    )


def moved_nothing(tried: list[dict], cause: str) -> bool:
    """Every re-score of `cause` itself left at least NOTHING_MOVED of the drift: committed,
    the bug does not go the observation's way at all (a wrong guess, not a variant)."""
    own = [t for t in tried if t["cause"] == cause and not family_of(t["kind"]).own_judgement]
    return bool(own) and all(
        t["residual_after"] >= NOTHING_MOVED * t["residual_before"] for t in own
    )


def unverified(finding: Finding, tried: list[dict]) -> Finding:
    """A signature's cause that no reproduction verified: kept, plausible, saying what was
    tried and how close each try came (its residual in floors)."""
    closest = sorted(tried, key=lambda t: t["residual_after"] / max(t["floor"], 1e-12))
    own = [t for t in closest if t["cause"] == finding.cause]
    shown = (own or closest)[:3]
    how = "; ".join(
        f"{_tried_text(t)}, {t['residual_after'] / max(t['floor'], 1e-12):.1f}x the floor"
        for t in shown
    )
    return finding.but(
        status=Status.PLAUSIBLE,
        evidence=f"{finding.evidence}; no reproduction verified it (the engine may commit "
        f"it in a way re-scoring does not), so it stays as its signature named it"
        + (f"; closest tries: {how}" if how else "; nothing could be re-scored"),
        details={**finding.details, "tried": tried},
        **(
            {
                "residual_before": closest[0]["residual_before"],
                "residual_after": closest[0]["residual_after"],
                "floor": closest[0]["floor"],
            }
            if closest
            else {}
        ),
    )


def over_budget(finding: Finding, tried: list[dict]) -> Finding:
    """A finding the verification budget ran out on before a reproduction verified it: as
    its signature said (never worse than the signatures), saying what was tried and that the
    rest was not."""
    return finding.but(
        evidence=f"{finding.evidence}; not verified: the verification budget (--verify-budget) "
        f"ran out after {len(tried)} tries on it; the report's verification.not_tried lists "
        "what was left",
        details={**finding.details, "tried": tried, "over_budget": True},
    )


def key_of(candidate: Candidate) -> tuple[str, str]:
    """A candidate's (kind, parameters), as `distinct` tells candidates apart."""
    return candidate.kind, repr(sorted(candidate.params.items()))


def distinct(candidates: list[Candidate], tried: list[dict]) -> list[Candidate]:
    """Each (kind, parameters) once, leaving out what was already tried."""
    seen = {(t["kind"], repr(sorted(t["params"].items()))) for t in tried}
    out = []
    for candidate in candidates:
        key = key_of(candidate)
        if key not in seen:
            seen.add(key)
            out.append(candidate)
    return out


def ruled_out(finding: Finding, tried: list[dict]) -> Finding:
    best = min(tried, key=lambda t: t["residual_after"])
    return finding.but(
        severity=Severity.INFO,
        status=Status.RULED_OUT,
        residual_before=best["residual_before"],
        residual_after=best["residual_after"],
        floor=best["floor"],
        evidence=(
            f"{finding.evidence}; ruled out by re-scoring: "
            + "; ".join(_tried_text(t) for t in tried)
        ),
        details={**finding.details, "ruled_out": tried},
    )


def inconclusive_precision(finding: Finding, tried: dict) -> Finding:
    params = tried["params"]
    return finding.but(
        status=Status.PLAUSIBLE,
        evidence=(
            f"{finding.evidence}; re-scored in the declared precisions "
            f"({params_text(_declared(params))}) these {params['tokens']} tokens drift by mean |d| "
            f"{tried['residual_after']:.3g} and the observed {tried['residual_before']:.3g} "
            f"passes the precision gate, but so few tokens cannot rule out a fault of "
            f"{FAULT_SIZE:g}x the noise: plausibly precision, not verified (compare more tokens)"
        ),
        details={**finding.details, "precision_check": tried},
        residual_before=tried["residual_before"],
        residual_after=tried["residual_after"],
    )


def _tried_text(tried: dict) -> str:
    """One ruled-out reproduction, in words."""
    params = tried["params"]
    own = family_of(tried["kind"]).tried_words(tried)
    if own is not None:
        return own
    shown = f" ({params_text(params)})" if params else ""
    return (
        f"{tried['kind']}{shown} leaves mean |d| {tried['residual_after']:.3g} "
        f"(floor {tried['floor']:.3g})"
    )


# what a reader can add to tell apart readings that re-scoring could not: said with every
# finding nothing reproduced
TELLS_APART = (
    "What would tell the readings apart: the weights each engine held (--weights-store, or "
    "per-token weight versions from an engine that syncs weights in memory), the model config "
    "each engine resolved (lpx's engines record it; a dump may not), and where the drift "
    "starts (the report's onset: a shared position points at a window, a tile or a chunk)"
)


def unexplained(sequences: list[str], tried: list[dict], said: list[str] = ()) -> Finding:
    names = sorted({f"{t['cause']}/{t['kind']}" for t in tried})
    before = "".join(f"{text}; " for text in said)
    return Finding(
        cause=Cause.UNEXPLAINED,
        sequences=sequences,
        evidence=(
            f"{before}drift in {len(sequences)} sequences that no re-scored hypothesis reproduces; "
            f"ruled out: {', '.join(names) or 'nothing testable'}; inspect the worst tokens. "
            f"{TELLS_APART}"
        ),
        details={"ruled_out": tried},
        confidence=0.0,
        residual_before=min((t["residual_before"] for t in tried), default=None),
        residual_after=min((t["residual_after"] for t in tried), default=None),
        floor=min((t["floor"] for t in tried), default=None),
    )


def _declared(params: dict) -> dict:
    return {side: params[side] for side in ("rollout", "replay") if side in params}


def params_text(params: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in params.items())


def one_per_reproduction(findings: list[Finding]) -> list[Finding]:
    """Findings verified by the same reproduction (kind and parameters) are one bug: one
    finding, over all their sequences, told in the words of the one whose signature named
    that cause (a routing claim's flips per layer, not the unexplained drift beside it that
    the same reproduction verified)."""
    out, seen = [], {}
    for finding in findings:
        by = finding.details.get("verified_by")
        key = None
        if finding.verified and by:
            # what is searched per sequence (pad counts, onsets) is not its shape
            per_sequence = family_of(by["kind"]).per_sequence
            params = {k: _shape(v) for k, v in by["params"].items() if k not in per_sequence}
            key = (finding.cause, by["kind"], repr(sorted(params.items())), by["side"])
        if key in seen:
            first = out[seen[key]]
            told = (
                finding
                if "renamed_from" in first.details and "renamed_from" not in finding.details
                else first
            )
            out[seen[key]] = told.but(
                sequences=sorted(set(first.sequences) | set(finding.sequences))
            )
            continue
        if key is not None:
            seen[key] = len(out)
        out.append(finding)
    return out


def _shape(value):
    """A searched parameter as far as it tells one bug from another: a fitted number to four
    significant digits (two fits of one temperature differ in the seventh)."""
    if isinstance(value, float):
        return float(f"{value:.4g}")
    if isinstance(value, list | tuple):
        return [_shape(v) for v in value]
    return value


def indistinguishable(finding: Finding, outcomes: list[Outcome]) -> Finding:
    """A finding that different bugs reproduce alike, on its tokens and across the batch
    (`verify/alike.py`): each named with how close it came, none claimed verified."""
    best = outcomes[0]
    named = "; ".join(
        f"{o.candidate.kind} ({params_text(o.candidate.params)}) matches the {o.side} side "
        f"to mean |d| {o.after:.3g}"
        for o in outcomes
    )
    return finding.but(
        cause=best.candidate.cause,
        severity=Severity.FAULT,
        status=Status.PLAUSIBLE,
        residual_before=best.before,
        residual_after=best.after,
        floor=best.floor,
        evidence=f"{finding.evidence}; re-scored, {named} (floor {best.floor:.3g}; the drift "
        f"was {best.before:.3g}): these tokens cannot tell them apart, and none reproduces "
        "more of the batch's other findings, so none is claimed; sequences where they keep "
        "different tokens would",
        details={
            "signature_evidence": finding.evidence,
            **{k: v for k, v in finding.details.items() if k != "verified_by"},
            "indistinguishable": [describe(o) for o in outcomes],
        },
    )
