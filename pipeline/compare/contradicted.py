"""Claims the evidence on file contradicts. A signature's cause that nothing verified stays
plausible only where nothing on file says it cannot be: two sides that loaded the same
checkpoint with lpx's engines, a replay that gathered the tensors it held and found them the
checkpoint's, and no weight update recorded, did not score with different weights (equal
file fingerprints alone do not say it: a wrong conversion or sharding holds other weights
behind them); versions
recorded equal on both sides did not change; sequences that are all one length were never
padded; two sides that lpx's engines scored from the same recorded prompt ids did not score
different prompts. Such a claim is ruled out, saying why, and its sequences are `unexplained`: the
verdict stays a failure, and nobody goes looking where the evidence says the bug is not.

Pure: the evidence is read off the two tables once (`evidence_on_file`), then each claim is
set against it (`rule_out_contradicted`)."""

from __future__ import annotations

import numpy as np

from pipeline.contracts.causes import Cause, Severity, Status
from pipeline.contracts.report import Finding

WEIGHTS_CLAIMS = (Cause.STALE_WEIGHTS, Cause.WEIGHTS_DIFFER)
VERSION_CLAIMS = (
    Cause.VERSION_CHANGE,
)  # a claimed version is a claim about the records themselves


def evidence_on_file(fixture, replay) -> dict:
    """What the two tables record that a claim can contradict."""
    fixture_model = fixture.metadata.get("model") or {}
    replay_model = replay.metadata.get("model") or {}
    held = replay.metadata.get("weights") or {}
    versions = set()
    if fixture.weight_versions is not None and len(fixture.weight_versions):
        versions = {str(v) for v in np.unique(fixture.weight_versions.astype(str))}
    lengths = np.diff(fixture.prompt_offsets) + np.diff(fixture.completion_offsets)
    layout = replay.metadata.get("layout") or {}
    return {
        "fixture_weights": fixture_model.get("weights_fingerprint"),
        "replay_weights": replay_model.get("weights_fingerprint"),
        # the replay gathered the weights it held and they are the checkpoint's (FSDP,
        # DeepSpeed, Megatron record both): a conversion or sharding bug would show there
        "held_matches_checkpoint": bool(held.get("held_tensor_fingerprint"))
        and held.get("checkpoint_tensor_fingerprint") == held.get("held_tensor_fingerprint"),
        "fixture_versions": sorted(versions),
        "replay_version": replay.metadata.get("weight_version"),
        "weights_store": replay.metadata.get("weights_store"),
        # a dump's fingerprint is of the model given to `lpx ingest`, not of the weights its
        # engine held (RL engines sync weights in memory)
        "from_checkpoint": not any(t.metadata.get("ingested_from") for t in (fixture, replay)),
        "one_length": int(lengths[0]) if len(set(lengths.tolist())) == 1 else None,
        # the prompt ids each side recorded are the ones its engine consumed: lpx's own
        # engines take token ids and add nothing to them; a served engine (another process
        # may prepend a BOS or apply a template) and a dump (what its engine said) may not
        "same_prompt_ids": _same_prompts(fixture, replay),
        "prompts_consumed_as_recorded": not any(
            t.metadata.get("ingested_from")
            or _engine(t) in SERVED_ENGINES
            or t.metadata.get("prompts_consumed_as_recorded") is False
            for t in (fixture, replay)
        ),
        "replay_packs": layout.get("packing"),
        # a rollout reached over a server's API holds what the server holds, whatever model
        # directory lpx was told
        "rollout_served": _engine(fixture) in SERVED_ENGINES,
    }


