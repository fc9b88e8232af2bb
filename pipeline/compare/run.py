"""Compare one replay against one fixture: metrics, worst tokens, diagnosis and verdict."""

from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeline.compare.align import Aligned, Region, align
from pipeline.compare.calibrated import (
    as_calibration,
    calibrated_judging,
    effective_limits,
    side_precision,
    surprisal_side,
    usable,
)
from pipeline.compare.config_evidence import with_config_evidence
from pipeline.compare.contradicted import evidence_on_file, rule_out_contradicted
from pipeline.compare.correction import correction_view, flat_metrics
from pipeline.compare.diagnosis import Context, diagnose_region
from pipeline.compare.drift_map import drift_map
from pipeline.compare.hypotheses.batch import CALIBRATED_CEILING, NUMERIC_CEILING
from pipeline.compare.metrics import (
    SIGN_CONVENTION,
    batch_metrics,
    bitwise_agreement,
    kl_input_drift,
    sequence_metrics,
)
from pipeline.compare.onset import onset_of_comparison, with_onset
from pipeline.compare.policy import Policy, judge, load_policy, profile_for
from pipeline.compare.topk import topk_kl
from pipeline.contracts.calibration import Calibration
from pipeline.contracts.causes import Cause, Severity, Status
from pipeline.contracts.metrics import PER_VERSION_METRICS
from pipeline.contracts.report import Finding, Judgement, Report
from pipeline.errors import BadInput
from pipeline.fingerprint import prompt_set_fingerprint
from pipeline.fixture.io import read_table, validate_table
from pipeline.fixture.table import REPLAY_CHANNEL, TokenTable
from pipeline.routing import agreement, unrecorded
from pipeline.routing import flipped as routing_flipped
from pipeline.testbed import describe_testbed

WORST_TOKENS = 20
CONTEXT_TOKENS = 6  # left-context token ids kept with each worst token


@dataclass
class Comparison:
    report: Report
    aligned: Aligned
    tau: float


@dataclass(frozen=True)
class CompareOptions:
    """How a comparison is made and judged."""

    policy: Policy | None = None  # the default policy when None
    profile: str | None = None  # the policy's profile; by the two sides' precisions when None
    channel: str = "rollout"  # the fixture's logprob channel compared
    allow_weight_mismatch: bool = False  # compare sides whose weight fingerprints differ
    command_line: str = ""  # recorded in the report
    # `lpx calibrate`'s noise floor, where it covers the pair (a dict is checked as the file)
    calibration: Calibration | dict | None = None
    calibration_source: str = ""  # where the calibration came from, for the report
    exact: bool = False  # any completion token not bitwise equal fails (batch-invariant stacks)


@dataclass
class Measured:
    """The metrics: the completion's (and per region, per sequence), routing's."""

    metrics: dict
    by_region: dict
    per_sequence: dict
    routing: dict | None


@dataclass
class Judging:
    """What drift is judged against: the model's calibrated floor, or the profile's
    constants (then ``floor`` and ``gate`` are None)."""

    token_tau: float | np.ndarray  # a token drifts beyond this |d|
    limits: dict | None  # the policy limits the floor sets
    gate: dict | None  # the calibrated precision gate's result
    note: dict  # the report's `calibration` section
    floor: object | None = None  # `calibrated_judging`'s result


def compare_files(
    fixture_path: Path, replay_path: Path, options: CompareOptions | None = None, **fields
) -> Comparison:
    """Read, then `compare_tables`; ``fields`` are `CompareOptions`' where ``options`` is
    not given."""
    fixture = read_table(fixture_path, expect_kind="fixture")
    replay = read_table(replay_path, expect_kind="replay")
    return compare_tables(fixture, replay, fixture_path, replay_path, options, **fields)


