"""The step rule (an op's own drift with its inputs matched, against the local floor), --exact
(the first boundary not bitwise equal) and the floor cache, on the tiny model and on a random
16 x 1024 llama: a stale MLP a few percent off in bf16 is named where the level rule sees
nothing, clean pairs stay clean, and a second run measures no floor."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest

from pipeline.localize import exact
from pipeline.localize.adapters.hf import HFCapture
from pipeline.localize.run import localize
from pipeline.localize.verdict import MARGIN, STEP_MARGIN, boundary_rows, with_step
from support.helpers import run_lpx

STALE = "hf:dtype=bf16,fault=stale_layer,fault_layer={layer},fault_step=0.03"

# --- pure parts ---------------------------------------------------------------------------


def _summary(max_, rms, mean=None, tokens=100):
    return {"max": max_, "rms": rms, "mean": rms if mean is None else mean, "tokens": tokens}


def test_the_step_rule_fires_where_the_level_rule_cannot_and_experts_keep_the_level_rule():
    names = ["layers.0.mlp_out", "layers.1.q", "layers.1.experts"]
    drift = {n: _summary(0.03, 0.01, mean=0.01) for n in names}
    level_floor = {n: _summary(0.0225, 0.0075, mean=0.01) for n in names}  # 0.045 summed
    rows = boundary_rows(names, drift, level_floor, level_floor, ("bfloat16",) * 2)
    own = {
        "layers.0.mlp_out": _summary(0.03, 0.01),  # the op's own step: all of the drift
        "layers.1.q": _summary(0.004, 0.001),  # inputs matched: the op adds nothing
        "layers.1.experts": _summary(1.0, 0.5),
    }
    local_floor = {n: _summary(0.002, 0.0008) for n in names}  # 0.004 / 0.0016 summed
    judged = {
        r["boundary"]: r for r in with_step(rows, own, local_floor, local_floor, ("bfloat16",) * 2)
    }
    mlp = judged["layers.0.mlp_out"]
    assert mlp["ratio"] == pytest.approx(0.03 / 0.045) and mlp["ratio"] < MARGIN
    # 0.03 / 0.004 = 7.5 by the max, 0.01 / 0.0016 = 6.25 by the RMS
    assert mlp["local"]["ratio"] == pytest.approx(7.5)
    assert mlp["beyond_by"] == ["step"] and mlp["beyond"]
    assert judged["layers.1.q"]["local"]["ratio"] == pytest.approx(1.0)
    assert not judged["layers.1.q"]["beyond"]
    assert judged["layers.1.experts"]["local"] is None  # discrete: the level rule only
    assert judged["layers.1.experts"]["beyond_by"] == []


def test_bitwise_tally_counts_differing_elements_and_keeps_the_first():
    a = np.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], dtype=np.float32)
    b = a.copy()
    b[1, 2] = np.nextafter(np.float32(6.0), np.float32(7.0))
    b[0, 1] = -0.0 if a[0, 1] == 0 else 2.0
    tally = exact.Bitwise()
    tally.add("s0", "layers.0.q", a, a)
    tally.add("s1", "layers.0.q", a, b)
    assert tally.differing == 1 and tally.elements == 12
    assert tally.first == {"sequence_id": "s1", "position": 1, "feature": 2, "a": 6.0,
                           "b": float(b[1, 2])}  # fmt: skip
    # bitwise: a zero of the other sign differs, the same NaN does not
    zeros = exact.differing(np.zeros((1, 2), np.float32), np.array([[0.0, -0.0]], np.float32))
    assert zeros.tolist() == [[False, True]]
    nan = np.array([[np.nan]], np.float32)
    assert not exact.differing(nan, nan.copy()).any()
    rows = exact.exact_rows(["layers.0.q", "layers.0.k"], {"layers.0.q": tally})
    assert [r["boundary"] for r in rows] == ["layers.0.q"]
    assert rows[0]["ratio"] == pytest.approx(1 / 12) and rows[0]["beyond_by"] == ["bitwise"]


# --- the tiny model and a 16 x 1024 random llama --------------------------------------------


@pytest.fixture(scope="session")
def wide_model(tmp_path_factory):
    """A random llama, 16 layers x 1024 wide (init std 0.05, as bench/models.py builds it),
    with a 512-token vocabulary so it builds and runs in seconds."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("models") / "llama-16x1024"
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=1024,
        intermediate_size=2688,
        num_hidden_layers=16,
        num_attention_heads=16,
        num_key_value_heads=4,
        max_position_embeddings=256,
        initializer_range=0.05,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out)
    return out


