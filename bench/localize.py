"""Localisation at scale (issue 23): seeded faults named exactly and verified, clean pairs
localizing nothing, and the time to capture and compare.

Scales: the tiny model (2 x 128), a random llama 16 x 1024, a deeper one 32 x 512 (init std
0.05, as the other benches), and two Qwen2-MoE models (2 x 128 and 8 x 512) for the routing
fault. Each fault of pipeline/faults/capture.py is committed on side B of an HF pair, in fp32
and (where it means something in bf16) in bf16; a case counts as exact when the named boundary
is the fault's own (layer and op), and as verified when a swap brought everything after it
back within the floor. Clean pairs are the same model through different implementations
(eager and SDPA attention; and the other engines' capture adapters where they are installed:
FSDP, Megatron TP2, vLLM) in fp32 and bf16: their largest drift/floor ratio is printed, and
must stay under the margin.

    .venv/bin/python bench/localize.py                      # every scale (about 15 min on 2 cores)
    .venv/bin/python bench/localize.py --scales tiny --clean-only
    .venv/bin/python bench/localize.py --timing             # 8 sequences, 16 x 1024, both sides
    .venv/bin/python bench/localize.py --step               # the step rule's clean ratios and
                                                            # stale layers, three scales

Every case prints the level ratio (drift / summed floors) and the step ratio (the op's own
drift with its inputs forced equal / summed local floors) at the boundary that matters, and
which rule put the first boundary beyond.
"""

from __future__ import annotations

import argparse
import os
import resource
import tempfile
import time
from pathlib import Path

import _bootstrap  # noqa: F401
from models import random_llama, random_moe, tiny

from pipeline.faults.capture import FAULTS, expected_boundary
from pipeline.fixture.table import table_from_sequences
from pipeline.localize.run import localize
from pipeline.localize.verdict import MARGIN, STEP_MARGIN

# Where the captures run: the CPU, or `LPX_LOCALIZE_DEVICE=cuda` on a GPU host.
DEVICE = os.environ.get("LPX_LOCALIZE_DEVICE", "cpu")
SCALES = {
    "tiny": lambda: tiny(),
    "16x1024": lambda: random_llama(16, 1024, std=0.05),
    "32x512": lambda: random_llama(32, 512, std=0.05),
    "24x2048": lambda: random_llama(24, 2048, std=0.05),  # on a GPU: LPX_LOCALIZE_DEVICE=cuda
    "moe-2x128": lambda: random_moe(layers=2, width=128, experts=8, top_k=2),
    "moe-8x512": lambda: random_moe(layers=8, width=512, experts=8, top_k=2),
}
FAULT_SCALES = ("tiny", "16x1024", "moe-2x128", "moe-8x512")
FP32_ONLY = {"lm_head_bf16", "tp_allreduce_bf16"}  # in bf16 both are the declared precision
DENSE_ONLY = {"tp_allreduce_bf16"}


def token_table(sequences: int = 8, length: int = 96, prompt: int = 24):
    """Fixture rows from the bundled corpus, tokenized by the tiny model's tokenizer (every
    bench model shares it): real text, deterministic, offline."""
    from transformers import AutoTokenizer

    from pipeline.tinymodel.build import bundled_corpus

    tokenizer = AutoTokenizer.from_pretrained(str(tiny()), local_files_only=True)
    ids = tokenizer(bundled_corpus())["input_ids"]
    rows = [ids[i * length : (i + 1) * length] for i in range(sequences)]
    return table_from_sequences(
        "fixture",
        [f"{i}-0" for i in range(sequences)],
        [[1] + r[: prompt - 1] for r in rows],
        [r[prompt - 1 :] for r in rows],
        {"rollout": [[0.0] * (len(r) - prompt + 1) for r in rows]},
    )


SEQUENCES = 8
ONLY_HF = False  # --hf-only: clean pairs of the HF side's two kernels only (faster at scale)


def run(model: Path, spec_a: str, spec_b: str, table, count: int | None = None, **options) -> dict:
    count = SEQUENCES if count is None else count
    options.setdefault("floor_cache", False)  # each case measures its floors, unless timed
    with tempfile.TemporaryDirectory() as work:
        options.setdefault("device", DEVICE)
        return localize(table, model, spec_a, spec_b, list(range(count)), Path(work), **options)


