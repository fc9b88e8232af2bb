"""Findings verified by reproducing them (`lpx diagnose`, `lpx compare --model`): the real
tiny model re-scores the affected sequences with each hypothesised bug committed. Numbers:
the parameters recovered, the residual left, and what is ruled out when nothing fits."""

from __future__ import annotations

import json

import numpy as np
import pytest

from pipeline.fixture.io import read_table, write_table
from support.helpers import publish_one_step, read_report, run_lpx


@pytest.fixture(scope="module")
def faulted(run_dir, tmp_path_factory):
    """Fixtures with one planted bug each, from the shared run's fp32 HF rollout."""
    out = tmp_path_factory.mktemp("faulted")

    def plant(kind, *sequences, at=6):
        path = out / f"{kind}.parquet"
        if not path.exists():
            chosen = [a for s in sequences for a in ("--sequence", s)] or ["--sequence", "all"]
            result = run_lpx(
                "inject", run_dir / "fixture.parquet", "--kind", kind, *chosen,
                "--from-position", at, "--out", path,
            )  # fmt: skip
            assert result.exit_code == 0, result.output
        return path

    return plant


def diagnose(fixture, replay, out, *more) -> dict:
    result = run_lpx("diagnose", fixture, replay, "--out", out, "--quiet", *more)
    assert result.exit_code in (0, 1), result.output
    return read_report(out)


def only(report, cause) -> dict:
    found = [f for f in report["diagnosis"] if f["cause"] == cause]
    assert len(found) == 1, [
        (f["cause"], f["status"], f["evidence"][-200:]) for f in report["diagnosis"]
    ]
    return found[0]


def test_a_temperature_is_recovered_to_the_floor(faulted, run_dir, tmp_path):
    report = diagnose(faulted("temperature"), run_dir / "replay-float32.parquet", tmp_path / "d")
    finding = only(report, "temperature")
    assert finding["status"] == "verified" and report["verdict"] == "fail"
    verified = finding["details"]["verified_by"]
    assert verified["side"] == "rollout" and abs(verified["params"]["T"] - 0.7) < 1e-3
    assert finding["residual_before"] > 0.05
    assert finding["residual_after"] <= 3 * finding["floor"]
    assert "the bug is on the rollout side" in finding["evidence"]


def test_a_position_offset_and_its_onset_are_recovered(faulted, run_dir, tmp_path):
    path = faulted("position_ids", "0-0", "3-1", "5-0", at=6)
    report = diagnose(path, run_dir / "replay-float32.parquet", tmp_path / "d")
    finding = only(report, "position_ids")
    assert finding["status"] == "verified"
    assert finding["details"]["verified_by"]["params"] == {"at": 6, "offset": 16}
    assert finding["sequences"] == ["0-0", "3-1", "5-0"]
    assert finding["residual_after"] == pytest.approx(0.0, abs=1e-5)


def test_a_truncation_length_is_recovered(faulted, run_dir, tmp_path):
    report = diagnose(
        faulted("prompt_truncated"), run_dir / "replay-float32.parquet", tmp_path / "d"
    )
    finding = only(report, "prompt_mismatch")
    assert finding["status"] == "verified"
    verified = finding["details"]["verified_by"]
    assert verified["kind"] == "prompt_truncated"
    fixture = read_table(run_dir / "fixture.parquet")
    longest = max(len(fixture.prompt_of(i)) for i in range(fixture.num_sequences))
    assert verified["params"]["max_prompt"] == int(longest * 0.75)  # what inject cut to


