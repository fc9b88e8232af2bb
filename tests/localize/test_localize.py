"""lpx localize on the HF adapter: the pure parts, seeded faults named exactly and verified,
clean pairs localizing nothing, and clear errors. (Other engines: test_localize_engines.py,
test_localize_distributed.py; history, report and plans: test_localize_history.py,
test_localize_plan.py; what belongs to the fixture: test_localize_belonging.py.)"""

from __future__ import annotations

import json

import numpy as np
import pytest

from pipeline.faults.capture import FAULTS, expected_boundary
from pipeline.localize import boundaries as b
from pipeline.localize.chart import drift_chart
from pipeline.localize.measure import UNIT_ROUNDOFF, Summary, token_divergence
from pipeline.localize.verdict import MARGIN, boundary_rows, first_beyond
from support.helpers import run_lpx

# --- pure parts ---------------------------------------------------------------------------


def test_boundaries_sort_in_network_order_and_families_span_later_layers():
    names = ["logits", "layers.1.q", "embed", "final_norm", "layers.0.mlp_out", "layers.0.q"]
    assert b.in_order(names) == [
        "embed",
        "layers.0.q",
        "layers.0.mlp_out",
        "layers.1.q",
        "final_norm",
        "logits",
    ]
    every = ["embed"] + [f"layers.{i}.{k}" for i in range(3) for k in b.LAYER_KINDS]
    every += ["final_norm", "logits"]
    norms = b.family_from(every, "layers.1.mlp_in")
    assert norms == [
        "layers.1.input_norm",
        "layers.1.mlp_in",
        "layers.2.input_norm",
        "layers.2.mlp_in",
        "final_norm",
    ]
    assert b.family_from(every, "layers.2.k") == ["layers.2.q", "layers.2.k", "layers.2.v"]
    for bad in ("layers.x.q", "layers.1.nope", "lm_head", ""):
        with pytest.raises(ValueError):
            b.parse(bad)


def test_token_divergence_is_relative_and_discrete_for_experts():
    a = np.array([[3.0, 4.0], [0.0, 0.0], [1.0, 0.0]])
    other = np.array([[3.0, 4.5], [0.0, 0.0], [1.0, 0.0]])
    assert token_divergence("layers.0.q", a, other) == pytest.approx([0.5 / np.hypot(3, 4.5), 0, 0])
    # A scale-free number: the same relative change at 1000x the norm gives the same value.
    assert token_divergence("logits", a * 1000, other * 1000)[0] == pytest.approx(
        0.5 / np.hypot(3, 4.5)
    )
    experts_a = np.array([[0, 3], [1, 2], [5, 7]])
    experts_b = np.array([[3, 0], [1, 4], [5, 7]])  # the same set, a flip, the same
    assert token_divergence("layers.0.experts", experts_a, experts_b).tolist() == [0, 1, 0]
    with pytest.raises(ValueError, match="shapes differ"):
        token_divergence("embed", a, a[:2])


def test_summary_streams_max_rms_and_worst_token():
    summary = Summary()
    summary.add("s0", np.array([0.1, 0.3]))
    summary.add("s1", np.array([0.2, 0.5, 0.0]))
    assert summary.max == 0.5 and summary.worst == ("s1", 1)
    assert summary.rms == pytest.approx(np.sqrt((0.01 + 0.09 + 0.04 + 0.25) / 5))
    assert summary.as_dict()["tokens"] == 5


def _summary(max_, rms, tokens=100, mean=None):
    return {"max": max_, "rms": rms, "mean": rms if mean is None else mean, "tokens": tokens}


def test_a_boundary_is_beyond_when_drift_exceeds_margin_times_the_summed_floors():
    names = ["embed", "layers.0.q", "layers.0.experts", "logits"]
    drift = {
        "embed": _summary(0.0, 0.0),
        "layers.0.q": _summary(0.03, 0.01),
        "layers.0.experts": _summary(1.0, 0.3, mean=0.06),  # 6 flips in 100 tokens
        "logits": _summary(0.5, 0.2),
    }
    floor_a = {n: _summary(0.005, 0.002, mean=0.01) for n in names}  # 1 flip
    floor_b = {n: _summary(0.005, 0.002, mean=0.0) for n in names}
    rows = {
        r["boundary"]: r for r in boundary_rows(names, drift, floor_a, floor_b, ("bfloat16",) * 2)
    }
    assert rows["embed"]["ratio"] == 0 and not rows["embed"]["beyond"]
    # q: 0.03 / (0.005 + 0.005) = 3 by the max, 0.01 / 0.004 = 2.5 by the RMS: under MARGIN 4
    assert rows["layers.0.q"]["ratio"] == pytest.approx(3.0)
    assert not rows["layers.0.q"]["beyond"]
    # experts: 6 flips where precision makes 1 -> 6 x floor
    assert rows["layers.0.experts"]["ratio"] == pytest.approx(6.0)
    assert first_beyond(list(rows.values()))["boundary"] == "layers.0.experts"
    # A zero floor is raised to one rounding of the coarser declared dtype.
    zero = {n: _summary(0.0, 0.0, mean=0.0) for n in names}
    rows = boundary_rows(["layers.0.q"], drift, zero, zero, ("float32", "bfloat16"))
    assert rows[0]["ratio"] == pytest.approx(0.03 / UNIT_ROUNDOFF["bfloat16"])