def compare_tables(
    fixture: TokenTable,
    replay: TokenTable,
    fixture_path: Path | str,
    replay_path: Path | str,
    options: CompareOptions | None = None,
    **fields,
) -> Comparison:
    """Compare tables already in memory; the paths only name them in messages and reports.
    ``fields`` are `CompareOptions`' where ``options`` is not given.

    With a ``calibration`` (`lpx calibrate`) that covers both sides' precisions, drift is
    judged against the model's measured noise floor; otherwise against the profile's
    constants, and the report says why. ``exact``: for batch-invariant or true-on-policy
    stacks, any completion token whose float32 logprobs are not bitwise equal fails the
    verdict (the policy applies as well).

    Four steps: measure, diagnose, judge, assemble."""
    options = options or CompareOptions(**fields)
    _check_inputs(fixture, replay, fixture_path, replay_path, options.allow_weight_mismatch)
    aligned = align(fixture, replay, options.channel, fixture_path, replay_path)
    policy = options.policy or load_policy()
    dtypes = [fixture.metadata.get("dtype", "float32"), replay.metadata.get("dtype", "float32")]
    profile = options.profile or profile_for(dtypes)
    tau = float(policy.profile(profile)["tau"])
    if len(aligned.completion.train) == 0:
        raise BadInput(
            f"{fixture_path}: no active completion tokens to compare (an empty fixture, or "
            "every token masked); comparing nothing is never a pass."
        )
    measured = measure(fixture, replay, aligned, tau)
    completion = aligned.completion
    correction = correction_view(
        completion.train, completion.rollout, completion.offsets, policy.correction
    )
    measured.metrics.update(flat_metrics(correction))
    judging = judged_against(fixture, replay, aligned, policy, profile, tau, options)
    findings = diagnose(fixture, replay, aligned, measured, judging, dtypes)
    onset = _position_onset(fixture, aligned, judging, dtypes)
    findings = with_onset(findings, onset)
    judgement = judge(
        policy, profile, measured.metrics, findings, judging.limits, options.exact, judging.gate
    )
    if judging.floor is not None:
        findings += _precision_over_user_limits(
            judgement, findings, judging.floor.expected, aligned
        )
        judgement["calibrated"] = True
    report = assemble(
        fixture, replay, (fixture_path, replay_path), aligned, tau, measured, findings,
        judgement, judging, options,
    )  # fmt: skip
    report.correction = correction
    report.onset = onset
    return Comparison(report, aligned, tau)


def _position_onset(fixture, aligned: Aligned, judging: Judging, dtypes: list[str]):
    """compare/onset.py's onset, in units of the calibrated floor where there is one, else of
    the profile's constant."""
    if judging.floor is not None:
        noise = np.asarray(judging.floor.expected_mean, dtype=np.float64)
    else:
        ceiling = NUMERIC_CEILING.get(profile_for(dtypes), NUMERIC_CEILING["float32"])
        noise = ceiling / CALIBRATED_CEILING
    return onset_of_comparison(fixture, aligned, noise)


def _check_inputs(fixture, replay, fixture_path, replay_path, allow_weight_mismatch: bool):
    """Both tables valid, and made from the same weights unless a mismatch is allowed."""
    vocab_size = (fixture.metadata.get("model") or {}).get("vocab_size")
    validate_table(fixture, fixture_path, vocab_size)
    validate_table(replay, replay_path, vocab_size)
    fixture_weights = (fixture.metadata.get("model") or {}).get("weights_fingerprint")
    replay_weights = (replay.metadata.get("model") or {}).get("weights_fingerprint")
    if (
        fixture_weights
        and replay_weights
        and fixture_weights != replay_weights
        and not allow_weight_mismatch
    ):
        raise BadInput(
            f"{replay_path}: made from weights {replay_weights[:23]}... but {fixture_path} from "
            f"{fixture_weights[:23]}...; replay the fixture's model, or pass "
            "--allow-weight-mismatch to measure and diagnose the stale weights."
        )


