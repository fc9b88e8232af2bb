"""Hypothesis families verified on faults committed the way engines commit them, not the way
`pipeline/faults/` re-scores them: the rollout side is scored by independent code (a plain
transformers forward over the engine's own batches, a real sampler's processed logprobs),
and `lpx diagnose` must re-create the bug by searching its parameters. Numbers: the
parameters recovered and the residual left against the floor."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.fixture.io import read_table, write_table
from support.engine_like import (
    cached_positions,
    labels_unshifted,
    left_padded_rollout,
    rescored,
    stored_one_off,
    temperature_after_log_softmax,
    with_prompt,
)
from support.helpers import publish_one_step, read_report, run_lpx


def diagnose(fixture, replay, out, *more) -> dict:
    result = run_lpx("diagnose", fixture, replay, "--out", out, "--quiet", *more)
    assert result.exit_code in (0, 1), result.output
    return read_report(out)


def faults_of(report) -> list[dict]:
    return [f for f in report["diagnosis"] if f["severity"] == "fault"]


def said(finding) -> str:
    """A finding in one line, for failure messages and -s runs: cause, status, residuals
    against the floor, what verified it or the closest tries."""
    details = finding.get("details") or {}
    tried = details.get("tried") or details.get("ruled_out") or []
    closest = sorted(tried, key=lambda t: t["residual_after"] / max(t["floor"], 1e-12))[:4]
    return (
        f"{finding['cause']} {finding['status']} before={finding.get('residual_before')} "
        f"after={finding.get('residual_after')} floor={finding.get('floor')} "
        f"by={details.get('verified_by')} tried="
        + "; ".join(
            f"{t['kind']} {t['params']} {t['residual_before']:.3g}->{t['residual_after']:.3g} "
            f"(floor {t['floor']:.3g})"
            for t in closest
        )
    )


def the_finding(report, cause) -> dict:
    """The one fault finding, verified as ``cause`` and reproduced to the floor from a drift
    far above it; printed (pytest -s) with its numbers."""
    found = faults_of(report)
    assert len(found) == 1, [said(f) for f in found]
    (finding,) = found
    print("FAMILY", said(finding))
    assert finding["cause"] == cause and finding["status"] == "verified", said(finding)
    assert finding["residual_after"] <= 3 * finding["floor"], said(finding)
    assert finding["residual_before"] > 10 * finding["residual_after"], said(finding)
    return finding


def replay_of(run_dir, dtype: str, calibration) -> tuple:
    """The run's replay in ``dtype`` and, under bf16 noise, the calibration to judge it by."""
    more = ("--calibration", calibration) if dtype == "bfloat16" else ()
    return run_dir / f"replay-{dtype}.parquet", more


@pytest.mark.parametrize(
    ("how", "counted_positions"),
    [
        # transformers' forward on a left-padded batch given no mask: positions from the pad
        ("longest first, batches of 3, pad id 0", True),
        # the mask was used for the position ids, then not passed to attention
        ("fixture order reversed, batches of 5, pad id = eos", False),
    ],
)
def test_attended_left_padding_is_verified_whatever_the_engines_batches(
    run_dir, tiny_model, tmp_path, how, counted_positions
):
    fixture = read_table(run_dir / "fixture.parquet")
    lengths = [
        len(fixture.prompt_of(r)) + len(fixture.completion_of(r))
        for r in range(fixture.num_sequences)
    ]
    if counted_positions:
        order, size, pad_id = list(np.argsort(lengths, kind="stable")[::-1]), 3, 0
    else:
        order, size, pad_id = list(range(fixture.num_sequences))[::-1], 5, 2
    padded = left_padded_rollout(tiny_model, fixture, order, size, pad_id, counted_positions)
    write_table(padded, tmp_path / "padded.parquet")
    report = diagnose(
        tmp_path / "padded.parquet", run_dir / "replay-float32.parquet", tmp_path / "d"
    )
    (finding,) = faults_of(report)
    assert finding["cause"] == "mask_padding" and finding["status"] == "verified", how
    assert finding["residual_after"] <= 3 * finding["floor"]
    assert finding["residual_before"] > 30 * finding["residual_after"]
    verified = finding["details"]["verified_by"]
    if verified["kind"] == "left_pad":  # searched: the positions and pad id recovered too
        assert verified["params"]["shifted"] is counted_positions
        assert verified["params"]["pad_id"] == pad_id