def ratios_at(result: dict, boundary: str | None) -> tuple[float | None, float | None]:
    """(level ratio, step ratio) at `boundary`."""
    row = next((r for r in result["boundaries"] if r["boundary"] == boundary), None)
    if row is None:
        return None, None
    return row["ratio"], (row.get("local") or {}).get("ratio")


def worst_step(result: dict) -> tuple[float, str | None]:
    rows = [r for r in result["boundaries"] if r.get("local")]
    worst = max(rows, key=lambda r: r["local"]["ratio"], default=None)
    return (worst["local"]["ratio"], worst["boundary"]) if worst else (0.0, None)


def _fmt(value) -> str:
    return "-" if value is None else f"{value:.3g}"


def fault_cases(scale: str, layers: int, moe: bool):
    for kind in FAULTS:
        if (kind == "moe_routing_flip") != moe or (moe and kind in DENSE_ONLY):
            continue
        for dtype in ("fp32", "bf16"):
            if dtype == "bf16" and kind in FP32_ONLY:
                continue
            layer = layers // 2
            yield kind, dtype, layer


def _visible(done: list[dict], row: dict, result: dict) -> tuple[bool, float | None]:
    """Whether a fault is larger than bf16 explains: its own size (the fp32 case's drift at
    its boundary, measured free of bf16 noise) over the bf16 floor there, against the margin.
    A fault under the floor moves no logprob beyond what precision does: no tool can name it,
    and it is reported apart rather than counted."""
    fp32 = next((r for r in done if r["kind"] == row["kind"] and r["dtype"] == "fp32"), None)
    here = next((b for b in result["boundaries"] if b["boundary"] == row["expected"]), None)
    if fp32 is None or here is None or fp32.get("drift") is None:
        return True, None
    if "flips" in here["floor"]:  # chosen experts: tokens flipped, against the floor's flips
        size = fp32["drift"]["flips"] / max(here["floor"]["flips"], 1.0)
    else:
        size = max(
            fp32["drift"]["rms"] / max(here["floor"]["rms"], 1e-30),
            fp32["drift"]["max"] / max(here["floor"]["max"], 1e-30),
        )
    return size > MARGIN, size


def clean_pairs(moe: bool):
    if ONLY_HF:
        return [(f"hf:dtype={d}", f"hf:dtype={d},attention=eager") for d in ("fp32", "bf16")]
    pairs = []
    for dtype in ("fp32", "bf16"):
        pairs.append((f"hf:dtype={dtype}", f"hf:dtype={dtype},attention=eager"))
        if not moe:
            pairs += [
                (f"hf:dtype={dtype}", f"fsdp:nproc=2,dtype={dtype}"),
                (f"hf:dtype={dtype}", f"megatron:tp=2,dtype={dtype}"),
                (f"hf:dtype={dtype}", f"vllm:dtype={dtype}"),
            ]
    return pairs