def measure(fixture: TokenTable, replay: TokenTable, aligned: Aligned, tau: float) -> Measured:
    """The completion's batch metrics, bitwise agreement, per-sequence metrics, top-1 and
    top-k agreement where recorded, routing flips, and the prompt region's metrics."""
    completion = aligned.completion
    metrics = batch_metrics(completion.train, completion.rollout, tau)
    metrics.update(bitwise_agreement(completion.train, completion.rollout))
    per_sequence = sequence_metrics(completion.train, completion.rollout, completion.offsets)
    metrics["max_seq_mean_abs_diff"] = float(per_sequence["mean_abs_diff"].max(initial=0.0))
    if aligned.top1_rollout is not None and len(aligned.top1_rollout):
        metrics["top1_flip_rate"] = float(np.mean(aligned.top1_rollout != aligned.top1_train))
    if aligned.topk_rollout is not None:
        metrics.update(topk_kl(aligned.topk_rollout, aligned.topk_train))
    routing = _routing(aligned)
    if routing is not None:
        # positions an engine returned no routing for (prefix-cached, chunked prefill)
        routing["unrecorded"] = {"rollout": unrecorded(fixture), "replay": unrecorded(replay)}
        metrics["routing_flip_rate"] = routing["flip_rate"]
        for layer in routing["layers"]:
            metrics[f"layer_{layer['layer']}.routing_flip_rate"] = layer["flip_rate"]
    by_region = {"completion": metrics}
    if aligned.prompt is not None:
        by_region["prompt"] = batch_metrics(aligned.prompt.train, aligned.prompt.rollout, tau)
    return Measured(metrics, by_region, per_sequence, routing)


def judged_against(
    fixture: TokenTable,
    replay: TokenTable,
    aligned: Aligned,
    policy: Policy,
    profile: str,
    tau: float,
    options: CompareOptions,
) -> Judging:
    """The calibrated floor where the calibration covers both sides' precisions, else the
    profile's constants (and why)."""
    # checked once here: bench scripts and tests give the dict json.loads read
    calibration = as_calibration(options.calibration, options.calibration_source)
    pair, why_not = usable(calibration, fixture.metadata, replay.metadata)
    if not pair:
        note = {"used": False, "reason": why_not, "judged_by": "the profile's constants"}
        return Judging(tau, None, None, note)
    region = aligned.completion
    nearer = surprisal_side(side_precision(fixture.metadata), side_precision(replay.metadata))
    floor = calibrated_judging(
        calibration,
        pair,
        region.train,
        region.positions,
        region.offsets,
        options.calibration_source,
        np.abs(region.train.astype(np.float64) - region.rollout.astype(np.float64)),
        gate_logprob=region.rollout if nearer == "rollout" else None,
    )
    user_policy = policy.source != "default policy"
    limits = effective_limits(policy.profile(profile).get("limits", {}), floor.limits, user_policy)
    return Judging(floor.tau, limits, floor.gate, {**floor.note, "limits": limits}, floor)


def diagnose(
    fixture: TokenTable,
    replay: TokenTable,
    aligned: Aligned,
    measured: Measured,
    judging: Judging,
    dtypes: list[str],
) -> list[Finding]:
    """The findings: the signatures' causes, missing weight versions, routing flips, drift
    beyond precision; then the claims the evidence on file contradicts ruled out."""
    context = diagnosis_context(fixture, replay, aligned, dtypes, judging)
    region = aligned.completion
    findings = diagnose_region(
        region.train,
        region.rollout,
        region.offsets,
        region.positions,
        aligned.sequence_ids,
        aligned.weight_versions,
        judging.token_tau,
        context,
    )
    findings += _missing_versions(replay, aligned)
    forced = bool((replay.metadata.get("knobs") or {}).get("router_replay"))
    gate = judging.gate
    findings += _routing_flips(measured.routing, gate, aligned, judging.token_tau, forced)
    if gate is not None and not gate["passed"]:
        findings += _beyond_precision(gate, findings, aligned)
    findings = rule_out_contradicted(findings, evidence_on_file(fixture, replay))
    return with_config_evidence(findings, fixture.metadata, replay.metadata)


