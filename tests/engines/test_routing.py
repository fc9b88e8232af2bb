"""Routing as data on real MoE models: the experts each token went to, recorded by the HF
rollout (decode) and replay (prefill), stored in the fixture, compared per layer; a seeded
routing flip named `routing_flip` and verified by re-scoring with the flipped experts forced;
router replay (R3) removing the flips a bf16 replay makes on its own."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.engines.base import SamplingParams
from pipeline.engines.hf.replay import HFScoringEngine
from pipeline.engines.hf.rollout import HFRolloutEngine
from pipeline.errors import BadInput
from pipeline.fixture.io import read_table, write_table
from pipeline.fixture.table import select_sequences
from pipeline.prompts import smoke_prompt_texts, tokenize
from pipeline.routing import agreement, completion_rows, routing_offsets
from support.helpers import read_report, run_lpx

SEEDED_LAYER = 1
SEEDED_FRACTION = 0.10  # of positions whose second expert the seeded fault swaps


def test_agreement_counts_set_differences_per_layer_and_splits_the_drift():
    rollout = np.array([[[0, 1], [2, 3]], [[0, 1], [2, 3]], [[4, 5], [6, 7]]])
    replay = np.array([[[1, 0], [2, 3]], [[0, 1], [2, 4]], [[4, 5], [6, 7]]])  # order is no flip
    result = agreement(rollout, replay, [3, 5], np.array([0, 0, 1]), np.array([0, 1, 0]),
                       ["a", "b"], np.array([0.01, 0.5, 0.03]))  # fmt: skip
    assert [layer["flips"] for layer in result["layers"]] == [0, 1]
    assert result["layers"][1] == {"layer": 5, "flip_rate": pytest.approx(1 / 3), "flips": 1}
    assert result["first_flip"] == {"sequence_id": "a", "position": 1, "layer": 5}
    assert result["drift_on_flipped"]["mean_abs_diff"] == pytest.approx(0.5)
    assert result["drift_on_rest"]["mean_abs_diff"] == pytest.approx(0.02)


def test_completion_rows_are_the_positions_that_produced_each_token():
    prompts, completions = np.array([0, 3, 5]), np.array([0, 2, 5])  # (3 + 2) and (2 + 3)
    assert routing_offsets(prompts, completions).tolist() == [0, 4, 8]
    # sequence 0: rows 2, 3 (prompt's last position, then the first completion token)
    assert completion_rows(prompts, completions).tolist() == [2, 3, 5, 6, 7]


@pytest.fixture(scope="module")
def moe_run(family_model, tmp_path_factory):
    """A Qwen3-MoE fp32 rollout with its routing, its calibration, and three bf16 replays:
    plain, with a seeded routing flip on one layer (an engine that breaks near-ties another
    way, hidden as a real engine would), and with the rollout's routing forced (R3)."""
    model = family_model("qwen3_moe")
    out = tmp_path_factory.mktemp("routing")
    sampling = SamplingParams(max_tokens=48, samples_per_prompt=4, seed=0, ignore_eos=True)
    fixture = HFRolloutEngine().rollout(model, tokenize(model, smoke_prompt_texts()), sampling, {})
    write_table(fixture, out / "fixture.parquet")
    bf16 = {"dtype": "bfloat16", "device": "cpu"}
    write_table(HFScoringEngine().score(fixture, model, bf16), out / "replay-plain.parquet")
    seeded = read_table(out / "fixture.parquet")
    seeded.routed_experts = _seeded_flip(seeded.routed_experts)
    flipped = HFScoringEngine().score(seeded, model, {**bf16, "router_replay": True})
    flipped.metadata["knobs"]["router_replay"] = False  # the engine does not say it
    flipped.routed_experts = seeded.routed_experts
    write_table(flipped, out / "replay-flip.parquet")
    done = run_lpx("replay", out / "fixture.parquet", "--model", model, "--dtype", "bf16",
                   "--set", "router_replay=true", "--out", out / "replay-r3.parquet")  # fmt: skip
    assert done.exit_code == 0, done.output
    done = run_lpx("calibrate", out / "fixture.parquet", "--out", out / "calibration.json")
    assert done.exit_code == 0, done.output
    return out