def bench_scale(scale: str, faults: bool, clean: bool) -> dict:
    model = SCALES[scale]()
    moe = scale.startswith("moe")
    layers = int(scale.split("-")[-1].split("x")[0]) if scale != "tiny" else 2
    table = token_table(sequences=SEQUENCES)
    out = {"faults": [], "clean": []}
    if faults and scale in FAULT_SCALES:
        for kind, dtype, layer in fault_cases(scale, layers, moe):
            spec_b = f"hf:dtype={dtype},fault={kind},fault_layer={layer}"
            result = run(model, f"hf:dtype={dtype}", spec_b, table)
            named = (result["first"] or {}).get("boundary")
            expected = expected_boundary(kind, layer)
            verification = result["verification"] or {}
            row = {
                "kind": kind,
                "dtype": dtype,
                "expected": expected,
                "named": named,
                "exact": named == expected,
                "verified": bool(verification.get("verified")),
                "by": verification.get("by"),
                "ratio": (result["first"] or {}).get("ratio"),
                "rules": (result["first"] or {}).get("beyond_by"),
                "level_step": ratios_at(result, expected),
                "seconds": result["seconds"],
                "drift": next(
                    (b["drift"] for b in result["boundaries"] if b["boundary"] == expected), None
                ),
            }
            if dtype == "bf16":
                row["visible"], row["size"] = _visible(out["faults"], row, result)
            out["faults"].append(row)
            hidden = "" if row.get("visible", True) else f" [under the floor: {row['size']:.2g}]"
            print(
                f"  {scale:9} {kind:18} {dtype:4}{hidden} expected {expected:20} named {named!s:20} "
                f"{'EXACT' if row['exact'] else 'WRONG'} "
                f"{'verified' if row['verified'] else 'NOT verified'} "
                f"({row['ratio'] or 0:.3g} x floor, {row['seconds']:.1f} s) by {row['by']}; "
                f"at {expected}: level {_fmt(row['level_step'][0])}, step "
                f"{_fmt(row['level_step'][1])}, fired {row['rules']}",
                flush=True,
            )
    if clean:
        for spec_a, spec_b in clean_pairs(moe):
            try:
                result = run(model, spec_a, spec_b, table)
            except Exception as error:  # an engine that is not installed here
                print(f"  {scale:9} clean {spec_a} vs {spec_b}: skipped ({error})".strip()[:160])
                continue
            worst = max(result["boundaries"], key=lambda r: r["ratio"])
            step, step_at = worst_step(result)
            row = {
                "a": spec_a,
                "b": spec_b,
                "verdict": result["verdict"],
                "max_ratio": worst["ratio"],
                "at": worst["boundary"],
                "max_step": step,
                "step_at": step_at,
                "seconds": result["seconds"],
            }
            out["clean"].append(row)
            print(
                f"  {scale:9} clean {spec_a:16} vs {spec_b:30} {row['verdict']:9} max ratio "
                f"{row['max_ratio']:.2f} at {row['at']}, max step ratio {step:.2f} at {step_at} "
                f"({row['seconds']:.1f} s)",
                flush=True,
            )
    return out


STEP_SCALES = ("tiny", "16x1024", "32x512")
STEP_CLEAN = [
    ("hf", "hf:attention=eager"),
    ("hf:dtype=bf16", "hf:dtype=bf16,attention=eager"),
    ("hf", "hf:dtype=bf16"),
    ("hf:dtype=bf16", "hf:dtype=bf16"),
    ("hf:dtype=bf16", "fsdp:nproc=2,dtype=bf16"),
]
STALE_STEPS = (0.02, 0.03)  # seeded.STALE_STEP, and a 3 % variant


def step_bench(scales) -> None:
    """The step rule's clean local ratios at three scales (what STEP_MARGIN rests on), then
    stale layers in bf16 and which rule names them."""
    largest = {}
    for scale in scales:
        model = SCALES[scale]()
        table = token_table(sequences=SEQUENCES)
        layer = 1 if scale == "tiny" else 3
        for spec_a, spec_b in STEP_CLEAN:
            if spec_b.startswith("fsdp") and scale != "tiny":
                continue  # two torchrun ranks per case: quick on the tiny model only
            try:
                result = run(model, spec_a, spec_b, table)
            except Exception as error:  # an engine that is not installed here
                print(f"  {scale:9} clean {spec_a} vs {spec_b}: skipped ({error})"[:160])
                continue
            step, at = worst_step(result)
            level = max(r["ratio"] for r in result["boundaries"])
            largest[scale] = max(largest.get(scale, 0.0), step)
            print(
                f"  {scale:9} clean {spec_a:14} vs {spec_b:30} {result['verdict']:8} level "
                f"{level:.2f}, step {step:.2f} at {at} ({result['seconds']:.1f} s)",
                flush=True,
            )
        for size in STALE_STEPS:
            spec_b = f"hf:dtype=bf16,fault=stale_layer,fault_layer={layer},fault_step={size}"
            result = run(model, "hf:dtype=bf16", spec_b, table)
            expected = expected_boundary("stale_layer", layer)
            level, step = ratios_at(result, expected)
            first = result["first"] or {}
            print(
                f"  {scale:9} stale_layer {size:g} bf16 at {expected}: level {_fmt(level)}, "
                f"step {_fmt(step)}; {result['verdict']} at {first.get('boundary')} by "
                f"{first.get('beyond_by')} ({result['seconds']:.1f} s)",
                flush=True,
            )
    print(
        "largest clean step ratio: "
        + ", ".join(f"{scale} {value:.2f}" for scale, value in largest.items())
        + f" (STEP_MARGIN {STEP_MARGIN:g})"
    )


