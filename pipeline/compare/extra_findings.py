"""The findings compare adds beside the signatures' diagnosis (compare/diagnosis.py): tokens
a multi-version replay could not score, MoE routing flips, drift beyond precision that no
signature names, and a user's limit exceeded by drift precision explains. Each reads what
compare measured and judged; none re-reads the tables."""

from __future__ import annotations

import numpy as np

from pipeline.compare.align import Aligned
from pipeline.compare.signed import STATISTICS as SIGN_STATISTICS
from pipeline.contracts.causes import Cause, Severity, Status
from pipeline.contracts.report import Finding, Judgement
from pipeline.fixture.table import TokenTable
from pipeline.routing import flipped as routing_flipped


def missing_versions(replay: TokenTable, aligned: Aligned) -> list[Finding]:
    """A finding for tokens a multi-version replay could not score: their version is not in
    the store, so nothing vouches for them (never scored with another version)."""
    from pipeline.weights.multi_version import named_counts

    if not aligned.unscored_tokens:
        return []
    store = replay.metadata.get("weights_store") or {}
    missing = store.get("missing") or {}
    return [
        Finding(
            cause=Cause.MISSING_VERSION,
            evidence=(
                f"{aligned.unscored_tokens} completion tokens were not compared: their weight "
                f"versions are not in the store {store.get('path')} ({named_counts(missing)}); "
                "publish them or retain more versions (lpx weights publish --keep)"
            ),
            details={"missing": missing, "unscored_tokens": aligned.unscored_tokens},
        )
    ]


def routing_flips(
    routing: dict | None, gate: dict | None, aligned: Aligned, tau, forced: bool = False
) -> list[Finding]:
    """A `routing_flip` claim where tokens went to other experts and the drift is beyond
    precision (the gate failed; uncalibrated, a flipped token beyond tau), or where the
    replay was told the rollout's experts (router replay, ``forced``) and used others: no
    precision flips a forced router, so any flip there is the replay's router replay broken
    (misaligned positions, experts misnumbered across EP ranks). Plausible until re-scoring
    with the drifting side's experts forced reproduces that side (verification)."""
    if not routing or not routing["tokens_with_flip"]:
        return []
    region = aligned.completion
    diff = np.abs(region.train.astype(np.float64) - region.rollout.astype(np.float64))
    flipped = routing_flipped(aligned.routing_rollout, aligned.routing_train).any(axis=1)
    beyond = flipped & (diff > tau)
    # calibrated, the gate decides: bf16 alone flips near-tied routers (1.4 % of tokens on
    # the tiny MoE; 11-16 % per layer at 16 x 1024 and 32 x 512, bench/routing.py), large on
    # those tokens, and the calibration measured that
    within = gate["passed"] if gate is not None else not beyond.any()
    if within and not forced:
        return []
    sequence = np.repeat(np.arange(len(region.offsets) - 1), np.diff(region.offsets))
    chosen = beyond if beyond.any() and not forced else flipped
    ids = [aligned.sequence_ids[i] for i in np.unique(sequence[chosen])]
    worst = max(routing["layers"], key=lambda layer: layer["flip_rate"])
    on, rest = routing["drift_on_flipped"], routing["drift_on_rest"]
    rest_text = f"{rest['mean_abs_diff']:.3g}" if rest["tokens"] else "none left"
    return [
        Finding(
            cause=Cause.ROUTING_FLIP,
            sequences=ids,
            first_position=dict(routing["first_flip"]),
            evidence=(
                ("router replay forced the rollout's experts, yet " if forced else "")
                + f"{routing['tokens_with_flip']} of {routing['tokens']} tokens "
                f"({routing['flip_rate']:.2%}) were routed to other experts (most on layer "
                f"{worst['layer']}: {worst['flip_rate']:.2%}); mean |d| {on['mean_abs_diff']:.3g} "
                f"on them, {rest_text} on the rest"
            ),
            details={"layers": routing["layers"], "first_flip": routing["first_flip"]},
            confidence=0.5,
        )
    ]


SMALL_CHANGE = (
    "a small change of every token, as other weights give (a stale or differently converted "
    "checkpoint, another router), or computing in another precision than declared"
)
# what a failed sign test says (compare/signed.py): a direction rounding noise does not take
SIGN_WORDS = {
    "surprisal_slope": (
        "the drift leans on the token's surprisal beyond what noise gives, as a temperature, a "
        "soft-cap or a penalty does, and rounding does not"
    ),
    "position_slope": (
        "the drift leans on the position beyond what noise gives, as a cache or position "
        "encoding that changes along the sequence does"
    ),
    "seen_gap": (
        "the drift differs between tokens seen earlier in their context and the rest beyond "
        "what noise gives, as a repetition, presence or frequency penalty applied on one side "
        "does"
    ),
    "ratio_mean": (
        "the importance ratio's mean is not 1: the rollout sampled its tokens from another "
        "distribution than the one whose logprobs it reported (a processor applied to one "
        "and not the other)"
    ),
}


def beyond_precision(gate: dict, findings: list[Finding], aligned: Aligned) -> list[Finding]:
    """The precision gate failed, yet no finding names a fault: the drift is small on every
    token (none past its tau) and beyond precision over the batch. A fault all the same, to
    be explained (verification tries every reproducible cause on it)."""
    if any(f.is_fault for f in findings):
        return []
    failed = [t for t in gate["tests"] if not t["passed"]]
    leaning = [t["name"] for t in failed if t["name"] in SIGN_STATISTICS]
    said = "; ".join(
        f"{t['name']} {t['observed']:.3g} where noise gives {t['expected']:.3g} ("
        + (
            f"within +/- {abs(t['critical'] - t['expected']):.3g}"
            if t["name"] in SIGN_STATISTICS
            else f"at most {t['critical']:.3g}"
        )
        + f", z {t['z']:.1f})"
        for t in failed
    )
    return [
        Finding(
            cause=Cause.UNEXPLAINED,
            sequences=list(aligned.sequence_ids),
            evidence=(
                f"the batch's drift is beyond what precision gives at {gate['tokens']} tokens "
                f"({said}), though no token passes its tau: "
                + (SIGN_WORDS[leaning[0]] if leaning else SMALL_CHANGE)
            ),
            details={"precision_gate": [t["name"] for t in failed]},
            confidence=0.0,
        )
    ]


def precision_over_user_limits(
    judgement: Judgement, findings: list[Finding], expected: dict, aligned: Aligned
) -> list[Finding]:
    """A limit the user set, exceeded by drift the precision gate passes (no finding beyond
    precision): propose precision, so the failure is not read as a semantic bug. A claim
    like any other: verification re-scores in the declared precisions to verify it."""
    gate_failed = any(
        v.get("source", "").startswith("precision gate") for v in judgement["violations"]
    )
    if not judgement["violations"] or gate_failed or any(f.cause != Cause.DTYPE for f in findings):
        return []
    names = ", ".join(
        f"{v['metric']} {v['value']:.3g} > {v['limit']:.3g} (noise alone: "
        f"{expected.get(v['metric'], float('nan')):.3g})"
        for v in judgement["violations"]
    )
    return [
        Finding(
            cause=Cause.DTYPE,
            sequences=list(aligned.sequence_ids),
            evidence=(
                f"the drift passes the precision gate (what this model's calibrated noise "
                f"gives at this token count), yet limits the policy sets are exceeded: "
                f"{names}; if precision is the cause, raise the limit or compute in a higher "
                "precision"
            ),
            severity=Severity.INFO,
            details={"violations": judgement["violations"], "over_user_limits": True},
            status=Status.PLAUSIBLE,
        )
    ]
