"""Reduced-precision rollouts end to end on the tiny model, with the HF engine's exact
emulation as the rollout engine (the real engines' own runs: test_reduced_precision_engines):
declared numerics are recorded, calibrated and passed as what they give; a fault on top of
them still fails and is named; undeclared numerics are named with their format; and the
case key, the series label and the matrix keep FP8 apart from bf16."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.calibrate.run import calibrate
from pipeline.compare.run import compare_tables
from pipeline.engines.base import SamplingParams
from pipeline.engines.hf.replay import HFScoringEngine
from pipeline.engines.hf.rollout import HFRolloutEngine
from pipeline.faults import FaultSettings, rescore
from pipeline.fixture.io import read_table, write_table
from pipeline.verify import verify_report

SAMPLING = SamplingParams(max_tokens=48, seed=0, samples_per_prompt=3, ignore_eos=True)
FP8 = {"quantization": "fp8-block", "kv_cache_dtype": "fp8_e4m3"}


@pytest.fixture(scope="module")
def runs(tiny_model, prompts, tmp_path_factory):
    """A bf16 rollout computed with FP8 blocks and an FP8 KV cache (declared), the same
    tokens with the numerics left out of its metadata (undeclared), KV-only, and the clean
    bf16 and fp32 HF replays; calibrations of the declared numerics and of plain bf16."""
    out = tmp_path_factory.mktemp("reduced")
    declared = HFRolloutEngine().rollout(tiny_model, prompts, SAMPLING, {"dtype": "bf16", **FP8})
    kv_only = HFRolloutEngine().rollout(
        tiny_model, prompts, SAMPLING, {"dtype": "bf16", "kv_cache_dtype": "fp8_e4m3"}
    )
    tables = {
        "declared": declared,
        "undeclared": _undeclared(declared),
        "kv_undeclared": _undeclared(kv_only),
    }
    for dtype in ("bf16", "fp32"):
        tables[f"replay-{dtype}"] = HFScoringEngine().score(declared, tiny_model, {"dtype": dtype})
        tables[f"kv-replay-{dtype}"] = HFScoringEngine().score(kv_only, tiny_model,
                                                               {"dtype": dtype})  # fmt: skip
    for name, table in tables.items():
        write_table(table, out / f"{name}.parquet")
    return {
        "dir": out,
        "tables": {name: read_table(out / f"{name}.parquet") for name in tables},
        "calibration": calibrate(
            read_table(out / "declared.parquet"),
            tiny_model,
            ["bfloat16", "bfloat16+fp8-block+kv=fp8_e4m3"],
            sequences=24,
        ),  # fmt: skip
        "plain": calibrate(
            read_table(out / "undeclared.parquet"), tiny_model, ["bfloat16"], sequences=24
        ),  # fmt: skip
    }


def _undeclared(table):
    """The same tokens and logprobs, their numerics left out of the metadata: an engine
    that computed FP8 and says nothing of it."""
    copy = read_table_copy(table)
    copy.metadata = {k: v for k, v in table.metadata.items() if k != "numerics"}
    copy.metadata["knobs"] = {
        k: v for k, v in table.metadata["knobs"].items() if k not in FP8 and k != "kv_scales"
    }
    return copy


def read_table_copy(table):
    from dataclasses import replace

    return replace(table, metadata=dict(table.metadata))


def test_declared_numerics_are_recorded_as_computed(runs):
    numerics = runs["tables"]["declared"].metadata["numerics"]
    assert numerics["text"] == "fp8_e4m3:w=block128,a=group128+kv=fp8_e4m3"
    assert numerics["label"] == "fp8-block + kv fp8_e4m3"
    assert numerics["computed_by"].startswith("lpx emulation")
    assert runs["tables"]["declared"].metadata["knobs"]["attn_implementation"] == "lpx_kv_sdpa"
    assert "numerics" not in runs["tables"]["replay-bf16"].metadata


def test_a_clean_fp8_rollout_passes_with_a_calibration_of_its_numerics(runs):
    tables = runs["tables"]
    pair = "bfloat16|bfloat16+fp8_e4m3:w=block128,a=group128+kv=fp8_e4m3"
    assert pair in runs["calibration"]["pairs"]
    fp8_floor = runs["calibration"]["pairs"][pair]["all"]["mean"]
    bf16_floor = runs["calibration"]["pairs"]["bfloat16|bfloat16"]["all"]["mean"]
    # measured on the tiny model: FP8 blocks and cache 0.034 mean |d| against bf16's 0.006
    assert fp8_floor > 3 * bf16_floor
    report = compare_tables(tables["declared"], tables["replay-bf16"], "f", "r",
                            calibration=runs["calibration"]).report  # fmt: skip
    assert report.verdict == "pass", report.policy["violations"]
    assert report.calibration["pair"] == pair
    assert report.precision_gate["passed"]
    # a calibration of plain bf16 does not cover it: the report says which pair to measure,
    # and the bf16 profile's constants call the same drift a fault
    uncovered = compare_tables(tables["declared"], tables["replay-bf16"], "f", "r",
                               calibration=runs["plain"]).report  # fmt: skip
    assert uncovered.verdict == "fail" and uncovered.policy["profile"] == "bfloat16"
    assert f"not {pair}" in uncovered.calibration["reason"]
    correction = report.correction["rollout_corr"]
    assert (
        0.9 < correction["rollout_is_mean"] < 1.1 and correction["rollout_is_eff_sample_size"] > 0.9
    )


@pytest.mark.parametrize("kind", ["temperature", "position_ids"])
def test_a_fault_on_top_of_fp8_still_fails_and_is_named(runs, tiny_model, kind):
    """The rollout computed with FP8 and also committed a bug: its logprobs processed at
    temperature 0.7, or its positions offset from completion index 8 (faults.py's, committed
    in the FP8 model)."""
    from pipeline.engines.hf.model import load_model
    from pipeline.engines.hf.replay import ReplayKnobs

    tables = runs["tables"]
    fixture = read_table_copy(tables["declared"])
    numerics = ReplayKnobs.from_dict({"dtype": "bf16", **FP8}).numerics()
    model = load_model(tiny_model, "bfloat16", numerics=numerics)
    rows = list(range(0, fixture.num_sequences, 2))
    pairs = [(fixture.prompt_of(r), fixture.completion_of(r)) for r in rows]
    faulted = rescore(model, pairs, kind, FaultSettings())
    channel = np.array(fixture.channels["rollout"], copy=True)
    for row, values in zip(rows, faulted, strict=True):
        channel[fixture.completion_slice(row)] = values
    fixture.channels = {**fixture.channels, "rollout": channel}
    comparison = compare_tables(fixture, tables["replay-bf16"], "f", "r",
                                calibration=runs["calibration"])  # fmt: skip
    report = comparison.report
    assert report.verdict == "fail"
    verify_report(report, fixture, tables["replay-bf16"], tiny_model,
                  calibration=runs["calibration"])  # fmt: skip
    causes = {str(f.cause): f for f in report.diagnosis if f.is_fault}
    named = kind
    assert named in causes and causes[named].verified, [
        (str(f.cause), str(f.status)) for f in report.diagnosis
    ]
    assert report.verdict == "fail"
    assert not {"quantization", "kv_cache_precision"} & set(causes)


@pytest.mark.parametrize("replay_dtype", ["bf16", "fp32"])
def test_undeclared_numerics_are_named_with_their_format(runs, tiny_model, replay_dtype):
    tables = runs["tables"]
    cases = (
        ("undeclared", f"replay-{replay_dtype}", "quantization",
         "fp8_e4m3:w=block128,a=group128+kv=fp8_e4m3"),
        ("kv_undeclared", f"kv-replay-{replay_dtype}", "kv_cache_precision", "kv=fp8_e4m3"),
    )  # fmt: skip
    for fixture_name, replay_name, cause, found in cases:
        fixture, replay = tables[fixture_name], tables[replay_name]
        report = compare_tables(fixture, replay, "f", "r", calibration=runs["plain"]).report
        assert report.verdict == "fail"
        verify_report(report, fixture, replay, tiny_model, calibration=runs["plain"])
        faults = [f for f in report.diagnosis if f.is_fault]
        assert [str(f.cause) for f in faults] == [cause], [
            (str(f.cause), str(f.status), f.evidence[-300:]) for f in report.diagnosis
        ]
        params = faults[0].details["verified_by"]["params"]
        assert faults[0].verified and params["found"] == found and params["side"] == "rollout"
        assert "does not declare" in faults[0].evidence
        assert report.verdict == "fail"


def test_history_keys_an_fp8_rollout_apart_and_labels_it(runs):
    from pipeline.history.keys import case_key, describe_case, series_label

    declared, plain = runs["tables"]["declared"], runs["tables"]["undeclared"]
    replay = runs["tables"]["replay-bf16"]

    def case(fixture):
        return describe_case({"fixture": fixture.metadata, "replay": replay.metadata})

    fp8, bf16 = case(declared), case(plain)
    assert fp8["rollout_numerics"] == declared.metadata["numerics"]["text"]
    assert bf16["rollout_numerics"] is None and bf16["replay_numerics"] is None
    assert case_key(fp8) != case_key(bf16)
    # a case without numerics keys as it did before numerics were recorded
    before = {k: v for k, v in bf16.items() if k not in ("rollout_numerics", "replay_numerics")}
    assert case_key(before) == case_key(bf16)
    label = series_label(fp8, "hf", "hf", "cpu")
    assert label.startswith("hf bfloat16 fp8-block + kv fp8_e4m3 vs hf bfloat16")
