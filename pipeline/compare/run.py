"""Compare one replay against one fixture: metrics, worst tokens, diagnosis and verdict."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from pipeline.compare.align import Aligned, align
from pipeline.compare.calibrated import (
    SignedSides,
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
from pipeline.compare.diagnosis import diagnose_region
from pipeline.compare.diagnosis_context import diagnosis_context
from pipeline.compare.extra_findings import (
    beyond_precision,
    missing_versions,
    precision_over_user_limits,
    routing_flips,
)
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
from pipeline.compare.report_parts import (
    by_weight_version,
    drift_map_of,
    unset_generation_defaults,
    workload_of,
    worst_tokens,
)
from pipeline.compare.sequence_table import sequence_columns
from pipeline.compare.signed import prompt_clusters, seen_before
from pipeline.compare.topk import topk_kl
from pipeline.contracts.calibration import Calibration
from pipeline.contracts.report import Finding, Judgement, Report
from pipeline.errors import BadInput
from pipeline.fingerprint import prompt_set_fingerprint
from pipeline.fixture.io import read_table, validate_table
from pipeline.fixture.table import REPLAY_CHANNEL, TokenTable
from pipeline.routing import agreement, unrecorded
from pipeline.testbed import describe_testbed

WORST_TOKENS = 20


@dataclass
class Comparison:
    report: Report
    aligned: Aligned
    tau: float
    # the per-sequence rows as columns (compare/sequence_table.py): written to
    # sequences.parquet beside report.json, not into it
    sequences: dict | None = None


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
    # the model directory: a fixture of trajectories needs its tokenizer (else the one named)
    model_dir: Path | None = None


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
    fixture, token_gap, token_metrics = _trajectory_tokens(fixture, fixture_path, options)
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
    findings = with_onset(findings, onset) + token_gap
    if "trajectories" in fixture.metadata:
        from pipeline.compare.turn_growth import growth_findings
        from pipeline.trajectory.fixture import by_turn, token_turns

        expected = judging.floor.expected_mean if judging.floor is not None else None
        turn = token_turns(fixture, aligned)  # once: the table and the growth test read it
        measured.metrics.update(token_metrics, by_turn=by_turn(turn, aligned, expected))
        limit = policy.profile(profile).get("limits", {}).get("mean_abs_diff")
        findings += growth_findings(turn, aligned, expected, limit)
    judgement = judge(
        policy, profile, measured.metrics, findings, judging.limits, options.exact, judging.gate
    )
    if judging.floor is not None:
        findings += precision_over_user_limits(judgement, findings, judging.floor.expected, aligned)
        judgement["calibrated"] = True
    report = assemble(
        fixture, replay, (fixture_path, replay_path), aligned, tau, measured, findings,
        judgement, judging, options,
    )  # fmt: skip
    report.correction = correction
    report.onset = onset
    sequences = sequence_columns(aligned.sequence_ids, measured.per_sequence, tau)
    return Comparison(report, aligned, tau, sequences)


def _trajectory_tokens(fixture: TokenTable, fixture_path, options: CompareOptions):
    """A fixture of multi-turn trajectories: its token partings as findings, and the fixture
    masked to the model tokens whose whole context is exact, the only ones judged against
    precision (pipeline/trajectory/fixture.py)."""
    from pipeline.trajectory import fixture as trajectories

    if not trajectories.has_trajectories(fixture):
        return fixture, [], {}
    tokenizer = trajectories.tokenizer_for(fixture, options.model_dir)
    if tokenizer is None:
        raise BadInput(
            f"{fixture_path}: a fixture of trajectories is checked for token-exactness with its "
            "model's tokenizer, and the model it names is not here; pass --model DIR"
        )
    partings, exact = trajectories.token_check(fixture, tokenizer, str(fixture_path))
    excluded = int(fixture.completion_mask.sum() - exact.sum())
    parted = {p.trajectory for p in partings}
    metrics = {
        # the share of trajectories whose every model turn's context is exact (a series metric)
        "token_exact_rate": 1.0 - len(parted) / max(1, fixture.num_sequences),
        "model_tokens_outside_precision": float(excluded),
    }
    findings = trajectories.token_findings(partings, excluded)
    return replace(fixture, completion_mask=exact), findings, metrics


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
    rows = _rows_of(fixture, aligned.sequence_ids)
    floor = calibrated_judging(
        calibration,
        pair,
        region.train,
        region.positions,
        region.offsets,
        options.calibration_source,
        np.abs(region.train.astype(np.float64) - region.rollout.astype(np.float64)),
        gate_logprob=region.rollout if nearer == "rollout" else None,
        sides=SignedSides(
            region.rollout,
            region.train,
            side_precision(fixture.metadata),
            fixture.metadata.get("sampling"),
            prompt_clusters([fixture.prompt_of(row) for row in rows], np.diff(region.offsets)),
            _seen(fixture, rows, region.positions, region.offsets),
        ),
    )
    user_policy = policy.source != "default policy"
    limits = effective_limits(policy.profile(profile).get("limits", {}), floor.limits, user_policy)
    return Judging(floor.tau, limits, floor.gate, {**floor.note, "limits": limits}, floor)


def _rows_of(fixture: TokenTable, sequence_ids) -> list[int]:
    """Each compared sequence's row in the fixture, in the comparison's order."""
    row_of = {sequence_id: row for row, sequence_id in enumerate(fixture.sequence_ids)}
    return [row_of[sequence_id] for sequence_id in sequence_ids]


def _seen(fixture: TokenTable, rows: list[int], positions, offsets) -> np.ndarray:
    """Per compared token: whether it occurred earlier in its context (prompt or output)."""
    out = []
    for k, row in enumerate(rows):
        flags = seen_before(fixture.prompt_of(row), fixture.completion_of(row))
        out.append(flags[np.asarray(positions[offsets[k] : offsets[k + 1]], dtype=np.int64)])
    return np.concatenate(out) if out else np.zeros(0, dtype=bool)


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
    context = diagnosis_context(fixture, replay, aligned, dtypes, judging.floor, judging.gate)
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
    findings += missing_versions(replay, aligned)
    forced = bool((replay.metadata.get("knobs") or {}).get("router_replay"))
    gate = judging.gate
    findings += routing_flips(measured.routing, gate, aligned, judging.token_tau, forced)
    if gate is not None and not gate["passed"]:
        findings += beyond_precision(gate, findings, aligned)
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
    through the same model by every reader (tests/project/test_contract.py holds the round trip)."""
    fixture_path, replay_path = paths
    completion = aligned.completion
    return Report.model_construct(
        verdict=judgement["verdict"],
        sign_convention=SIGN_CONVENTION,
        metrics={
            **measured.metrics,
            "by_region": measured.by_region,
            **by_weight_version(aligned, tau),
            "kl_input_drift": kl_input_drift(
                completion.train, completion.rollout, aligned.kl_channels
            ),
        },
        sequences=None,  # in sequences.parquet (compare/sequence_table.py)
        worst=worst_tokens(aligned, WORST_TOKENS),
        drift_map=drift_map_of(aligned, tau),
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
                # a fixture's trajectories (turn spans, contexts kept whole) stay in it: the
                # report has their findings and metrics
                **{k: v for k, v in fixture.metadata.items() if k != "trajectories"},
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


def _present(**fields) -> dict:
    return {name: value for name, value in fields.items() if value is not None}