def test_a_signature_the_model_does_not_reproduce_stays_plausible_with_what_was_tried(
    run_dir, tmp_path
):
    """Noise of 0.3 nats on three replay sequences, both ways: no bug re-scores into that,
    and nothing biases whole sequences as a weight change would. The signature's cause is
    kept, plausible (never worse than the signatures: a real engine commits a bug in more
    ways than re-scoring does), with every try and how far it stayed from the floor."""
    replay = read_table(run_dir / "replay-float32.parquet")
    replay.channels["replay"] = replay.channels["replay"].copy()
    rng = np.random.default_rng(0)
    for row in (1, 4, 9):
        span = replay.completion_slice(row)
        noise = rng.normal(0, 0.3, span.stop - span.start).astype(np.float32)
        values = replay.channels["replay"][span] + noise
        replay.channels["replay"][span] = np.minimum(values, 0.0)  # logprobs stay <= 0
    write_table(replay, tmp_path / "noisy.parquet")
    report = diagnose(run_dir / "fixture.parquet", tmp_path / "noisy.parquet", tmp_path / "d")
    (kept,) = [f for f in report["diagnosis"] if f["severity"] == "fault"]
    assert kept["status"] == "plausible" and report["verdict"] == "fail"
    assert "no reproduction verified it" in kept["evidence"]
    tried = kept["details"]["tried"]
    assert {"bos_extra", "bos_missing", "positions_restart", "label_shift"} <= {
        t["kind"] for t in tried
    }
    assert all(t["residual_after"] > 3 * t["floor"] for t in tried)
    assert set(kept["sequences"]) <= {replay.sequence_ids[r] for r in (1, 4, 9)}
    assert all(f["status"] != "verified" for f in report["diagnosis"])


def test_logprobs_near_zero_are_not_a_fill(run_dir, bf16_calibration, tmp_path):
    """A rollout far more confident than the bf16 replay (logprobs within ~0.01 of 0, as
    after a step on these very sequences) is not "filled with 0", though that is within
    bf16's noise floor: a fill writes its constant exactly."""
    fixture = read_table(run_dir / "fixture.parquet")
    values = fixture.channels["rollout"].copy()
    for row in (2, 5, 7):
        span = fixture.completion_slice(row)
        values[span] = -np.abs(np.random.default_rng(row).normal(0, 0.01, span.stop - span.start))
    fixture.channels = {"rollout": values}
    write_table(fixture, tmp_path / "confident.parquet")
    report = diagnose(
        tmp_path / "confident.parquet", run_dir / "replay-bfloat16.parquet", tmp_path / "d",
        "--calibration", bf16_calibration,
    )  # fmt: skip
    fills = [
        t for f in report["diagnosis"]
        for key in ("ruled_out", "tried") for t in (f.get("details") or {}).get(key, [])
        if t["kind"] == "data_fill" and t["params"]["side"] == "rollout"
    ]  # fmt: skip
    assert fills and all(0.002 < t["residual_after"] < 0.02 for t in fills)
    assert all(t["floor"] == 1e-6 for t in fills)
    assert not [f for f in report["diagnosis"] if f["status"] == "verified"]
    assert report["verdict"] == "fail"


def test_without_verifying_findings_stay_plausible(faulted, run_dir, tmp_path):
    result = run_lpx(
        "compare",
        faulted("temperature"),
        run_dir / "replay-float32.parquet",
        "--no-verify",
        "--out",
        tmp_path / "c",
    )
    assert result.exit_code == 1
    report = read_report(tmp_path / "c")
    # nothing verified; a claim the evidence on file contradicts (stale weights where both
    # sides loaded one checkpoint and record no update) is ruled out, never verified
    assert {f["status"] for f in report["diagnosis"]} <= {"plausible", "ruled_out"}
    assert [f["status"] for f in report["diagnosis"] if f["severity"] == "fault"] == ["plausible"]
    assert report["verification"] == {"ran": False, "reason": "--no-verify"}