@pytest.fixture(scope="module")
def sampled_rollout(tiny_model, prompts, tmp_path_factory):
    """Rollouts sampled with a truncation or a temperature by the HF engine, logprobs
    processed, written as a dump that does not record its sampling (as many an ingested one
    does)."""
    from pipeline.engines.base import SamplingParams
    from pipeline.engines.hf.replay import HFScoringEngine
    from pipeline.engines.hf.rollout import HFRolloutEngine

    out = tmp_path_factory.mktemp("sampled")

    def make(**processing) -> tuple:
        name = "-".join(f"{k}{v}" for k, v in processing.items())
        fixture_path = out / f"{name}.parquet"
        if not fixture_path.exists():
            sampling = SamplingParams(
                max_tokens=24, seed=3, samples_per_prompt=2, logprobs_mode="processed",
                **processing,
            )  # fmt: skip
            fixture = HFRolloutEngine().rollout(tiny_model, prompts, sampling, {})
            fixture.metadata = {**fixture.metadata, "sampling": {}}
            fixture.channels = {"rollout": fixture.channels["rollout"]}
            write_table(fixture, fixture_path)
            write_table(
                HFScoringEngine().score(fixture, tiny_model, {"dtype": "float32"}),
                out / f"{name}-replay.parquet",
            )
        return fixture_path, out / f"{name}-replay.parquet"

    return make


@pytest.mark.parametrize(
    ("truncation", "cause", "check"),
    [
        ({"top_p": 0.9}, "top_p", lambda params: 0.85 < params["p"] <= 0.9 + 1e-6),
        ({"top_p": 0.7}, "top_p", lambda params: 0.6 < params["p"] <= 0.7 + 1e-6),
        ({"top_k": 20}, "top_k", lambda params: params["k"] == 20),
    ],
)
def test_a_truncation_the_dump_does_not_record_is_searched_and_verified(
    sampled_rollout, tmp_path, truncation, cause, check
):
    fixture, replay = sampled_rollout(**truncation)
    report = diagnose(fixture, replay, tmp_path / "d")
    found = faults_of(report)
    assert len(found) == 1, [(f["cause"], f["status"], f["evidence"][-300:]) for f in found]
    (finding,) = found
    assert finding["cause"] == cause and finding["status"] == "verified", finding["evidence"]
    params = finding["details"]["verified_by"]["params"]
    assert params["searched"] is True and check(params), params
    assert finding["residual_after"] <= 3 * finding["floor"]


# --- temperature ---------------------------------------------------------------------------


def test_a_temperature_the_dump_does_not_record_is_searched_and_verified(sampled_rollout, tmp_path):
    """The HF engine sampled at T = 0.7 and returned processed logprobs; the dump says
    nothing of its sampling."""
    fixture, replay = sampled_rollout(temperature=0.7)
    finding = the_finding(diagnose(fixture, replay, tmp_path / "d"), "temperature")
    verified = finding["details"]["verified_by"]
    assert verified["side"] == "rollout" and abs(verified["params"]["T"] - 0.7) < 1e-3, verified


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_temperature_applied_to_logprobs_is_verified(
    run_dir, tiny_model, bf16_calibration, tmp_path, dtype
):
    """An engine that divides float64 logprobs by T = 1.4 and normalises again, every
    sequence, against the fp32 replay and under the bf16 replay's noise."""
    base = read_table(run_dir / "fixture.parquet")
    hot = rescored(tiny_model, base, range(base.num_sequences), temperature_after_log_softmax(1.4))
    write_table(hot, tmp_path / "hot.parquet")
    replay, more = replay_of(run_dir, dtype, bf16_calibration)
    report = diagnose(tmp_path / "hot.parquet", replay, tmp_path / "d", *more)
    finding = the_finding(report, "temperature")
    verified = finding["details"]["verified_by"]
    assert verified["side"] == "rollout" and abs(verified["params"]["T"] - 1.4) < 2e-3, verified