def timing() -> None:
    model = SCALES["16x1024"]()
    table = token_table(sequences=8, length=96)
    started = time.perf_counter()
    for label, options in (("no floor cache", {}), ("floors cached", {"floor_cache": True})):
        if options:  # the first run fills the cache; the second is timed
            run(model, "hf:dtype=bf16", "hf:dtype=bf16,attention=eager", table, **options)
        started = time.perf_counter()
        result = run(model, "hf:dtype=bf16", "hf:dtype=bf16,attention=eager", table, **options)
        seconds = time.perf_counter() - started
        print(
            f"timing ({label}): 8 sequences x 96 tokens, 16 x 1024, bf16 both sides: "
            f"{seconds:.1f} s (target < 30 s: ratio {seconds / 30:.2f}); verdict "
            f"{result['verdict']}; floors {result['floors']['source']}",
            flush=True,
        )
    long = token_table(sequences=1, length=2048, prompt=64)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    started = time.perf_counter()
    run(model, "hf:dtype=bf16", "hf:dtype=bf16,attention=eager", long, count=1)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    captured = 2048 * 1024 * 4 * len(result["boundaries"]) / 2**30
    print(
        f"timing: 1 sequence x 2048 tokens: {time.perf_counter() - started:.1f} s, peak RSS "
        f"{peak / 2**20:.2f} GiB (was {before / 2**20:.2f}); one side's captures would be "
        f"{captured:.2f} GiB held whole"
    )


def main() -> int:
    global SEQUENCES, ONLY_HF
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scales", default=",".join(SCALES))
    parser.add_argument("--clean-only", action="store_true")
    parser.add_argument("--faults-only", action="store_true")
    parser.add_argument("--timing", action="store_true")
    parser.add_argument("--step", action="store_true", help="the step rule's clean ratios")
    parser.add_argument("--sequences", type=int, default=8, help="per case (8)")
    parser.add_argument("--hf-only", action="store_true", help="clean pairs: HF kernels only")
    args = parser.parse_args()
    SEQUENCES = args.sequences
    ONLY_HF = args.hf_only
    if args.timing:
        timing()
        return 0
    if args.step:
        given = args.scales != ",".join(SCALES)
        step_bench(args.scales.split(",") if given else STEP_SCALES)
        return 0
    totals = {"hidden": 0, "cases": 0, "exact": 0, "verified": 0, "clean": 0, "clean_localized": 0}
    worst_clean = 0.0
    for scale in args.scales.split(","):
        print(f"{scale}:", flush=True)
        out = bench_scale(scale, not args.clean_only, not args.faults_only)
        counted = [r for r in out["faults"] if r.get("visible", True)]
        totals["cases"] += len(counted)
        totals["hidden"] += len(out["faults"]) - len(counted)
        totals["exact"] += sum(r["exact"] for r in counted)
        totals["verified"] += sum(r["exact"] and r["verified"] for r in counted)
        totals["clean"] += len(out["clean"])
        totals["clean_localized"] += sum(r["verdict"] != "clean" for r in out["clean"])
        worst_clean = max([worst_clean] + [r["max_ratio"] for r in out["clean"]])
    cases = max(totals["cases"], 1)
    print(
        f"faults named exactly: {totals['exact']}/{totals['cases']} "
        f"({totals['exact'] / cases:.0%}; target 95%), verified {totals['verified']}/"
        f"{totals['exact']}; clean pairs localized: {totals['clean_localized']}/"
        f"{totals['clean']}; faults under the bf16 floor (not counted): {totals['hidden']} "
        f"(largest drift/floor {worst_clean:.2f}, margin {MARGIN:g}: "
        f"headroom {MARGIN / max(worst_clean, 1e-9):.1f}x)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