def test_a_verification_budget_that_runs_out_leaves_findings_as_the_signatures_said(
    faulted, run_dir, tmp_path
):
    """--verify-budget: no hypothesis starts after it; what was left is listed, and the
    findings it would have tested stay as compare named them (plausible), never worse."""
    replay = run_dir / "replay-float32.parquet"
    spent = run_lpx(
        "compare", faulted("temperature"), replay, "--verify-budget", "0.000001",
        "--out", tmp_path / "spent",
    )  # fmt: skip
    assert spent.exit_code == 1, spent.output
    report = read_report(tmp_path / "spent")
    note = report["verification"]
    assert note["ran"] and note["out_of_budget"] and note["budget_s"] == 1e-6
    assert "temperature" in {t["kind"] for t in note["not_tried"]}
    plain = run_lpx(
        "compare", faulted("temperature"), replay, "--no-verify", "--out", tmp_path / "plain"
    )
    assert plain.exit_code == 1, plain.output
    said = [(f["cause"], f["status"]) for f in read_report(tmp_path / "plain")["diagnosis"]]
    assert [(f["cause"], f["status"]) for f in report["diagnosis"]] == said
    # every claim verification would have tested (a claim the evidence on file contradicts
    # was ruled out before it, and is kept as said)
    faults = [f for f in report["diagnosis"] if f["severity"] == "fault"]
    assert faults and all(f["details"]["over_budget"] for f in faults)
    assert "budget (1e-06 s, --verify-budget) ran out" in spent.output
    # a budget that lasts: the same answer as none
    ample = run_lpx(
        "compare", faulted("temperature"), replay, "--verify-budget", "600",
        "--out", tmp_path / "ample", "--quiet",
    )  # fmt: skip
    assert ample.exit_code == 1, ample.output
    report = read_report(tmp_path / "ample")
    assert only(report, "temperature")["status"] == "verified"
    assert report["verification"]["out_of_budget"] is False
    assert report["verification"]["not_tried"] == []
    refused = run_lpx("compare", faulted("temperature"), replay, "--verify-budget", "5",
                      "--no-verify", "--out", tmp_path / "x")  # fmt: skip
    assert refused.exit_code == 2 and "contradict" in refused.output


def test_compare_verifies_with_the_fixtures_model_by_default(faulted, run_dir, tmp_path):
    result = run_lpx(
        "compare", faulted("temperature"), run_dir / "replay-float32.parquet",
        "--out", tmp_path / "c",
    )  # fmt: skip
    assert result.exit_code == 1
    report = read_report(tmp_path / "c")
    assert (
        report["verification"]["ran"] and report["verification"]["source"] == "the fixture's model"
    )
    (finding,) = [f for f in report["diagnosis"] if f["status"] == "verified"]
    assert finding["cause"] == "temperature"


def test_verified_under_bf16_noise_with_a_calibration(faulted, run_dir, bf16_calibration, tmp_path):
    calibration = bf16_calibration
    report = diagnose(
        faulted("temperature"), run_dir / "replay-bfloat16.parquet", tmp_path / "d",
        "--calibration", calibration,
    )  # fmt: skip
    finding = only(report, "temperature")
    assert finding["status"] == "verified"
    floor = json.loads(calibration.read_text())["pairs"]["float32|float32"]["all"]["mean"]
    assert finding["floor"] == pytest.approx(floor, rel=1.0)  # the fp32 side's own floor
    assert abs(finding["details"]["verified_by"]["params"]["T"] - 0.7) < 1e-3
    assert report["calibration"]["used"]


def test_stale_weights_are_verified_against_the_weight_store(run_dir, tiny_model, tmp_path):
    """The rollout served one AdamW step later (version 2) than the replay's weights
    (version 1): re-scored under each published version, version 2 reproduces it."""
    store, stepped = publish_one_step(tiny_model, run_dir / "fixture.parquet", tmp_path)
    fixture = read_table(run_dir / "fixture.parquet")
    served = tmp_path / "served.parquet"
    assert (
        run_lpx(
            "replay", run_dir / "fixture.parquet", "--model", stepped, "--out", served
        ).exit_code
        == 0
    )
    fixture.channels = {"rollout": read_table(served).channels["replay"].copy()}
    write_table(fixture, tmp_path / "stale.parquet")

    without = diagnose(
        tmp_path / "stale.parquet", run_dir / "replay-float32.parquet", tmp_path / "a"
    )
    assert not [f for f in without["diagnosis"] if f["status"] == "verified"]
    report = diagnose(
        tmp_path / "stale.parquet", run_dir / "replay-float32.parquet", tmp_path / "b",
        "--weights-store", store,
    )  # fmt: skip
    finding = only(report, "stale_weights")
    assert finding["status"] == "verified"
    assert finding["details"]["verified_by"]["params"] == {"version": "2"}
    assert finding["residual_after"] == pytest.approx(0.0, abs=1e-5)