def test_chart_draws_one_line_per_kind_the_band_and_the_first_boundary():
    rows = [
        {"boundary": n, "layer": b.layer_of(n), "kind": b.kind_of(n), "ratio": r}
        for n, r in [("embed", 0.0), ("layers.0.q", 0.5), ("layers.1.q", 80.0), ("logits", 30.0)]
    ]
    svg = drift_chart(
        {
            "boundaries": rows,
            "margin": MARGIN,
            "verdict": "verified",
            "first": {"boundary": "layers.1.q"},
        }
    )
    assert svg.count('class="kind-q"') == 1 and 'class="floor-band"' in svg
    assert 'class="first-boundary"' in svg and "layers.1.q: 80 x floor" in svg
    assert "<title>localize verified: first beyond the floor: layers.1.q</title>" in svg


# --- the HF adapter on the tiny model ------------------------------------------------------


@pytest.fixture(scope="module")
def fixture_path(run_dir):
    return run_dir / "fixture.parquet"


def _localize(fixture_path, tiny_model, tmp_path, spec_a, spec_b, *extra):
    out = tmp_path / "localize"
    result = run_lpx(
        "localize", fixture_path, "--model", tiny_model, "--a", spec_a, "--b", spec_b,
        "--sequences", "4", "--out", out, *extra,
    )  # fmt: skip
    return result, (
        json.loads((out / "localize.json").read_text()) if result.exit_code < 2 else None
    )


DENSE_FAULTS = [kind for kind in FAULTS if kind != "moe_routing_flip"]


@pytest.mark.parametrize("kind", DENSE_FAULTS)
def test_each_seeded_fault_is_named_exactly_and_verified_in_fp32(
    kind, fixture_path, tiny_model, tmp_path
):
    result, out = _localize(
        fixture_path, tiny_model, tmp_path, "hf", f"hf:fault={kind},fault_layer=1"
    )
    assert result.exit_code == 1, result.output
    assert out["first"]["boundary"] == expected_boundary(kind, 1)
    assert out["verdict"] == "verified", out["verification"]
    # Measured on the tiny model: the weakest fault (lm_head in bf16) is 12.8x the floor here.
    assert out["first"]["ratio"] > 2 * MARGIN
    assert f"verified at {expected_boundary(kind, 1)}" in result.output


@pytest.mark.parametrize("kind", ["rope_theta", "attn_mask", "position_ids"])
def test_seeded_faults_are_named_exactly_under_bf16_noise(kind, fixture_path, tiny_model, tmp_path):
    _, out = _localize(
        fixture_path, tiny_model, tmp_path, "hf:dtype=bf16", f"hf:dtype=bf16,fault={kind}"
    )
    assert out["first"]["boundary"] == expected_boundary(kind, 0)
    assert out["verdict"] == "verified"
    assert out["first"]["ratio"] > 3 * MARGIN  # measured 35 (attn_mask) to 139 (rope_theta)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_two_attention_kernels_of_one_model_localize_nothing(
    dtype, fixture_path, tiny_model, tmp_path
):
    result, out = _localize(
        fixture_path, tiny_model, tmp_path, f"hf:dtype={dtype}", f"hf:dtype={dtype},attention=eager"
    )
    assert result.exit_code == 0, result.output
    assert out["verdict"] == "clean" and out["first"] is None and out["verification"] is None
    worst = max(row["ratio"] for row in out["boundaries"])
    assert 0 < worst < MARGIN / 2  # measured 0.49 (fp32) and 0.52 (bf16)
    assert "clean, nothing beyond the precision floor" in result.output
    assert (tmp_path / "localize" / "localize.svg").read_text().startswith("<svg")
    assert not (tmp_path / "localize" / "captures").exists()  # captures are not kept