def _table(vocab: int, sequences: int = 4, length: int = 48):
    from pipeline.fixture.table import table_from_sequences

    ids = np.random.default_rng(0).integers(3, vocab, size=(sequences, length)).tolist()
    return table_from_sequences(
        "fixture",
        [f"{i}-0" for i in range(sequences)],
        [row[:16] for row in ids],
        [row[16:] for row in ids],
        {"rollout": [[0.0] * (length - 16) for _ in ids]},
    )


@pytest.fixture(scope="module")
def scales(tiny_model, wide_model):
    """scale -> (model, table, the layer the stale MLP is on)."""
    return {
        "tiny": (tiny_model, _table(256), 1),
        "16x1024": (wide_model, _table(512), 3),
    }


def _run(scales, scale, spec_a, spec_b, tmp_path, **options):
    model, table, _ = scales[scale]
    options.setdefault("floor_cache", False)
    return localize(table, model, spec_a, spec_b, list(range(4)), tmp_path, **options)


def _row(result, boundary):
    return next(r for r in result["boundaries"] if r["boundary"] == boundary)


@pytest.mark.parametrize("scale", ["tiny", "16x1024"])
def test_a_stale_mlp_in_bf16_is_named_by_the_step_rule_and_verified(scales, scale, tmp_path):
    layer = scales[scale][2]
    result = _run(scales, scale, "hf:dtype=bf16", STALE.format(layer=layer), tmp_path)
    target = f"layers.{layer}.mlp_out"
    assert result["verdict"] == "verified", result["verification"]
    assert result["first"]["boundary"] == target
    assert "step" in result["first"]["beyond_by"]
    row = _row(result, target)
    # Nothing before it moved: every earlier boundary is bitwise the same on both sides.
    earlier = result["boundaries"][: result["boundaries"].index(row)]
    assert all(r["drift"]["max"] == 0 for r in earlier)
    # Measured (4 x 48 tokens): level 0.88 / 0.66, step 5.6 / 5.7 (tiny / 16 x 1024).
    assert row["ratio"] < MARGIN  # the level rule alone would call it clean
    assert row["local"]["ratio"] > STEP_MARGIN * 1.5
    assert result["step"]["runner"] == "a"
    assert result["step"]["local_floor"] == {"a": "measured", "b": "measured"}
    assert result["verification"]["by"] == f"b's activation at {target}"
    # Everything after it was within the level floor before the swap too: the swap must cut
    # the worst level ratio after it by the step margin, and here it leaves nothing at all.
    attempt = result["verification"]["attempts"][0]
    assert attempt["worst"]["ratio"] == 0 < attempt["worst_ratio_before"]


@pytest.mark.parametrize("scale", ["tiny", "16x1024"])
def test_exact_names_the_first_boundary_not_bitwise_equal_and_verifies_it(
    scales, scale, tmp_path, monkeypatch
):
    layer = scales[scale][2]
    forwards = _count_forwards(monkeypatch)
    result = _run(scales, scale, "hf:dtype=bf16", STALE.format(layer=layer), tmp_path, exact=True)
    target = f"layers.{layer}.mlp_out"
    assert result["mode"] == "exact" and result["margin"] == 0
    assert result["verdict"] == "verified" and result["first"]["boundary"] == target
    first = result["first"]
    assert 0 < first["differing"] <= first["elements"]
    where = first["first_difference"]
    assert where["sequence_id"] == "0-0" and where["a"] != where["b"]
    assert all(
        r["differing"] == 0
        for r in result["boundaries"][: result["boundaries"].index(_row(result, target))]
    )
    assert result["verification"]["attempts"][0]["bitwise_equal"]
    assert forwards["reference"] == 0  # exact mode measures no floor
    assert "floors" not in result