# --- positions -----------------------------------------------------------------------------

POSITIONED = (1, 6, 11)  # the rows a position bug is committed on


def _positions_diagnosis(run_dir, tiny_model, tmp_path, score, dtype="float32", calibration=None):
    base = read_table(run_dir / "fixture.parquet")
    moved = rescored(tiny_model, base, POSITIONED, score)
    write_table(moved, tmp_path / "positions.parquet")
    replay, more = replay_of(run_dir, dtype, calibration)
    report = diagnose(tmp_path / "positions.parquet", replay, tmp_path / "d", *more)
    finding = the_finding(report, "position_ids")
    assert sorted(finding["sequences"]) == sorted(base.sequence_ids[r] for r in POSITIONED)
    return finding


@pytest.mark.parametrize(
    ("at", "offset", "dtype"),
    [
        (10, 16, "float32"),  # a cache as long as a 16-token block left behind
        (10, 16, "bfloat16"),
        (7, 24, "float32"),  # the stale cache another sequence of 24 tokens left
    ],
)
def test_positions_continued_from_a_stale_cache_are_verified(
    run_dir, tiny_model, bf16_calibration, tmp_path, at, offset, dtype
):
    """A KV-cache engine: prefilled at the true positions up to completion index ``at``,
    then decoded on that cache with positions counted from a stale length, ``offset`` too
    long; the onset and the offset are recovered."""
    score = cached_positions(lambda p, c: len(p) + at - 1, lambda cut: cut + offset)
    finding = _positions_diagnosis(run_dir, tiny_model, tmp_path, score, dtype, bf16_calibration)
    assert finding["details"]["verified_by"]["params"] == {"at": at, "offset": offset}


def test_positions_restarted_at_the_completion_are_verified(run_dir, tiny_model, tmp_path):
    """Prompt and completion run as two segments: the completion decoded on the prompt's
    cache with positions from 0."""
    score = cached_positions(lambda p, c: len(p), lambda cut: 0)
    finding = _positions_diagnosis(run_dir, tiny_model, tmp_path, score)
    assert finding["details"]["verified_by"]["kind"] == "positions_restart"


def test_positions_offset_from_inside_the_prompt_are_verified(run_dir, tiny_model, tmp_path):
    """Positions offset by 8 from prompt index 3 on (a system prompt's reserved positions
    counted twice): every completion token drifts from the first."""
    score = cached_positions(lambda p, c: 3, lambda cut: cut + 8)
    finding = _positions_diagnosis(run_dir, tiny_model, tmp_path, score)
    assert finding["details"]["verified_by"]["params"].get("offset") == 8


# --- token shifts --------------------------------------------------------------------------

SHIFTED = (2, 7, 12)  # the rows a shift is committed on