def assemble(
    fixture: TokenTable,
    replay: TokenTable,
    paths: tuple,
    aligned: Aligned,
    tau: float,
    measured: Measured,
    findings: list[Finding],
    judgement: Judgement | dict,
    judging: Judging,
    options: CompareOptions,
) -> Report:
    """The report. Built without re-validating: every part is made here, from numpy (a
    re-validation costs ~50 ms per 32k sequence rows). What compare writes is read back
    through the same model by every reader (tests/test_contract.py holds the round trip)."""
    fixture_path, replay_path = paths
    completion = aligned.completion
    return Report.model_construct(
        verdict=judgement["verdict"],
        sign_convention=SIGN_CONVENTION,
        metrics={
            **measured.metrics,
            "by_region": measured.by_region,
            **_by_weight_version(aligned, tau),
            "kl_input_drift": kl_input_drift(
                completion.train, completion.rollout, aligned.kl_channels
            ),
        },
        sequences=_sequence_rows(aligned, measured.per_sequence, tau),
        worst=worst_tokens(aligned, WORST_TOKENS),
        drift_map=_drift_map(aligned, tau),
        routing=measured.routing,
        diagnosis=findings,
        policy=judgement,
        precision_gate=judging.gate,
        calibration=judging.note,
        verification=None,
        workload=workload_of(fixture),
        # said only where the model's generation config sets what the sampling leaves unset
        **_present(generation_defaults=unset_generation_defaults(fixture.metadata)),
        metadata={
            "fixture": {
                "path": str(fixture_path),
                "channel": options.channel,
                "prompt_set_fingerprint": prompt_set_fingerprint(fixture),
                **fixture.metadata,
            },
            "replay": {"path": str(replay_path), "channel": REPLAY_CHANNEL, **replay.metadata},
            "command_line": options.command_line,
            "testbed": describe_testbed(),
        },
    )


def rejudge(report: Report, policy: Policy) -> None:
    """The verdict again, after verification changed the findings (same profile, limits)."""
    judged = report.policy
    judgement = judge(
        policy,
        judged["profile"],
        report.metrics,
        report.diagnosis,
        judged["limits"],
        bool(judged.get("exact")),
        report.precision_gate,
    )
    if judged.get("calibrated"):
        judgement["calibrated"] = True
    report.policy, report.verdict = judgement, judgement["verdict"]


def _by_weight_version(aligned: Aligned, tau: float) -> dict:
    """Drift per recorded weight version: a replay that scored each token under its own
    version is clean per version; a stale or misclaimed one shows which version drifts."""
    versions = aligned.weight_versions
    if versions is None or len(versions) == 0:
        return {}
    region = aligned.completion
    names = np.asarray([str(v) for v in versions], dtype=object)
    seq = np.repeat(np.arange(len(region.offsets) - 1), np.diff(region.offsets))
    rows = {}
    for name in sorted(set(names.tolist())):
        mine = names == name
        metrics = batch_metrics(region.train[mine], region.rollout[mine], tau)
        rows[name] = {
            **{key: metrics[key] for key in PER_VERSION_METRICS if key in metrics},
            "sequences": int(len(np.unique(seq[mine]))),
        }
    return {"by_weight_version": rows}


def _missing_versions(replay: TokenTable, aligned: Aligned) -> list[Finding]:
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


