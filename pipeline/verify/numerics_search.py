"""Which numerics to re-score a side under, in what order: the whole-model formats and KV
caches first, then, around the formats that rank ahead, the ways engines and recipes apply
them to part of the model (layers kept in bf16, attention kept, routed experts only, the
LM head and embeddings, the GEMM's arithmetic), a KV cache read from a position on, and a
declared KV cache's scales lost. Each step is a function of what was scored before it, so
the search is pure given ``score`` (text -> residual: the side's mean |d| from its
re-score under those numerics); `families/numerics.py` re-scores.

Why the layer rules are searched even where no whole-model format came nearer than the
declared numerics: rounding is chaotic. A format applied to one layer more than the engine
applied it moves that layer's output by its rounding, and every later activation then rounds
anew, so the whole-model emulation of a rollout that kept its first layer in bf16 can lie
farther from it than plain bf16 does. Its weights still round as the engine's did, so the
right format still ranks ahead of the other formats; that ranking, not a comparison with
none, says which format to search the layer rules of.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

from pipeline.contracts.numerics import (
    KVCacheQuantization,
    LinearQuantization,
    Numerics,
    parse_kv_cache,
    parse_numerics,
    parse_quantization,
)

FORMATS = ("fp8", "fp8-tensor", "fp8-w8a16", "fp8-channel", "fp8-block", "fp8-block-ue8m0",
           "mxfp8", "mxfp8-w8a16", "int8", "int8-w8a16")  # fmt: skip
# FP4 formats screened alone and with the KV caches FP4 rollouts run with (FP8, NVFP4)
FP4_FORMATS = ("nvfp4", "nvfp4-w4a16", "mxfp4", "mxfp4-w4a16")
# to nearest (SGLang, vLLM on CUDA) and toward zero (vLLM-CPU's store)
KV_CACHES = ("fp8_e4m3", "fp8_e5m2", "fp8_e4m3:toward_zero", "fp8_e5m2:toward_zero")
FP4_KV_CACHES = ("fp8_e4m3", "nvfp4")
# a format family ranks ahead when its best residual is this much below every other family's
FAMILY_MARGIN = 1.1
# the formats of the leading family whose layer rules are searched
REFINED_FORMATS = 2
# the parts of a model every format is also screened on alone (experts too, on a MoE)
PARTS = ("mlp",)
# the share of layers SkyRL keeps in bf16 at the end
LAST_SHARE = 0.15

Score = Callable[[Numerics], float]


def family_of(numerics: Numerics) -> str:
    """The format family a numerics belongs to: its linear element's (fp8, int8, fp4), or
    ``kv`` for a KV cache alone, ``none`` for nothing."""
    if numerics.linear is not None:
        element = numerics.linear.element
        return "fp8" if element.startswith("fp8") else element.split("_")[0]
    return "kv" if numerics.kv_cache is not None else "none"


def whole_model(score: Score, declared: Numerics, moe: bool = False) -> None:
    """The declared numerics, every format with every KV cache and each alone (FP4 formats
    with the caches FP4 rollouts use); and each format on the MLPs only and (MoE) the routed
    experts only: where a format's own noise is large (FP4), applying it to attention too
    moves a side further than its format's share of the rounding brings it back, and the
    right family would not rank ahead on the whole model (NVFP4 experts on the tiny
    Qwen3-MoE: 0.19 whole-model weight-only, against 0.11 for plain bf16)."""
    score(declared)
    for name, caches in ((None, (*KV_CACHES, "nvfp4")), *((f, KV_CACHES) for f in FORMATS),
                         *((f, FP4_KV_CACHES) for f in FP4_FORMATS)):  # fmt: skip
        linear = parse_quantization(name) if name else None
        for cache in (None, *caches):
            score(Numerics(linear, parse_kv_cache(cache) if cache else None))
    for part in PARTS + (("experts",) if moe else ()):
        for name in (*FORMATS, *FP4_FORMATS):
            score(Numerics(replace(parse_quantization(name), only=part), None))


def ranking(tried: dict[str, float]) -> list[tuple[str, float, str]]:
    """Each format family's nearest numerics: (family, residual, text), nearest first."""
    best: dict[str, tuple[float, str]] = {}
    for text, residual in tried.items():
        family = family_of(parse_numerics(text))
        if family not in best or residual < best[family][0]:
            best[family] = (residual, text)
    return sorted(((f, r, t) for f, (r, t) in best.items()), key=lambda row: row[1])


def leading_family(tried: dict[str, float]) -> str | None:
    """The linear format family whose nearest numerics rank ahead of every other linear
    family's by FAMILY_MARGIN, or None. Not against none or a KV cache alone: where the
    engine kept layers, its format on the whole model can lie farther than none."""
    rows = [row for row in ranking(tried) if row[0] not in ("kv", "none")]
    if not rows:
        return None
    first = rows[0]
    if all(first[1] * FAMILY_MARGIN <= other for _, other, _ in rows[1:]):
        return first[0]
    return None