def contradiction(finding: Finding, evidence: dict) -> str | None:
    """Why the evidence on file rules the finding's claim out, or None."""
    if finding.verified or not finding.is_fault:
        return None
    cause = finding.cause
    versions = evidence["fixture_versions"]
    replay_version = evidence["replay_version"]
    recorded_update = bool(versions) or replay_version is not None or evidence["weights_store"]
    same = bool(evidence["fixture_weights"]) and (
        evidence["fixture_weights"] == evidence["replay_weights"]
    )
    loaded_it = same and evidence["from_checkpoint"] and not evidence.get("rollout_served")
    if cause == Cause.STALE_WEIGHTS and loaded_it and not recorded_update:
        # stale weights are an update one side missed: with none recorded, and both sides
        # loading the one checkpoint on file, there was none to miss
        return (
            "both sides loaded the checkpoint whose weight fingerprint is on file "
            f"({str(evidence['fixture_weights'])[:19]}...), the same on both, and neither "
            "records a weight update, so neither held an older version (an engine that syncs "
            "weights in memory should record weight versions)"
        )
    if cause in WEIGHTS_CLAIMS:
        scored_from_it = (
            evidence["from_checkpoint"]
            and evidence["held_matches_checkpoint"]
            and not evidence.get("rollout_served")
        )
        if same and not recorded_update and scored_from_it:
            return (
                "both sides scored the checkpoint whose weight fingerprint is on file "
                f"({str(evidence['fixture_weights'])[:19]}...), the same on both, the replay "
                "held exactly its tensors, and neither records a weight update (an engine "
                "that syncs weights in memory should record weight versions)"
            )
    # with a weight store the replay scored each token under its claimed version: the claims
    # themselves are under test there (claimed_version), so they contradict nothing
    if cause in VERSION_CLAIMS and loaded_it and not recorded_update:
        # an update during generation needs an engine that syncs weights: the sides loaded
        # the one checkpoint on file themselves, and neither records a version or an update
        # (an engine that syncs weights should; a dump's fingerprint says nothing of it)
        return (
            "neither side records a weight version or update, and both loaded the checkpoint "
            f"whose weight fingerprint is on file ({str(evidence['fixture_weights'])[:19]}...), "
            "the same on both"
        )
    if cause in VERSION_CLAIMS and len(versions) == 1 and not evidence["weights_store"]:
        (only,) = versions
        if replay_version is None or str(replay_version) == only:
            return f"every token of the rollout records weight version {only}" + (
                ", as does the replay" if replay_version is not None else ""
            )
    if (
        cause == Cause.PROMPT_MISMATCH
        and evidence["same_prompt_ids"]
        and evidence["prompts_consumed_as_recorded"]
    ):
        return (
            "both sides record the same prompt ids for every sequence, and both were scored "
            "by lpx's engines from those token ids (no template applied, no BOS added), so "
            "neither scored other prompt tokens"
        )
    if cause == Cause.MASK_PADDING and evidence["one_length"] is not None:
        if evidence["replay_packs"] is False:
            return (
                f"every sequence is {evidence['one_length']} tokens long, so no batch of them "
                "is padded, and the replay does not pack"
            )
    return None


SERVED_ENGINES = ("http",)  # engines lpx reaches over a server's API, not in process


def _engine(table) -> str | None:
    return (table.metadata.get("engine") or {}).get("name")


def _same_prompts(fixture, replay) -> bool:
    """Both tables hold the same sequences with the same prompt ids, in one order."""
    return (
        list(fixture.sequence_ids) == list(replay.sequence_ids)
        and np.array_equal(fixture.prompt_offsets, replay.prompt_offsets)
        and np.array_equal(fixture.prompt_ids, replay.prompt_ids)
    )


def rule_out_contradicted(findings: list[Finding], evidence: dict) -> list[Finding]:
    """The findings with every contradicted claim ruled out (kept, as information, saying
    why) and its sequences gathered into `unexplained` with what was ruled out."""
    out, leftover, ruled = [], [], []
    for finding in findings:
        why = contradiction(finding, evidence)
        if why is None:
            out.append(finding)
            continue
        ruled.append({"cause": str(finding.cause), "why": why})
        leftover += finding.sequences
        out.append(
            finding.but(
                status=Status.RULED_OUT,
                severity=Severity.INFO,
                evidence=f"{finding.evidence}; ruled out by the evidence on file: {why}",
                details={**finding.details, "contradicted_by": why},
            )
        )
    if not ruled:
        return findings
    said = "; ".join(f"{r['cause']} ruled out: {r['why']}" for r in ruled)
    existing = next((f for f in out if f.cause == Cause.UNEXPLAINED and f.is_fault), None)
    if existing is not None:
        index = out.index(existing)
        out[index] = existing.but(
            sequences=sorted(set(existing.sequences) | set(leftover)),
            evidence=f"{existing.evidence}; {said}",
            details={**existing.details, "contradicted": ruled},
        )
        return out
    out.append(
        Finding(
            cause=Cause.UNEXPLAINED,
            sequences=sorted(set(leftover)),
            evidence=f"drift in {len(set(leftover))} sequences that no remaining cause "
            f"explains; {said}; inspect the worst tokens, or re-score with the model "
            "(lpx compare --model) to test the rest",
            details={"contradicted": ruled},
            confidence=0.0,
            status=Status.PLAUSIBLE,
        )
    )
    return out