def test_a_weights_store_needs_the_model_and_a_store(run_dir, tmp_path):
    fixture, replay = run_dir / "fixture.parquet", run_dir / "replay-float32.parquet"
    result = run_lpx(
        "compare", fixture, replay, "--weights-store", tmp_path, "--out", tmp_path / "a"
    )
    assert result.exit_code == 2 and "add --model DIR" in result.output
    result = run_lpx("diagnose", fixture, replay, "--weights-store", tmp_path / "none",
                     "--out", tmp_path / "b")  # fmt: skip
    assert result.exit_code == 2 and "not a weight store" in result.output
    assert not (tmp_path / "b" / "report.json").exists()


@pytest.mark.parametrize(
    ("recorded", "guessed", "kind", "named"),
    [
        ({"top_p": 0.8}, "top_k", "top_p", "top_p"),
        ({"top_k": 8}, "top_p", "top_k", "top_k"),
        ({"top_k": 8, "top_p": 0.8}, "top_p", "top_k_top_p", "top_k"),
    ],
)
def test_a_truncation_is_named_by_what_the_rollout_recorded(
    run_dir, tiny_model, recorded, guessed, kind, named
):
    """The signature guesses top-k or top-p; the re-score uses the fixture's recorded
    truncation, and a reproduction names that (top-k then top-p: both, by _both_truncations)."""
    from pipeline.contracts.report import Finding
    from pipeline.verify import Verifier

    fixture = read_table(run_dir / "fixture.parquet")
    fixture.metadata = {**fixture.metadata, "sampling": {**recorded}}
    verifier = Verifier(fixture, read_table(run_dir / "replay-float32.parquet"), tiny_model)
    candidate, *searched = verifier.candidates(Finding(cause=guessed))
    assert (candidate.kind, candidate.cause) == (kind, named)
    # then, should the recorded one not reproduce, the truncation searched for, guess first
    assert [c.kind for c in searched] == [
        f"{guessed}_search",
        f"{({'top_k', 'top_p'} - {guessed}).pop()}_search",
    ]
    assert candidate.settings.top_k == recorded.get("top_k", verifier.base.top_k)


@pytest.mark.parametrize("shift", [1, -1])
@pytest.mark.parametrize("onset", [0, 3, 17, 47])
def test_a_shift_starts_at_its_change_point_under_noise(shift, onset):
    """Logprobs moved one token from `onset` on, against a replay with noise of 0.02 nats:
    the change point finds the onset exactly, also where the first shifted tokens score
    within 0.1 of their neighbours, too little to drift past a bf16 tau."""
    from pipeline.verify import shift_onset

    rng = np.random.default_rng(onset)
    true = -np.abs(rng.normal(0, 2, 48)) - 1.0
    for t in range(max(onset - 1, 0), min(onset + 4, 47)):  # alike around the onset
        true[t + 1] = true[t] + 0.1
    replay = true + rng.normal(0, 0.02, 48)
    rollout = true.copy()
    for t in range(onset, 48):
        if 0 <= t - shift < 48:
            rollout[t] = true[t - shift]
    assert shift_onset(rollout, replay, shift) == onset


def test_a_logprob_shift_is_verified_from_its_onset_under_bf16_noise(
    faulted, run_dir, bf16_calibration, tmp_path
):
    """Logprobs moved one token from index 9 in three sequences, against the bf16 replay:
    the shift reproduces to the floor (the token at the onset, whose neighbour was never
    moved, is not held against it), and the onset is the change point."""
    fixture = faulted("token_shift", "1-0", "4-1", "6-0", at=9)
    report = diagnose(
        fixture, run_dir / "replay-bfloat16.parquet", tmp_path / "d",
        "--calibration", bf16_calibration,
    )  # fmt: skip
    finding = only(report, "token_shift")
    assert finding["status"] == "verified", finding["evidence"][-300:]
    assert sorted(finding["sequences"]) == ["1-0", "4-1", "6-0"]
    assert abs(finding["first_position"]["position"] - 9) <= 1
    assert finding["residual_after"] <= 3 * finding["floor"] < finding["residual_before"] / 10