def layer_rules(layers: int, moe: bool, linear: LinearQuantization) -> list[dict]:
    """The ways engines and recipes apply a format to part of the model, as changes to its
    spec: decoder layers kept in bf16 at either end (NeMo-RL's num_layers_at_start/end, verl,
    SkyRL's last 15 %), attention kept, routed experts only (MoE), the LM head, embeddings
    and routers quantized too, and the GEMM run on operands dequantized into the dtype."""
    share = max(1, math.ceil(LAST_SHARE * layers))
    keeps = {(1, 1), (1, 0), (0, 1), (2, 2), (0, share)}
    rules: list[dict] = [
        {"keep_first": a, "keep_last": b} for a, b in sorted(keeps) if a + b < layers
    ]
    rules.append({"only": "mlp"})
    if moe:
        rules.append({"only": "experts"})
    rules += [{"quantized_too": (name,)} for name in ("lm_head", "embeddings")]
    if moe:
        rules.append({"quantized_too": ("router",)})
    if linear.activations != "none":
        rules.append({"gemm": "dequantized"})
    return rules


def _applied(linear: LinearQuantization, rule: dict) -> LinearQuantization | None:
    changes = dict(rule)
    if "quantized_too" in changes:
        changes["quantized_too"] = tuple(sorted({*linear.quantized_too, *rule["quantized_too"]}))
    try:
        return replace(linear, **changes)
    except ValueError:
        return None


def refine(score: Score, tried: dict[str, float], family: str, layers: int, moe: bool) -> None:
    """Around the leading family's REFINED_FORMATS nearest formats (each with the KV cache it
    came nearest with): each layer rule, then the best rule with each other one (a recipe
    keeps the first and last layers and quantizes experts only), while that comes nearer."""
    formats: dict[str, Numerics] = {}
    for text in sorted(tried, key=tried.get):
        numerics = parse_numerics(text)
        if family_of(numerics) == family and numerics.linear.text not in formats:
            formats[numerics.linear.text] = numerics
        if len(formats) == REFINED_FORMATS:
            break
    for base in formats.values():
        rules = layer_rules(layers, moe, base.linear)
        best, best_residual = base, tried[base.text]
        for rule in rules:
            linear = _applied(base.linear, rule)
            if linear is not None:
                candidate = replace(base, linear=linear)
                residual = score(candidate)
                if residual < best_residual:
                    best, best_residual = candidate, residual
        if best is base:
            continue
        for rule in rules:
            linear = _applied(best.linear, rule)
            if linear is not None and linear != best.linear:
                score(replace(best, linear=linear))


def from_onset(score: Score, declared: Numerics, onset: int | None) -> None:
    """A KV cache read from the drift's onset on (queries before it read K/V as computed):
    each cache alone and with the declared linear layers."""
    if not onset:
        return
    for cache in KV_CACHES:
        kv = replace(parse_kv_cache(cache), from_position=int(onset))
        score(Numerics(None, kv))
        if declared.linear is not None:
            score(Numerics(declared.linear, kv))


def pooled_onset(absolute_positions, abs_diff) -> int | None:
    """Where the drift of the judged sequences, pooled, rises: the split of their tokens by
    position into a lower level before and a higher one after (`compare.onset.drift_start`
    on |d| in units of its median). Where the batch showed no onset (a KV cache's step is
    2-3x, under the onset rule's), a hypothesis to re-score, not a claim."""
    import numpy as np

    from pipeline.compare.onset import drift_start

    d = np.asarray(abs_diff, dtype=np.float64)
    if len(d) == 0:
        return None
    unit = max(float(np.median(d)), 1e-12)
    return drift_start(np.asarray(absolute_positions), d / unit)


def lost_scales(score: Score, declared: Numerics) -> None:
    """A declared KV cache with calibrated scales, computed with 1.0 (an engine that lost
    them, NeMo-RL#3225)."""
    kv = declared.kv_cache
    if kv is not None and (kv.k_scale, kv.v_scale) != (1.0, 1.0):
        score(replace(declared, kv_cache=replace(kv, k_scale=1.0, v_scale=1.0)))


def search(score: Score, declared: Numerics, layers: int, moe: bool, onset: int | None = None,
           closer: float = 1.1) -> dict[str, float]:  # fmt: skip
    """Every step, in order: each numerics tried (canonical text) -> its residual. The layer
    rules are searched around the leading family (`leading_family`), or around the best
    format where it came ``closer`` times nearer the side than the declared numerics."""
    tried: dict[str, float] = {}

    def scored(numerics: Numerics) -> float:
        if numerics.text not in tried:
            tried[numerics.text] = score(numerics)
        return tried[numerics.text]

    whole_model(scored, declared, moe)
    lost_scales(scored, declared)
    from_onset(scored, declared, onset)
    best = parse_numerics(min(tried, key=tried.get))
    family = leading_family(tried)
    if (
        family is None
        and best.linear is not None
        and tried[best.text] * closer <= tried[declared.text]
    ):
        family = family_of(best)
    if family is not None:
        refine(scored, tried, family, layers, moe)
    return tried


def lost_scale_words(found: Numerics, declared: Numerics) -> str | None:
    """Words for a found KV cache that is the declared one with its scales lost, else None."""
    kv, want = found.kv_cache, declared.kv_cache
    if not isinstance(kv, KVCacheQuantization) or not isinstance(want, KVCacheQuantization):
        return None
    if replace(want, k_scale=1.0, v_scale=1.0) != kv or (want.k_scale, want.v_scale) == (1, 1):
        return None
    return (
        f"the KV cache computed with K/V scales {kv.k_scale:g}/{kv.v_scale:g}, not the "
        f"calibrated {want.k_scale:g}/{want.v_scale:g} it declares (scales lost on load)"
    )
