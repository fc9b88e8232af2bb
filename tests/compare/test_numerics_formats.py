"""Reduced-precision formats against hand-computed values, the numerics' names and texts, and
the HF emulation's structure (which layers, fused scales, the KV cache after RoPE)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pipeline.contracts.numerics import (
    Numerics,
    canonical_precision,
    parse_kv_cache,
    parse_quantization,
    split_precision,
)
from pipeline.numerics.formats import (
    MIN_ACTIVATION_SCALE,
    quantize_dequantize,
    round_to_element,
    truncate_to_element,
)


def _t(*values):
    return torch.tensor(values, dtype=torch.float32)


# --- the elements ---------------------------------------------------------------------------


def test_e4m3_rounds_to_nearest_even_and_saturates():
    # E4M3 near 2 has a step of 0.25; 2.125 and 2.375 are ties (even mantissa wins); 464 is
    # the tie between 448 and the (NaN) 480: it and everything above saturate to 448
    values = _t(2.125, 2.375, 2.2, -2.2, 448.0, 464.0, 1e6, -1e6, 0.0)
    expected = [2.0, 2.5, 2.25, -2.25, 448.0, 448.0, 448.0, -448.0, 0.0]
    assert round_to_element(values, "fp8_e4m3").tolist() == expected
    # subnormals: spacing 2^-9 below 2^-6; 2^-10 is a tie between 0 and 2^-9 (to even: 0)
    small = _t(2.0**-10, 1.5 * 2.0**-10, 3 * 2.0**-9, 2.0**-6)
    assert round_to_element(small, "fp8_e4m3").tolist() == [0.0, 2.0**-9, 3 * 2.0**-9, 2.0**-6]


def test_e5m2_saturates_where_torch_would_give_inf():
    # near 3 E5M2's step is 0.5: 3.25 is a tie (to the even 3.0), 3.3 rounds to 3.5
    assert round_to_element(_t(61440.0, 1e9, 3.25, 3.3), "fp8_e5m2").tolist() == [
        57344.0, 57344.0, 3.0, 3.5,
    ]  # fmt: skip


def test_truncation_rounds_toward_zero_on_every_grid():
    # vLLM-CPU's KV store: 2.49 and 2.374 are cut to 2.25, -2.49 to -2.25, and a subnormal
    # 1.99 * 2^-9 to 2^-9
    values = _t(2.49, 2.374, -2.49, 1.99 * 2.0**-9, 500.0)
    assert truncate_to_element(values, "fp8_e4m3").tolist() == [2.25, 2.25, -2.25, 2.0**-9, 448.0]
    assert truncate_to_element(_t(3.9, 7.9), "fp8_e5m2").tolist() == [3.5, 7.0]
    # on every value, truncation never lands farther from zero than the value
    x = torch.randn(20000) * 10
    cut = truncate_to_element(x, "fp8_e4m3")
    assert bool((cut.abs() <= x.abs()).all())
    # and on every E4M3 value it is the identity
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[torch.isfinite(grid)]
    assert torch.equal(truncate_to_element(grid, "fp8_e4m3"), grid)


def test_int8_rounds_half_to_even_and_clamps():
    assert round_to_element(_t(2.5, 3.5, -2.5, 127.6, -200.0), "int8").tolist() == [
        2.0, 4.0, -2.0, 127.0, -128.0,
    ]  # fmt: skip


# --- the scales -----------------------------------------------------------------------------


def test_per_tensor_scale_is_amax_over_448():
    x = _t(1.0, -3.0, 0.5)
    scale = 3.0 / 448.0
    expected = torch.round(x / scale)  # any grid value: check the round trip exactly
    got = quantize_dequantize(x[None], "fp8_e4m3", "tensor")[0]
    assert float(got[1]) == pytest.approx(-3.0, rel=1e-7)  # the amax is exact
    assert torch.equal(got, round_to_element(x / scale, "fp8_e4m3") * scale)
    assert expected.shape == got.shape


def test_per_token_activation_scale_has_vllms_floor():
    tiny = _t(1e-6, -2e-6)[None]  # amax/448 is far below 1 / (448 x 512)
    got = quantize_dequantize(tiny, "fp8_e4m3", "token")
    expected = round_to_element(tiny / MIN_ACTIVATION_SCALE, "fp8_e4m3") * MIN_ACTIVATION_SCALE
    assert torch.equal(got, expected)


def test_per_channel_scales_each_row():
    x = torch.tensor([[1.0, 2.0], [100.0, -300.0]])
    got = quantize_dequantize(x, "fp8_e4m3", "channel")
    assert got[0, 1] == pytest.approx(2.0) and got[1, 1] == pytest.approx(-300.0)
    # row 0 with row 1's scale would lose its values; per channel they are exact
    assert got[0].tolist() == pytest.approx([1.0, 2.0], rel=1e-6)


def test_block128_scales_each_tile_and_edge_tile():
    torch.manual_seed(0)
    x = torch.randn(130, 200)
    x[0, 0], x[129, 199] = 50.0, 0.01  # one large value in tile (0, 0); the last tile is small
    got = quantize_dequantize(x, "fp8_e4m3", "block128")
    for rows, columns in ((slice(0, 128), slice(0, 128)), (slice(128, 130), slice(128, 200))):
        tile = x[rows, columns]
        scale = tile.abs().amax() / 448.0
        assert torch.equal(got[rows, columns], round_to_element(tile / scale, "fp8_e4m3") * scale)


def test_group128_and_mx32_scale_per_group_of_a_row():
    torch.manual_seed(1)
    x = torch.randn(3, 256)
    group = quantize_dequantize(x, "fp8_e4m3", "group128")
    first = x[:, :128]
    scale = first.abs().amax(dim=1, keepdim=True) / 448.0
    assert torch.equal(group[:, :128], round_to_element(first / scale, "fp8_e4m3") * scale)
    mx = quantize_dequantize(x, "fp8_e4m3", "mx32")
    block = x[:, 32:64]
    amax = block.abs().amax(dim=1, keepdim=True)
    power = torch.exp2(torch.ceil(torch.log2(amax / 448.0)))  # UE8M0, rounded up
    assert torch.equal(mx[:, 32:64], round_to_element(block / power, "fp8_e4m3") * power)


def test_mx_scale_rules_round_up_or_as_ocp_writes_them():
    x = torch.zeros(1, 32)
    x[0, 0], x[0, 1] = 480.0, 1.0
    # ue8m0 (vLLM, SGLang, torchao RCEIL): 2^ceil(log2(480 / 448)) = 2: 480 / 2 = 240 is on
    # the grid, so 480 stays
    assert float(quantize_dequantize(x, "fp8_e4m3", "mx32", "ue8m0")[0, 0]) == 480.0
    # OCP MX v1.0: 2^(floor(log2 480) - 8) = 1: 480 saturates to 448
    assert float(quantize_dequantize(x, "fp8_e4m3", "mx32", "ocp")[0, 0]) == 448.0


def test_block_scales_as_powers_of_two_round_up():
    x = torch.full((128, 128), 3.0)
    got = quantize_dequantize(x, "fp8_e4m3", "block128", "ue8m0")
    # 3 / 448 -> 2^ceil(log2(0.0067)) = 2^-7: 3 / 2^-7 = 384 is on the grid
    assert float(got[0, 0]) == 3.0
    assert math.log2(2.0 ** math.ceil(math.log2(3.0 / 448.0))) == -7


# --- names and texts ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("given", "text"),
    [
        ("bf16", "bfloat16"),
        ("fp32+tf32", "float32+tf32"),
        ("bf16+fp8", "bfloat16+fp8_e4m3:w=tensor,a=token"),
        ("bf16+fp8_per_block", "bfloat16+fp8_e4m3:w=block128,a=group128"),
        ("bf16+fp8-block+kv=fp8", "bfloat16+fp8_e4m3:w=block128,a=group128+kv=fp8_e4m3"),
        ("bf16+mxfp8", "bfloat16+fp8_e4m3:w=mx32,a=mx32,scales=ue8m0"),
        ("fp16+kv=fp8_e5m2:toward_zero@0.5/0.25", "float16+kv=fp8_e5m2:toward_zero@0.5/0.25"),
        ("bf16+int8:keep_first=2,keep_last=1,lm_head",
         "bfloat16+int8:w=channel,a=token,keep_first=2,keep_last=1,lm_head"),
    ],
)  # fmt: skip
def test_precisions_are_written_one_canonical_way(given, text):
    assert canonical_precision(given) == text
    assert canonical_precision(text) == text
    dtype, tf32, numerics = split_precision(text)
    assert dtype == text.split("+")[0] and tf32 == ("+tf32" in text)
    assert numerics.text == text.removeprefix(dtype).removeprefix("+tf32").removeprefix("+")


def test_labels_and_descriptions_read_as_the_field_names_them():
    numerics = Numerics(parse_quantization("fp8-block:keep_first=2"), parse_kv_cache("fp8"))
    assert numerics.label == "fp8-block (keep_first=2) + kv fp8_e4m3"
    assert numerics.description == (
        "fp8-block (keep_first=2): E4M3 weights per 128 x 128 block, activations per 1 x 128 "
        "group (first 2 and last 0 layers kept); an E4M3 KV cache (rounded to nearest, K/V "
        "scales 1/1)"
    )
    assert parse_quantization("fp8_per_channel").label == "fp8-channel"
    assert parse_kv_cache("auto") is None and parse_quantization("") is None


@pytest.mark.parametrize(
    ("given", "said"),
    [
        ("bf8", "unknown dtype 'bf8'"),
        ("bf16+fp9", "unknown quantization 'fp9'"),
        ("bf16+fp8:w=row", "unknown weight granularity w 'row'"),
        ("bf16+kv=int4", "unknown kv cache dtype 'int4'"),
        ("bf16+int8:w=mx32", "mx32 scales a floating-point element"),
        ("bf16+kv=fp8@0/1", "kv cache k_scale must be a positive number"),
        ("bf16+fp8:keep_first=x", "keep_first takes a number of layers"),
    ],
)
def test_bad_numerics_are_refused_saying_what(given, said):
    with pytest.raises(ValueError, match=said.replace("(", r"\(").replace(")", r"\)")):
        canonical_precision(given)


# --- the emulation on a model ---------------------------------------------------------------


@pytest.fixture(scope="module")
def model(tiny_model):
    from pipeline.engines.hf.model import load_model

    return load_model(tiny_model, "float32")


def _logprobs(model, ids):
    with torch.no_grad():
        return model(ids).logits.log_softmax(-1)


def test_numerics_apply_and_remove_without_touching_the_parameters(model):
    from pipeline.numerics.emulate import apply_numerics, remove_numerics

    ids = torch.arange(3, 43)[None]
    plain = _logprobs(model, ids)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    apply_numerics(model, Numerics(parse_quantization("fp8"), parse_kv_cache("fp8")))
    quantized = _logprobs(model, ids)
    assert model.config._attn_implementation == "lpx_kv_sdpa"
    remove_numerics(model)
    assert model.config._attn_implementation == "sdpa"
    assert torch.equal(_logprobs(model, ids), plain)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    # measured on the tiny model: mean |d| 0.19 under FP8 weights, activations and cache
    assert float((quantized - plain).abs().mean()) > 0.02


def test_fused_layers_share_one_per_tensor_scale(model):
    """vLLM quantizes the fused qkv matrix (and gate_up) once: one scale for q, k and v."""
    from pipeline.numerics.emulate import _QuantizedLinear, apply_numerics, remove_numerics

    apply_numerics(model, Numerics(parse_quantization("fp8-tensor"), None))
    try:
        attention = model.model.layers[0].self_attn
        held = attention.k_proj.forward
        assert isinstance(held, _QuantizedLinear)
        members = (attention.q_proj, attention.k_proj, attention.v_proj)
        shared = max(float(m.weight.abs().max()) for m in members) / 448.0
        own = float(attention.k_proj.weight.abs().max()) / 448.0
        weight = attention.k_proj.weight
        assert shared != own
        assert torch.equal(held.weight, round_to_element(weight / shared, "fp8_e4m3") * shared)
        assert not torch.equal(held.weight, round_to_element(weight / own, "fp8_e4m3") * own)
    finally:
        remove_numerics(model)


def test_kept_layers_and_the_head_compute_as_before(model):
    from pipeline.numerics.emulate import apply_numerics, remove_numerics

    layers = len(model.model.layers)
    spec = parse_quantization(f"fp8-block:keep_first={layers}")
    apply_numerics(model, Numerics(spec, None))
    try:
        assert not any("forward" in m.__dict__ for m in model.modules())
    finally:
        remove_numerics(model)
    apply_numerics(model, Numerics(parse_quantization("fp8-block"), None))
    try:
        assert "forward" not in model.get_output_embeddings().__dict__  # lm_head kept
        assert "forward" in model.model.layers[0].mlp.down_proj.__dict__
    finally:
        remove_numerics(model)


def test_a_prefill_reads_the_cache_as_decoding_does(model):
    """Keys and values are rounded where attention reads them, so a teacher-forced prefill
    computes what decoding from the FP8 cache does (the calibration's and verification's
    premise); on fp32, to 1e-5."""
    from pipeline.engines.hf.decode import decode_logprobs
    from pipeline.faults import FaultSettings, rescore
    from pipeline.numerics.emulate import apply_numerics, remove_numerics

    rng = np.random.default_rng(0)
    pairs = [(rng.integers(3, 200, 12), rng.integers(3, 200, 30)) for _ in range(3)]
    apply_numerics(model, Numerics(None, parse_kv_cache("fp8_e5m2:toward_zero")))
    try:
        prefill = rescore(model, pairs, "clean", FaultSettings())
        decoded = decode_logprobs(model, pairs, len(pairs))
    finally:
        remove_numerics(model)
    plain = rescore(model, pairs, "clean", FaultSettings())
    gap = np.abs(np.concatenate(prefill) - np.concatenate(decoded))
    moved = np.abs(np.concatenate(prefill) - np.concatenate(plain))
    assert gap.max() < 1e-4 and moved.mean() > 100 * gap.mean()


def test_a_moe_computes_with_its_experts_and_router_quantized(family_model):
    """Qwen3-MoE's experts are 3-D tensors and its router a module of its own: both
    quantized (the router as vLLM does for Qwen3-MoE), then put back exactly."""
    from pipeline.engines.hf.model import load_model
    from pipeline.numerics.emulate import apply_numerics, remove_numerics

    moe = load_model(family_model("qwen3_moe"), "float32")
    ids = torch.arange(3, 35)[None]
    plain = _logprobs(moe, ids)
    router = next(m for m in moe.modules() if "Router" in type(m).__name__)
    before = router.weight.detach().clone()
    apply_numerics(moe, Numerics(parse_quantization("fp8-block:router"), None))
    assert not torch.equal(router.weight, before)
    quantized = _logprobs(moe, ids)
    remove_numerics(moe)
    assert torch.equal(router.weight, before) and torch.equal(_logprobs(moe, ids), plain)
    assert float((quantized - plain).abs().mean()) > 1e-3


# --- what an engine reads back, named -------------------------------------------------------


def _read(linear=None, layers=None, caches=(), **more):
    return {"linear": linear, "layers": layers or {"0": True, "1": True}, "lm_head": False,
            "embeddings": False, "router": False, "kv_cache": list(caches), **more}  # fmt: skip


def test_vllm_layers_read_back_name_the_numerics_that_ran():
    from pipeline.engines.vllm.numerics import numerics_of

    block_w8a16 = {"method": "Fp8PerBlockOnlineLinearMethod", "kernel": "CPUFp8BlockScaledMMKernel",
                   "weight_dtype": "float8_e4m3fn", "weights": [128, 128],
                   "activations": [1, 128], "quantizes_input": False}  # fmt: skip
    cache = {"layer": "l0", "dtype": "fp8_e4m3", "tensor": "uint8", "k_scale": 1.0, "v_scale": 1.0}
    numerics = numerics_of(_read(block_w8a16, caches=[cache]), "bfloat16", "cpu")
    assert numerics.text == "fp8_e4m3:w=block128,a=none+kv=fp8_e4m3:toward_zero"
    assert numerics.label == "fp8-block-w8a16 + kv fp8_e4m3:toward_zero"
    per_channel = {**block_w8a16, "weights": [-1, 1], "activations": [1, -1],
                   "quantizes_input": True}  # fmt: skip
    kept = _read(per_channel, layers={"0": False, "1": True, "2": True, "3": False}, lm_head=True)
    assert numerics_of(kept, "bfloat16", "cuda").text == (
        "fp8_e4m3:w=channel,a=token,keep_first=1,keep_last=1,lm_head"
    )
    # a cache that says fp8 but holds the model's dtype ran as auto: no FP8 cache to name
    fallen_back = {**cache, "tensor": "bfloat16"}
    assert not numerics_of(_read(caches=[fallen_back]), "bfloat16", "cpu")
    with pytest.raises(ValueError, match="lpx cannot name"):
        numerics_of(_read({**per_channel, "weights": [64, 64]}), "bfloat16", "cuda")


def test_a_numerics_knob_an_engine_dropped_is_said_and_others_are_not():
    from pipeline.engines.base import dropped_numerics

    metadata = {"knobs_not_applied": {
        "kv_cache_dtype": {"requested": "fp8", "applied": "auto (its KV cache holds bfloat16)"},
        "sleep_on_idle": {"requested": True, "applied": False}}}  # fmt: skip
    assert dropped_numerics(metadata, "vllm") == (
        "vllm did not apply kv_cache_dtype=fp8 (it runs auto (its KV cache holds bfloat16))"
    )
    assert dropped_numerics({"knobs_not_applied": {"sleep_on_idle": {}}}, "sglang") is None