@pytest.mark.parametrize(
    ("shift", "dtype"), [(1, "float32"), (-1, "float32"), (-1, "bfloat16"), (1, "bfloat16")]
)
def test_logprobs_stored_one_token_off_are_verified(
    run_dir, bf16_calibration, tmp_path, shift, dtype
):
    """The dump's logprobs written one token off from completion index 9 (a numpy edit of
    the dump: written one late, +1, or read one ahead, -1; the verifier's sign: the replay's
    token t sits at the rollout's t + shift)."""
    base = read_table(run_dir / "fixture.parquet")
    write_table(
        stored_one_off(base, SHIFTED, dict.fromkeys(SHIFTED, 9), shift), tmp_path / "off.parquet"
    )
    replay, more = replay_of(run_dir, dtype, bf16_calibration)
    finding = the_finding(diagnose(tmp_path / "off.parquet", replay, tmp_path / "d", *more),
                          "token_shift")  # fmt: skip
    assert finding["details"]["verified_by"]["kind"] == f"data_shift{shift:+d}"
    assert sorted(finding["sequences"]) == sorted(base.sequence_ids[r] for r in SHIFTED)
    # written one late, the token at the onset keeps its own value: the drift starts after
    assert finding["first_position"]["position"] == 9 + (shift == 1), finding["first_position"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_labels_never_shifted_by_a_scorer_are_verified(
    run_dir, tiny_model, bf16_calibration, tmp_path, dtype
):
    """A scorer gathering logits[t] against token t from the first completion token."""
    base = read_table(run_dir / "fixture.parquet")
    write_table(rescored(tiny_model, base, SHIFTED, labels_unshifted), tmp_path / "l.parquet")
    replay, more = replay_of(run_dir, dtype, bf16_calibration)
    finding = the_finding(diagnose(tmp_path / "l.parquet", replay, tmp_path / "d", *more),
                          "token_shift")  # fmt: skip
    assert finding["details"]["verified_by"]["kind"] == "label_shift"
    assert sorted(finding["sequences"]) == sorted(base.sequence_ids[r] for r in SHIFTED)


# --- prompt edits --------------------------------------------------------------------------

EDITED = (0, 5, 9, 14)  # the rows whose prompt one side edited


@pytest.mark.parametrize(
    ("edit", "kind", "dtype"),
    [
        # the tokenizer's BOS, then a template's own BOS
        (lambda prompt: np.concatenate([[1], prompt]), "bos_extra", "float32"),
        (lambda prompt: np.concatenate([[1], prompt]), "bos_extra", "bfloat16"),
        # a tokenizer that adds no BOS
        (lambda prompt: prompt[1:], "bos_missing", "float32"),
    ],
    ids=["twice-float32", "twice-bfloat16", "missing-float32"],
)
def test_a_bos_added_twice_or_missing_is_verified(
    run_dir, tiny_model, bf16_calibration, tmp_path, edit, kind, dtype
):
    base = read_table(run_dir / "fixture.parquet")
    assert all(base.prompt_of(r)[0] == 1 for r in EDITED)  # the tokenizer's BOS is there
    write_table(rescored(tiny_model, base, EDITED, with_prompt(edit)), tmp_path / "p.parquet")
    replay, more = replay_of(run_dir, dtype, bf16_calibration)
    finding = the_finding(diagnose(tmp_path / "p.parquet", replay, tmp_path / "d", *more),
                          "prompt_mismatch")  # fmt: skip
    assert finding["details"]["verified_by"]["kind"] == kind
    assert sorted(finding["sequences"]) == sorted(base.sequence_ids[r] for r in EDITED)


TEMPLATE = "### Instruction:"  # a chat template's shared prefix, after the BOS


@pytest.fixture(scope="module")
def templated_run(tiny_model, prompts, tmp_path_factory):
    """An fp32 HF rollout and replay of prompts laid out as BOS, template prefix, text."""
    from pipeline.engines.base import SamplingParams
    from pipeline.engines.hf.replay import HFScoringEngine
    from pipeline.engines.hf.rollout import HFRolloutEngine
    from pipeline.prompts import tokenize

    out = tmp_path_factory.mktemp("templated")
    (prefix,) = tokenize(tiny_model, [TEMPLATE])
    template = prefix[1:]
    laid_out = [[p[0], *template, *p[1:]] for p in prompts]
    sampling = SamplingParams(max_tokens=16, seed=5, samples_per_prompt=1)
    fixture = HFRolloutEngine().rollout(tiny_model, laid_out, sampling, {})
    write_table(fixture, out / "fixture.parquet")
    replay = HFScoringEngine().score(fixture, tiny_model, {"dtype": "float32"})
    write_table(replay, out / "replay.parquet")
    return out, np.asarray(template)


@pytest.mark.parametrize("how", ["doubled", "missing"])
def test_a_template_prefix_doubled_or_missing_is_verified(templated_run, tiny_model, tmp_path, how):
    """The template applied to a prompt that already had it, or not applied, by the rollout
    engine (every sequence): the shared prefix after the BOS twice, or gone."""
    run, template = templated_run
    n = len(template)

    def edit(prompt):
        assert (prompt[1 : 1 + n] == template).all()
        if how == "doubled":
            return np.concatenate([prompt[:1], template, prompt[1:]])
        return np.concatenate([prompt[:1], prompt[1 + n :]])

    base = read_table(run / "fixture.parquet")
    rows = range(base.num_sequences)
    write_table(rescored(tiny_model, base, rows, with_prompt(edit)), tmp_path / "t.parquet")
    report = diagnose(tmp_path / "t.parquet", run / "replay.parquet", tmp_path / "d")
    finding = the_finding(report, "prompt_mismatch")
    assert sorted(finding["sequences"]) == sorted(base.sequence_ids)


# --- in-flight weight updates --------------------------------------------------------------


@pytest.fixture(scope="module")
def one_step(run_dir, tiny_model, tmp_path_factory):
    """(store, logprobs under version 2): the tiny model as version 1, one AdamW step on it
    as version 2, and the run's sequences scored under version 2 by the HF replay engine."""
    root = tmp_path_factory.mktemp("one-step")
    store, stepped = publish_one_step(tiny_model, run_dir / "fixture.parquet", root)
    served = root / "served.parquet"
    assert run_lpx("replay", run_dir / "fixture.parquet", "--model", stepped,
                   "--out", served).exit_code == 0  # fmt: skip
    return store, read_table(served).channels["replay"]


def switched(run_dir, later, at_of) -> object:
    """The run's rollout generated under version 1 up to completion index ``at_of(row)``,
    under version 2 after it (the fp32 replay's values before, version 2's after)."""
    fixture = read_table(run_dir / "fixture.parquet")
    values = read_table(run_dir / "replay-float32.parquet").channels["replay"].copy()
    for row in range(fixture.num_sequences):
        span = fixture.completion_slice(row)
        at = min(at_of(row), span.stop - span.start)
        values[span.start + at : span.stop] = later[span.start + at : span.stop]
    fixture.channels = {"rollout": values}
    # as lpx inject commits an update: these logprobs came from weights other than the
    # checkpoint on file, so its fingerprint is not kept as evidence that they did not
    fixture.metadata["model"] = {**fixture.metadata["model"], "weights_fingerprint": None}
    return fixture


def admitted(row: int) -> int:
    """Continuous batching: sequence ``row`` admitted 2 * (row % 6) steps after the first,
    the update landing at step 14: it switches at completion index 14 - 2 * (row % 6)."""
    return 14 - 2 * (row % 6)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_an_update_each_sequence_meets_at_its_own_index_is_verified(
    run_dir, one_step, bf16_calibration, tmp_path, dtype
):
    store, later = one_step
    write_table(switched(run_dir, later, admitted), tmp_path / "inflight.parquet")
    replay, more = replay_of(run_dir, dtype, bf16_calibration)
    report = diagnose(tmp_path / "inflight.parquet", replay, tmp_path / "d",
                      "--weights-store", store, *more)  # fmt: skip
    finding = the_finding(report, "version_change")
    assert finding["details"]["verified_by"]["params"]["version"] == "2"


@pytest.mark.parametrize("at_of", [lambda row: 12, admitted], ids=["all-at-12", "each-its-own"])
def test_an_update_without_a_store_stays_plausible(run_dir, one_step, tmp_path, at_of):
    """With no store, the weights after the update are not at hand: the finding names an
    update (or other weights), plausible, and nothing else is claimed verified."""
    _, later = one_step
    write_table(switched(run_dir, later, at_of), tmp_path / "inflight.parquet")
    report = diagnose(tmp_path / "inflight.parquet", run_dir / "replay-float32.parquet",
                      tmp_path / "d")  # fmt: skip
    found = faults_of(report)
    print("FAMILY", [said(f) for f in report["diagnosis"]])
    assert found and report["verdict"] == "fail"
    # sequences the update met late drift too little for any shape (0.0036 mean |d| on the
    # tiny model, 1.07x the constant floor): they may stay `unexplained`, never another cause
    assert {f["cause"] for f in found} <= {"version_change", "weights_differ", "unexplained"}, [
        said(f) for f in found
    ]
    (update,) = [f for f in found if f["cause"] in ("version_change", "weights_differ")]
    assert len(update["sequences"]) >= 0.75 * read_table(run_dir / "fixture.parquet").num_sequences
    assert {f["status"] for f in found} == {"plausible"}
    assert not [f for f in report["diagnosis"] if f["status"] == "verified"]
