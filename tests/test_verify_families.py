"""Hypothesis families verified on faults committed the way engines commit them, not the way
`pipeline/faults.py` re-scores them: the rollout side is scored by independent code (a plain
transformers forward over the engine's own batches, a real sampler's processed logprobs),
and `lpx diagnose` must re-create the bug by searching its parameters. Numbers: the
parameters recovered and the residual left against the floor."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.fixture.io import read_table, write_table
from tests.engine_like import left_padded_rollout
from tests.helpers import read_report, run_lpx


def diagnose(fixture, replay, out, *more) -> dict:
    result = run_lpx("diagnose", fixture, replay, "--out", out, "--quiet", *more)
    assert result.exit_code in (0, 1), result.output
    return read_report(out)


def faults_of(report) -> list[dict]:
    return [f for f in report["diagnosis"] if f["severity"] == "fault"]


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
def truncated_rollout(tiny_model, prompts, tmp_path_factory):
    """Rollouts sampled with a truncation by the HF engine, logprobs processed, written as a
    dump that does not record its sampling (as many an ingested one does)."""
    from pipeline.engines.base import SamplingParams
    from pipeline.engines.hf_replay import HFScoringEngine
    from pipeline.engines.hf_rollout import HFRolloutEngine

    out = tmp_path_factory.mktemp("truncated")

    def make(**truncation) -> tuple:
        name = "-".join(f"{k}{v}" for k, v in truncation.items())
        fixture_path = out / f"{name}.parquet"
        if not fixture_path.exists():
            sampling = SamplingParams(
                max_tokens=24, seed=3, samples_per_prompt=2, logprobs_mode="processed",
                **truncation,
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
    truncated_rollout, tmp_path, truncation, cause, check
):
    fixture, replay = truncated_rollout(**truncation)
    report = diagnose(fixture, replay, tmp_path / "d")
    found = faults_of(report)
    assert len(found) == 1, [(f["cause"], f["status"], f["evidence"][-300:]) for f in found]
    (finding,) = found
    assert finding["cause"] == cause and finding["status"] == "verified", finding["evidence"]
    params = finding["details"]["verified_by"]["params"]
    assert params["searched"] is True and check(params), params
    assert finding["residual_after"] <= 3 * finding["floor"]