def test_an_fp32_side_against_a_bf16_side_is_explained_by_precision(
    fixture_path, tiny_model, tmp_path
):
    """B's own floor is fp32 against its bf16: exactly what separates it from an fp32 A."""
    _, out = _localize(fixture_path, tiny_model, tmp_path, "hf", "hf:dtype=bf16")
    assert out["verdict"] == "clean"
    assert max(row["ratio"] for row in out["boundaries"]) == pytest.approx(1.0, abs=0.05)


def test_kept_captures_are_rows_in_the_hf_layout(fixture_path, tiny_model, tmp_path, run_dir):
    from pipeline.fixture.io import read_table

    _localize(fixture_path, tiny_model, tmp_path, "hf", "hf", "--keep-captures")
    table = read_table(fixture_path)
    length = len(table.prompt_of(0)) + len(table.completion_of(0))
    captures = tmp_path / "localize" / "captures"
    q = np.load(captures / "a" / "0" / "layers.0.q.npy")
    k = np.load(captures / "a" / "0" / "layers.0.k.npy")
    logits = np.load(captures / "b" / "0" / "logits.npy")
    assert q.shape == (length, 128) and k.shape == (length, 64)  # 4 heads x 32, 2 kv heads
    assert logits.shape[0] == length and logits.shape[1] >= 256


def test_batched_captures_equal_one_sequence_at_a_time(fixture_path, tiny_model):
    from pipeline.fixture.io import read_table
    from pipeline.localize.adapters.hf import CaptureKnobs, HFCapture

    table = read_table(fixture_path)
    batch = [
        [int(t) for t in table.prompt_of(i)] + [int(t) for t in table.completion_of(i)]
        for i in range(3)
    ]
    assert len({len(ids) for ids in batch}) > 1  # right padding is exercised
    side = HFCapture(tiny_model, CaptureKnobs(), "cpu")
    together, alone = {}, {}
    side.capture_batch(
        batch, "declared", lambda i, name, rows: together.__setitem__((i, name), rows)
    )
    for i, ids in enumerate(batch):
        side.capture(ids, "declared", lambda name, rows, i=i: alone.__setitem__((i, name), rows))
    assert together.keys() == alone.keys()
    worst = max(float(token_divergence(n, together[(i, n)], alone[(i, n)]).max()) for i, n in alone)
    assert worst < 1e-5  # fp32 GEMM blocking of a wider batch; measured ~1e-7


# --- errors --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec, message",
    [
        ("http:url=http://x", "cannot capture activations from 'http'"),
        ("sglang:url=http://x", "the sglang capture adapter starts its own server"),
        ("nope", "no capture adapter for engine 'nope'"),
        ("hf:dtype", "'dtype' is not knob=value"),
        (
            "hf:dtype=bf16,dtype=fp32",
            "engine spec 'hf:dtype=bf16,dtype=fp32': 'dtype=bf16' and 'dtype=fp32' both set "
            "dtype; give it once.",
        ),
        ("hf:colour=red", "unknown hf capture knob(s) colour"),
        ("hf:fault=gremlins", "unknown fault 'gremlins'"),
        ("hf:attention=flash", "attention='flash'; use sdpa or eager"),
        ("hf:dtype=fp8", "dtype"),
    ],
)
def test_bad_specs_are_one_clear_line(spec, message, fixture_path, tiny_model, tmp_path):
    result, _ = _localize(fixture_path, tiny_model, tmp_path, "hf", spec)
    assert result.exit_code == 2
    assert message in result.output and "Traceback" not in result.output


def test_bad_selections_and_outputs_are_clear_errors(fixture_path, tiny_model, tmp_path):
    result = run_lpx(
        "localize", fixture_path, "--model", tiny_model, "--a", "hf", "--b", "hf",
        "--sequence", "no-such", "--out", tmp_path / "localize",
    )  # fmt: skip
    assert result.exit_code == 2 and "no-such are not in the fixture" in result.output
    bad = tmp_path / "report.json"
    bad.write_text("{not json")
    result, _ = _localize(fixture_path, tiny_model, tmp_path, "hf", "hf", "--report", bad)
    assert result.exit_code == 2 and "cannot read it as JSON" in result.output
    taken = tmp_path / "file"
    taken.write_text("")
    result = run_lpx(
        "localize", fixture_path, "--model", tiny_model, "--a", "hf", "--b", "hf", "--out", taken
    )
    assert result.exit_code == 2 and "is a file" in result.output