def workload_of(fixture: TokenTable) -> dict:
    """What was compared, as the history tells nights apart: the prompt set, and a digest of
    the sampled tokens (sequence ids, completion lengths and ids). Two nights with the same
    digest compared the same tokens; otherwise `lpx record` measures how much they share
    (pipeline/history/workload.py)."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update("\0".join(map(str, fixture.sequence_ids)).encode())
    digest.update(np.asarray(fixture.completion_offsets, dtype=np.int64).tobytes())
    digest.update(np.asarray(fixture.completion_ids, dtype=np.int64).tobytes())
    return {
        "prompt_set": prompt_set_fingerprint(fixture),
        "tokens_digest": digest.hexdigest(),
        "sequences": int(fixture.num_sequences),
        "completion_tokens": int(len(fixture.completion_ids)),
    }


def worst_tokens(aligned: Aligned, k: int) -> list[dict]:
    """The k tokens with the largest |d| across the compared regions."""
    rows = []
    for region_name, region in _regions(aligned):
        diff = np.abs(region.train.astype(np.float64) - region.rollout.astype(np.float64))
        top = np.argpartition(-diff, min(k, len(diff)) - 1)[:k] if len(diff) else []
        sequence_of = np.searchsorted(region.offsets, top, side="right") - 1
        for flat, seq in zip(top, sequence_of, strict=True):
            context_start = max(int(region.offsets[seq]), int(flat) - CONTEXT_TOKENS)
            rows.append(
                {
                    "sequence_id": aligned.sequence_ids[int(seq)],
                    "position": int(region.positions[flat]),
                    "token_id": int(region.token_ids[flat]),
                    "region": region_name,
                    "logprob_rollout": float(region.rollout[flat]),
                    "logprob_train": float(region.train[flat]),
                    "abs_diff": float(diff[flat]),
                    # the tokens before it in the same region: decoded as context on run pages
                    "context_ids": region.token_ids[context_start:flat].tolist(),
                }
            )
    return sorted(rows, key=lambda row: -row["abs_diff"])[:k]


def _routing(aligned: Aligned) -> dict | None:
    """Routing agreement per MoE layer over the compared completion tokens (both sides
    recorded routing), with the drift on tokens routed differently apart from the rest."""
    if aligned.routing_rollout is None:
        return None
    region = aligned.completion
    sequence = np.repeat(np.arange(len(region.offsets) - 1), np.diff(region.offsets))
    return agreement(
        aligned.routing_rollout,
        aligned.routing_train,
        aligned.routing_layers,
        sequence,
        region.positions,
        aligned.sequence_ids,
        np.abs(region.train.astype(np.float64) - region.rollout.astype(np.float64)),
    )


def _routing_flips(
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


def _drift_map(aligned: Aligned, tau: float) -> dict | None:
    region = aligned.completion
    lengths = np.diff(region.offsets)
    sequence_index = np.repeat(np.arange(len(lengths)), lengths)
    abs_diff = np.abs(region.train.astype(np.float64) - region.rollout.astype(np.float64))
    return drift_map(aligned.sequence_ids, sequence_index, region.positions, abs_diff, tau)


def _regions(aligned: Aligned) -> list[tuple[str, Region]]:
    regions = [("completion", aligned.completion)]
    return regions + ([("prompt", aligned.prompt)] if aligned.prompt is not None else [])


def _lengths(fixture: TokenTable, aligned: Aligned) -> dict:
    """Prompt and whole-sequence lengths in the aligned order: padding and truncation bugs
    pick their victims by length."""
    index = fixture.index_of()
    rows = np.array([index[s] for s in aligned.sequence_ids], dtype=np.int64)
    prompt = np.diff(fixture.prompt_offsets)[rows]
    return {
        "prompt_lengths": prompt,
        "sequence_lengths": prompt + np.diff(fixture.completion_offsets)[rows],
    }


def _beyond_precision(gate: dict, findings: list[Finding], aligned: Aligned) -> list[Finding]:
    """The precision gate failed, yet no finding names a fault: the drift is small on every
    token (none past its tau) and beyond precision over the batch. A fault all the same, to
    be explained (verification tries every reproducible cause on it)."""
    if any(f.is_fault for f in findings):
        return []
    failed = [t for t in gate["tests"] if not t["passed"]]
    said = "; ".join(
        f"{t['name']} {t['observed']:.3g} where noise gives {t['expected']:.3g} (at most "
        f"{t['critical']:.3g}, z {t['z']:.1f})"
        for t in failed
    )
    return [
        Finding(
            cause=Cause.UNEXPLAINED,
            sequences=list(aligned.sequence_ids),
            evidence=(
                f"the batch's drift is beyond what precision gives at {gate['tokens']} tokens "
                f"({said}), though no token passes its tau: a small change of every token, as "
                "other weights give (a stale or differently converted checkpoint, another "
                "router), or computing in another precision than declared"
            ),
            details={"precision_gate": [t["name"] for t in failed]},
            confidence=0.0,
        )
    ]


def _precision_over_user_limits(
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


def diagnosis_context(
    fixture: TokenTable, replay: TokenTable, aligned: Aligned, dtypes: list[str], judging: Judging
) -> Context:
    """What the diagnosis reads beside the logprobs, from both sides' records."""
    fixture_meta, replay_meta = fixture.metadata, replay.metadata
    sides = (side_precision(fixture_meta), side_precision(replay_meta))
    reference = replay_meta.get("weight_version")
    multi_version = replay_meta.get("weights_store") is not None  # each token its own version
    if (
        reference is None
        and not multi_version
        and aligned.weight_versions is not None
        and len(aligned.weight_versions)
    ):
        reference = _agreeing_version(aligned)
    sampling = fixture_meta.get("sampling") or {}
    holds = str((fixture_meta.get("logprob_channels") or {}).get("rollout", ""))
    replay_temperature = (replay_meta.get("knobs") or {}).get("temperature", 1.0)
    rollout_temperature = sampling.get("temperature", 1.0) if holds.startswith("processed") else 1.0
    hint = None
    if sampling and rollout_temperature != replay_temperature:
        hint = (
            f"the fixture's rollout channel holds {holds or 'unknown'} (sampling temperature "
            f"{sampling.get('temperature')}) and the replay applied temperature {replay_temperature}"
        )
    held = replay_meta.get("weights") or {}
    calibrated = judging.floor is not None
    return Context(
        low_precision_dtype=profile_for(dtypes),
        sampling=fixture_meta.get("sampling"),
        tf32_side="float32+tf32" in sides,
        reference_weight_version=reference,
        temperature_hint=hint,
        fixture_weights=(fixture_meta.get("model") or {}).get("weights_fingerprint"),
        replay_weights=(replay_meta.get("model") or {}).get("weights_fingerprint"),
        checkpoint_tensors=held.get("checkpoint_tensor_fingerprint"),
        held_tensors=held.get("held_tensor_fingerprint"),
        version_channels=aligned.version_channels,
        **_lengths(fixture, aligned),
        noise_expected=judging.floor.expected_mean if calibrated else None,
        # the batch is beyond what precision gives at its size: precision cannot explain it
        beyond_precision=calibrated and not judging.gate["passed"],
    )