def test_an_in_flight_update_is_verified_against_the_weight_store(run_dir, tiny_model, tmp_path):
    """Every sequence generated under version 1 up to completion index 12 and under version
    2 after it: re-scored under the store's version 2 from the onset, it reproduces."""
    store, stepped = publish_one_step(tiny_model, run_dir / "fixture.parquet", tmp_path)
    served = tmp_path / "served.parquet"
    assert run_lpx("replay", run_dir / "fixture.parquet", "--model", stepped,
                   "--out", served).exit_code == 0  # fmt: skip
    fixture = read_table(run_dir / "fixture.parquet")
    values = read_table(run_dir / "replay-float32.parquet").channels["replay"].copy()
    later = read_table(served).channels["replay"]
    for row in range(fixture.num_sequences):
        span = fixture.completion_slice(row)
        values[span.start + 12 : span.stop] = later[span.start + 12 : span.stop]
    fixture.channels = {"rollout": values}
    # as lpx inject commits an update: these logprobs came from weights other than the
    # checkpoint on file, so its fingerprint is not kept as evidence that they did not
    fixture.metadata["model"] = {**fixture.metadata["model"], "weights_fingerprint": None}
    write_table(fixture, tmp_path / "inflight.parquet")
    report = diagnose(
        tmp_path / "inflight.parquet", run_dir / "replay-float32.parquet", tmp_path / "d",
        "--weights-store", store,
    )  # fmt: skip
    finding = only(report, "version_change")
    assert finding["status"] == "verified", finding["evidence"][-300:]
    assert finding["details"]["verified_by"]["params"] == {"version": "2", "at": 12}
    assert finding["residual_after"] == pytest.approx(0.0, abs=1e-5)


def test_a_wrong_hypothesis_is_ruled_out_on_the_screen_and_a_true_one_judged_on_all(
    faulted, run_dir, tiny_model, monkeypatch
):
    """The screen (judge.py) re-scores two of a finding's sixteen sequences first. A wrong
    hypothesis (an extra BOS, for a rollout sampled at T 0.7) is ruled out there, far from
    the floor, and judged on all sixteen it is ruled out too; the true one (the temperature)
    passes the screen and verifies on all sixteen, as without the screen."""
    from pipeline.contracts.causes import Cause
    from pipeline.verify import judge as judging
    from pipeline.verify.flow import Verifier
    from pipeline.verify.hypothesis import Candidate

    fixture = read_table(faulted("temperature"))
    replay = read_table(run_dir / "replay-float32.parquet")
    ref = Verifier(fixture, replay, tiny_model).ref
    ids = list(fixture.sequence_ids)
    assert len(ids) == 16
    bos = Candidate(Cause.PROMPT_MISMATCH, "bos_extra", ref.base, {"extra_leading": 1})
    screened = judging.judge(ref, bos, ids)
    assert screened.screened_on == 2 and not screened.verified
    assert screened.after > judging.SCREEN_SLACK * judging.VERIFY_MARGIN * screened.floor
    temperature = Candidate(Cause.TEMPERATURE, "temperature", ref.base, {})
    true = judging.judge(ref, temperature, ids)
    assert true.verified and true.screened_on == 0
    assert abs(true.candidate.params["T"] - 0.7) < 1e-3
    from pipeline.verify import sides

    monkeypatch.setattr(sides, "SCREEN_SEQUENCES", 16)  # the screen off
    whole = judging.judge(ref, bos, ids)
    assert whole.screened_on == 0 and not whole.verified
    assert whole.after > judging.VERIFY_MARGIN * whole.floor