def _seeded_flip(routed: np.ndarray, fraction=SEEDED_FRACTION, seed=0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    out = routed.copy()
    chosen = rng.random(len(out)) < fraction
    first, second = out[:, SEEDED_LAYER, 0], out[:, SEEDED_LAYER, 1]
    other = (second + rng.integers(1, 8, len(out))) % 8
    other = np.where(other == first, (other + 1) % 8, other)
    out[chosen, SEEDED_LAYER, 1] = other[chosen]
    return np.sort(out, axis=-1)


def test_decode_and_prefill_record_the_same_experts_in_fp32(moe_run, family_model):
    fixture = read_table(moe_run / "fixture.parquet")
    assert fixture.metadata["routing"] == {
        "layers": [0, 1], "top_k": 2, "num_experts": 8, "source": "hf rollout (decode)"
    }  # fmt: skip
    rows = np.diff(routing_offsets(fixture.prompt_offsets, fixture.completion_offsets))
    assert fixture.routed_experts.shape == (int(rows.sum()), 2, 2)
    replay = HFScoringEngine().score(fixture, family_model("qwen3_moe"), {"device": "cpu"})
    # measured: 100 % of 32 x (prompt + 48) positions agree between KV-cache decode and prefill
    assert np.array_equal(replay.routed_experts, fixture.routed_experts)
    cut = select_sequences(fixture, [3, 1], completion_lengths=[5, 7])
    starts = routing_offsets(fixture.prompt_offsets, fixture.completion_offsets)
    prompt = len(fixture.prompt_of(3))
    assert np.array_equal(
        cut.routed_experts[: prompt + 4], fixture.routed_experts[starts[3] :][: prompt + 4]
    )


def test_a_bf16_replay_flips_near_ties_within_precision_and_passes(moe_run, tmp_path):
    done = run_lpx("compare", moe_run / "fixture.parquet", moe_run / "replay-plain.parquet",
                   "--out", tmp_path)  # fmt: skip
    report = read_report(tmp_path)
    assert done.exit_code == 0, report["policy"]
    routing = report["routing"]
    # measured: 1.4 % of tokens flip in bf16, with mean |d| ~0.15 on them and ~0.007 elsewhere
    assert 0 < routing["flip_rate"] < 0.05
    assert (
        routing["drift_on_flipped"]["mean_abs_diff"] > 5 * routing["drift_on_rest"]["mean_abs_diff"]
    )
    assert report["metrics"]["routing_flip_rate"] == routing["flip_rate"]
    assert "layer_1.routing_flip_rate" in report["metrics"]
    assert not [f for f in report["diagnosis"] if f["cause"] == "routing_flip"]


def test_a_seeded_routing_flip_fails_and_is_verified_by_forcing_the_experts(moe_run, tmp_path):
    done = run_lpx("compare", moe_run / "fixture.parquet", moe_run / "replay-flip.parquet",
                   "--out", tmp_path)  # fmt: skip
    report = read_report(tmp_path)
    assert done.exit_code == 1
    routing = report["routing"]
    layers = {layer["layer"]: layer["flip_rate"] for layer in routing["layers"]}
    assert layers[0] == 0.0  # the fixture's own routing was forced there
    assert layers[SEEDED_LAYER] == pytest.approx(SEEDED_FRACTION, abs=0.02)
    assert routing["first_flip"]["layer"] == SEEDED_LAYER
    assert (
        routing["drift_on_flipped"]["mean_abs_diff"]
        > 10 * routing["drift_on_rest"]["mean_abs_diff"]
    )
    (finding,) = [f for f in report["diagnosis"] if f["cause"] == "routing_flip"]
    assert finding["status"] == "verified" and finding["severity"] == "fault"
    check = finding["details"]["verified_by"]
    assert check["kind"] == "router_replay" and check["params"] == {"routing_of": "replay"}
    assert finding["residual_after"] <= 3 * finding["floor"]
    assert not [
        f for f in report["diagnosis"] if f["cause"] == "dtype" and f["status"] == "verified"
    ]


def test_a_small_misrouting_within_the_floor_fails_once_re_scoring_names_it(
    moe_run, family_model, tmp_path
):
    """3 % of layer 1's tokens misrouted, about twice what bf16 flips on its own (1.4 % on an
    AMD EPYC, where the drift passed the calibrated gate; on a Sapphire Rapids CPU, whose
    bf16 flips further, its tail fails the gate): whatever the gate says, the drift above
    tau is not what bf16 gives (dtype ruled out) and forcing the replay's experts reproduces
    it: a verified routing_flip fails."""
    seeded = read_table(moe_run / "fixture.parquet")
    seeded.routed_experts = _seeded_flip(seeded.routed_experts, fraction=0.03, seed=0)
    bf16 = {"dtype": "bfloat16", "device": "cpu", "router_replay": True}
    replay = HFScoringEngine().score(seeded, family_model("qwen3_moe"), bf16)
    replay.metadata["knobs"]["router_replay"] = False  # the engine does not say it
    write_table(replay, tmp_path / "replay.parquet")
    done = run_lpx("compare", moe_run / "fixture.parquet", tmp_path / "replay.parquet",
                   "--out", tmp_path / "out")  # fmt: skip
    report = read_report(tmp_path / "out")
    # measured: 3.7 % of tokens flip (layer 1: 3.6 %)
    assert 0.025 < report["routing"]["flip_rate"] < 0.05
    causes = {f["cause"]: f["status"] for f in report["diagnosis"]}
    assert causes["routing_flip"] == "verified" and causes.get("dtype") != "verified"
    assert done.exit_code == 1 and report["policy"]["failing_findings"] == ["routing_flip"]


def test_a_router_replay_that_routes_elsewhere_fails_whatever_the_gate(
    moe_run, family_model, tmp_path
):
    """A replay that says it forced the rollout's experts (router_replay=true) and still routed
    1 % of layer 1's tokens elsewhere (an R3 bug: rows misaligned, experts misnumbered across
    EP ranks): precision never flips a forced router, so the flips fail it even where the
    drift passes the calibrated gate (it does on an AMD EPYC; on a Sapphire Rapids CPU its
    largest |d| is past the limit too)."""
    seeded = read_table(moe_run / "fixture.parquet")
    seeded.routed_experts = _seeded_flip(seeded.routed_experts, fraction=0.01, seed=0)
    bf16 = {"dtype": "bfloat16", "device": "cpu", "router_replay": True}
    write_table(HFScoringEngine().score(seeded, family_model("qwen3_moe"), bf16),
                tmp_path / "replay.parquet")  # fmt: skip
    done = run_lpx("compare", moe_run / "fixture.parquet", tmp_path / "replay.parquet",
                   "--out", tmp_path / "out")  # fmt: skip
    report = read_report(tmp_path / "out")
    assert report["metadata"]["replay"]["knobs"]["router_replay"] is True
    assert report["precision_gate"]["passed"]  # the gate's statistics: within bf16's noise
    assert 0 < report["routing"]["flip_rate"] < 0.02
    (finding,) = [f for f in report["diagnosis"] if f["cause"] == "routing_flip"]
    assert finding["evidence"].startswith("router replay forced the rollout's experts, yet ")
    assert finding["status"] == "verified"
    assert done.exit_code == 1 and report["policy"]["failing_findings"] == ["routing_flip"]


def test_router_replay_removes_the_flips_and_leaves_the_numeric_drift(moe_run, tmp_path):
    plain = run_lpx("compare", moe_run / "fixture.parquet", moe_run / "replay-plain.parquet",
                    "--out", tmp_path / "plain")  # fmt: skip
    forced = run_lpx("compare", moe_run / "fixture.parquet", moe_run / "replay-r3.parquet",
                     "--out", tmp_path / "r3")  # fmt: skip
    assert plain.exit_code == forced.exit_code == 0
    plain, forced = read_report(tmp_path / "plain"), read_report(tmp_path / "r3")
    assert forced["metadata"]["replay"]["knobs"]["router_replay"] is True
    assert forced["routing"]["flip_rate"] == 0.0 < plain["routing"]["flip_rate"]
    # what is left is numeric: the plain replay's drift on its unflipped tokens, within 10 %
    rest = plain["routing"]["drift_on_rest"]["mean_abs_diff"]
    assert forced["metrics"]["mean_abs_diff"] == pytest.approx(rest, rel=0.1)
    assert forced["metrics"]["mean_abs_diff"] < plain["metrics"]["mean_abs_diff"]


def test_router_replay_needs_a_routed_fixture_and_a_moe(run_dir, moe_run, tiny_model, tmp_path):
    done = run_lpx("replay", run_dir / "fixture.parquet", "--model", tiny_model, "--set",
                   "router_replay=true", "--out", tmp_path / "r.parquet")  # fmt: skip
    assert done.exit_code == 2
    assert "router_replay needs the fixture's routed experts" in done.output
    fixture = read_table(moe_run / "fixture.parquet")
    fixture.routed_experts = fixture.routed_experts.copy()
    fixture.routed_experts[5, 1, 0] = 8  # 8 experts: ids 0-7
    write_table(fixture, tmp_path / "damaged.parquet")
    with pytest.raises(BadInput, match=r"sequence '0-0': routed expert id 8 outside \[0, 8\)"):
        read_table(tmp_path / "damaged.parquet")


def test_history_keeps_routing_series_and_the_run_page_shows_flips_per_layer(moe_run, tmp_path):
    import shutil

    run = tmp_path / "run"
    run.mkdir()
    for name in ("fixture.parquet", "replay-flip.parquet", "calibration.json"):
        shutil.copy(moe_run / name, run / name)
    run_lpx(
        "compare", run / "fixture.parquet", run / "replay-flip.parquet", "--out", run / "compare"
    )
    db = tmp_path / "lpx.db"
    assert run_lpx("record", run, "--db", db).exit_code == 0
    shown = run_lpx("history", "series", "1", "--json", "--db", db)
    assert shown.exit_code == 0, shown.output
    rate = read_report(run / "compare")["routing"]["flip_rate"]
    assert '"routing_flip_rate"' in shown.output and '"layer_1.routing_flip_rate"' in shown.output
    assert run_lpx("report", "--db", db, "--out", tmp_path / "site").exit_code == 0
    (page,) = (tmp_path / "site" / "runs").glob("*.html")
    html = page.read_text()
    assert "<h3>Routing</h3>" in html and 'data-layer="1"' in html
    assert f"{100 * rate:.2f}".rstrip("0").rstrip(".") in html


def test_ingest_takes_a_dumps_routed_experts(moe_run, family_model, tmp_path):
    import json

    fixture = read_table(moe_run / "fixture.parquet")
    starts = routing_offsets(fixture.prompt_offsets, fixture.completion_offsets)
    lines = []
    for i in range(fixture.num_sequences):
        routed = fixture.routed_experts[starts[i] : starts[i + 1]][:, :, ::-1].tolist()
        lines.append({
            "prompt_ids": fixture.prompt_of(i).tolist(),
            "response_ids": fixture.completion_of(i).tolist(),
            "rollout_log_probs": fixture.channels["rollout"][fixture.completion_slice(i)].tolist(),
            # as SGLang returns them: every token seen, in the router's order
            "routed_experts": routed + [routed[-1]],
        })  # fmt: skip
    dump = tmp_path / "dump.jsonl"
    dump.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    model = family_model("qwen3_moe")
    done = run_lpx("ingest", dump, "--model", model, "--field", "routed_experts=routed_experts",
                   "--out", tmp_path / "fixture.parquet")  # fmt: skip
    assert done.exit_code == 0, done.output
    ingested = read_table(tmp_path / "fixture.parquet")
    assert np.array_equal(ingested.routed_experts, fixture.routed_experts)
    assert ingested.metadata["routing"]["layers"] == [0, 1]
    assert ingested.metadata["routing"]["num_experts"] == 8
    lines[1]["routed_experts"][0] = [[-1, -1], [-1, -1]]  # a position the engine did not route
    dump.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    done = run_lpx("ingest", dump, "--field", "routed_experts=routed_experts",
                   "--out", tmp_path / "gap.parquet")  # fmt: skip
    assert done.exit_code == 0, done.output
    from pipeline.routing import unrecorded

    assert unrecorded(read_table(tmp_path / "gap.parquet"))["first"] == {
        "sequence_id": ingested.sequence_ids[1], "position": 0}  # fmt: skip
    lines[2]["routed_experts"] = lines[2]["routed_experts"][:-3]
    dump.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    done = run_lpx("ingest", dump, "--field", "routed_experts=routed_experts",
                   "--out", tmp_path / "bad.parquet")  # fmt: skip
    assert done.exit_code == 2
    assert f"{dump} line 3: field 'routed_experts' has" in done.output
    assert "prompt + completion - 1" in done.output and "prefix-cached" in done.output


def test_rows_without_a_top_k_choice_are_unrecorded_not_flips():
    from pipeline.routing import flipped, recorded

    rollout = np.array([[[0, 0], [2, 3]], [[-1, -1], [2, 3]], [[1, 2], [4, 5]]])
    replay = np.array([[[1, 2], [2, 3]], [[1, 2], [2, 4]], [[1, 3], [4, 5]]])
    assert recorded(rollout).tolist() == [[False, True], [False, True], [True, True]]
    assert flipped(rollout, replay).tolist() == [[False, False], [False, True], [True, False]]
    result = agreement(rollout, replay, [0, 1], np.array([0, 0, 0]), np.arange(3), ["a"],
                       np.array([9.0, 0.5, 0.25]))  # fmt: skip
    # layer 0: one token compared of three, and it flipped; layer 1: one flip in three
    assert [layer["flip_rate"] for layer in result["layers"]] == [1.0, pytest.approx(1 / 3)]
    assert result["unrecorded_tokens"] == {"rollout": 2, "replay": 0}
    assert result["drift_on_rest"]["tokens"] == 1 and result["drift_on_rest"]["max_abs_diff"] == 9.0


@pytest.fixture(scope="module")
def incomplete(moe_run, tmp_path_factory):
    """The fp32 rollout with the routing an engine returns under prefix caching: zeros on the
    first 3 (cached) prompt positions of sequences 0-3, and one completion token of
    sequence 5 lost the same way."""
    fixture = read_table(moe_run / "fixture.parquet")
    fixture.routed_experts = fixture.routed_experts.copy()
    starts = routing_offsets(fixture.prompt_offsets, fixture.completion_offsets)
    for i in range(4):
        fixture.routed_experts[starts[i] : starts[i] + 3] = 0
    token_row = int(completion_rows(fixture.prompt_offsets, fixture.completion_offsets)[
        int(fixture.completion_offsets[5]) + 2])  # fmt: skip
    fixture.routed_experts[token_row] = 0
    out = tmp_path_factory.mktemp("incomplete") / "fixture.parquet"
    write_table(fixture, out)
    return out


def test_compare_reports_incomplete_routing_and_does_not_count_it(moe_run, incomplete, tmp_path):
    done = run_lpx("compare", incomplete, moe_run / "replay-plain.parquet", "--out", tmp_path)
    assert done.exit_code == 0, done.output
    routing = read_report(tmp_path)["routing"]
    assert routing["unrecorded"]["rollout"] == {
        "rows": 13, "of": int(read_table(incomplete).routed_experts.shape[0]), "sequences": 5,
        "first": {"sequence_id": "0-0", "position": 0},
    }  # fmt: skip
    assert routing["unrecorded"]["replay"] is None
    assert routing["unrecorded_tokens"] == {"rollout": 1, "replay": 0}
    whole = run_lpx("compare", moe_run / "fixture.parquet", moe_run / "replay-plain.parquet",
                    "--out", tmp_path / "whole")  # fmt: skip
    # the lost token is left out: the same flips, over one token fewer (none flipped on it)
    assert (
        routing["tokens_with_flip"]
        == read_report(tmp_path / "whole")["routing"]["tokens_with_flip"]
    )
    assert whole.exit_code == 0
    summary = (tmp_path / "summary.md").read_text()
    assert "the rollout's routing is incomplete: 13 of" in summary
    assert "sequence 0-0, position 0" in summary


def test_router_replay_leaves_unrecorded_positions_to_the_router(moe_run, incomplete, family_model):
    model = family_model("qwen3_moe")
    whole = read_table(moe_run / "fixture.parquet")
    fp32 = {"device": "cpu", "router_replay": True}
    forced = HFScoringEngine().score(whole, model, fp32)
    gaps = HFScoringEngine().score(read_table(incomplete), model, fp32)
    # fp32 prefill routes as the fp32 rollout did (100 %), so leaving the gaps to the router
    # gives the complete fixture's logprobs; forcing the zeros as experts 0 and 1 would not
    assert np.max(np.abs(gaps.channels["replay"] - forced.channels["replay"])) < 1e-6
    wrong = read_table(incomplete)
    wrong.routed_experts = np.where(wrong.routed_experts == 0, np.arange(2), wrong.routed_experts)
    wrong.routed_experts = np.sort(wrong.routed_experts, axis=-1).astype(np.int16)
    misrouted = HFScoringEngine().score(wrong, model, fp32)
    assert np.max(np.abs(misrouted.channels["replay"] - forced.channels["replay"])) > 1e-3


def test_megatron_router_replay_refuses_incomplete_routing_before_any_rank(
    incomplete, family_model, tmp_path
):
    done = run_lpx("replay", incomplete, "--engine", "megatron", "--nproc", "2",
                   "--model", family_model("qwen3_moe"), "--set", "tensor_parallel_size=2",
                   "--set", "router_replay=true", "--out", tmp_path / "r.parquet")  # fmt: skip
    assert done.exit_code == 2, done.output
    assert "the fixture's routing is incomplete: 13 of" in done.output
    assert "sequence '0-0', position 0" in done.output and "--engine hf" in done.output
    assert not (tmp_path / "r.parquet").exists()