def _present(**fields) -> dict:
    return {name: value for name, value in fields.items() if value is not None}


def unset_generation_defaults(fixture_meta: dict) -> dict | None:
    """The sampling fields the model's generation_config.json sets that the fixture's
    recorded sampling leaves unset: an engine that applies the model's defaults (vLLM's
    `--generation-config auto`, SGLang's chat API) then sampled, and may have returned
    logprobs, under them. lpx's own rollouts send every field explicitly; a dump (`lpx
    ingest`) or a table with no sampling record does not say. None when nothing is unset."""
    config = (fixture_meta.get("model") or {}).get("generation_config") or {}
    sampling = fixture_meta.get("sampling") or {}
    if not config or (sampling and not fixture_meta.get("ingested_from")):
        return None
    unset = {name: value for name, value in config.items() if name not in sampling}
    if not unset:
        return None
    return {
        "unset": unset,
        "logprobs": str((fixture_meta.get("logprob_channels") or {}).get("rollout", "unknown")),
        "note": "the recorded sampling leaves "
        + ", ".join(f"{k} unset (the model's generation config: {v})" for k, v in unset.items())
        + "; an engine that applies the model's defaults sampled with them, and processed "
        "logprobs carry them (re-scoring searches them first: lpx compare --model)",
    }


def _agreeing_version(aligned: Aligned):
    """The weight version the replay scored with, when it records none: the one whose tokens
    the replay agrees with best (ties: the most common)."""
    region = aligned.completion
    names = np.asarray([str(v) for v in aligned.weight_versions], dtype=object)
    gap = np.abs(region.train.astype(np.float64) - region.rollout.astype(np.float64))
    counts = Counter(names.tolist())
    scores = {name: float(np.nanmean(gap[names == name])) for name in counts}
    best = min(scores.values())
    tied = [name for name, score in scores.items() if score <= best * 1.0001]
    choice = max(tied, key=counts.get)
    return next(v for v in aligned.weight_versions if str(v) == choice)


def _sequence_rows(aligned: Aligned, per_sequence: dict, tau: float) -> list[dict]:
    names = (
        "tokens",
        "max_abs_diff",
        "mean_abs_diff",
        "sum_abs_diff",
        "sum_diff",
        "log_ppl_diff",
        "chi2_seq",
    )
    columns = [list(aligned.sequence_ids)] + [_json_column(per_sequence[name]) for name in names]
    columns.append((per_sequence["max_abs_diff"] > tau).tolist())
    keys = ("sequence_id", *names, "over_tau")
    return [dict(zip(keys, values, strict=True)) for values in zip(*columns, strict=True)]


def _json_column(values: np.ndarray) -> list:
    """A column as JSON-safe Python values: JSON has no NaN or inf, so those (rare) entries
    become the strings a reader recognises, patched in place of a whole-report walk."""
    column = values.tolist()
    if values.dtype.kind == "f":
        for index in np.flatnonzero(~np.isfinite(values)):
            column[index] = str(float(values[index]))
    return column