@pytest.mark.parametrize("scale", ["tiny", "16x1024"])
def test_identical_stacks_are_clean_with_zero_own_drift_everywhere(scales, scale, tmp_path):
    result = _run(scales, scale, "hf:dtype=bf16", "hf:dtype=bf16", tmp_path)
    assert result["verdict"] == "clean" and result["first"] is None
    assert all(r["local"]["drift"]["max"] == 0 for r in result["boundaries"] if r["local"])
    assert max(r["ratio"] for r in result["boundaries"]) == 0
    exact_result = _run(scales, scale, "hf:dtype=bf16", "hf:dtype=bf16", tmp_path, exact=True)
    assert exact_result["verdict"] == "clean"
    assert all(r["differing"] == 0 for r in exact_result["boundaries"])


@pytest.mark.parametrize("scale", ["tiny", "16x1024"])
def test_two_attention_kernels_in_bf16_stay_clean_by_both_rules(scales, scale, tmp_path):
    result = _run(scales, scale, "hf:dtype=bf16", "hf:dtype=bf16,attention=eager", tmp_path)
    assert result["verdict"] == "clean"
    worst_step = max(r["local"]["ratio"] for r in result["boundaries"] if r["local"])
    # Measured 0.90 (tiny) and 0.80 (16 x 1024) with 8 x 96 tokens (bench/localize.py --step).
    assert 0 < worst_step < STEP_MARGIN
    worst = max(result["boundaries"], key=lambda r: r["local"]["ratio"] if r["local"] else 0)
    assert worst["kind"] in ("attn_out", "q", "k", "v", "mlp_in", "input_norm")


def test_a_second_run_takes_both_floors_from_the_cache(scales, tmp_path, monkeypatch):
    monkeypatch.setenv("LPX_LOCALIZE_FLOOR_CACHE", str(tmp_path / "floors"))
    spec_b = STALE.format(layer=1)
    forwards = _count_forwards(monkeypatch)
    first = _run(scales, "tiny", "hf:dtype=bf16", spec_b, tmp_path / "1", floor_cache=True)
    assert first["floors"]["source"] == {"a": "measured", "b": "measured"}
    # each side: its level floor, its local floor
    assert forwards["reference"] == 4 and len(list((tmp_path / "floors").glob("*.json"))) == 2
    forwards.clear()
    second = _run(scales, "tiny", "hf:dtype=bf16", spec_b, tmp_path / "2", floor_cache=True)
    assert second["floors"]["source"] == {"a": "cache", "b": "cache"}
    assert second["step"]["local_floor"] == {"a": "cache", "b": "cache"}
    assert forwards["reference"] == 0  # no reference model is loaded or run
    assert second["boundaries"] == first["boundaries"]
    assert second["verdict"] == first["verdict"] == "verified"
    # other tokens are other floors: nothing is taken from the cache
    model, table, _ = scales["tiny"]
    other = localize(table, model, "hf:dtype=bf16", spec_b, [0, 1], tmp_path / "3")
    assert other["floors"]["source"] == {"a": "measured", "b": "measured"}


def _count_forwards(monkeypatch) -> Counter:
    """HF adapter forwards by precision; a reference model is loaded only by a reference
    forward (HFCapture.model), so none counted means none loaded."""
    counts: Counter = Counter()
    original = HFCapture.capture_batch

    def capture_batch(self, batch, precision, *args, **kwargs):
        counts[precision] += 1
        return original(self, batch, precision, *args, **kwargs)

    monkeypatch.setattr(HFCapture, "capture_batch", capture_batch)
    return counts


# --- the CLI --------------------------------------------------------------------------------


def test_cli_exact_and_no_floor_cache(run_dir, tiny_model, tmp_path, monkeypatch):
    monkeypatch.setenv("LPX_LOCALIZE_FLOOR_CACHE", str(tmp_path / "floors"))
    out = tmp_path / "localize"
    args = ["localize", run_dir / "fixture.parquet", "--model", tiny_model, "--a", "hf:dtype=bf16"]
    result = run_lpx(*args, "--b", STALE.format(layer=1), "--exact", "--out", out)
    assert result.exit_code == 1, result.output
    assert "verified at layers.1.mlp_out, the first boundary not bitwise equal" in result.output
    assert json.loads((out / "localize.json").read_text())["mode"] == "exact"
    result = run_lpx(*args, "--b", "hf:dtype=bf16,attention=eager", "--no-floor-cache",
                     "--out", out)  # fmt: skip
    assert result.exit_code == 0, result.output
    written = json.loads((out / "localize.json").read_text())
    assert written["floors"] == {"source": {"a": "measured", "b": "measured"}, "cache": None}
    assert not (tmp_path / "floors").exists()
