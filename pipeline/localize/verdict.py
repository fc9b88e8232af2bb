"""Drift against the precision floor, boundary by boundary, and the first one beyond it. Pure.

The floor of a side is what its own declared precision does to each boundary: the same side
in a higher precision (fp32 for bf16/fp16, fp64 for fp32) against the declared one. Two sides
can be apart by both floors at once, so a boundary's floor is the sum of the two sides'; one
rounding of the declared dtype is the least it can be. A boundary is beyond the floor when its
drift exceeds MARGIN times the floor, by the largest token or by the RMS over tokens (the
level rule).

A level rule cannot see a small fault early in the network: the floor there has accumulated
over every layer before it. The step rule asks what Megatron's determinism debugger asks, "the
first op whose output differs while its inputs matched": each op's own drift, measured by
running one side with every boundary forced to the other side's capture while each op
reports its own output first (step.py), against the local floor (the same forced forward in
the reference precision, fed the side's own captures). A boundary is beyond when either rule
says so; the discrete `experts` keep the level rule only.
"""

from __future__ import annotations

from pipeline.localize.boundaries import DISCRETE, kind_of, layer_of
from pipeline.localize.measure import UNIT_ROUNDOFF

# How far beyond the summed floors a boundary must be before precision no longer explains it.
# Clean pairs reach at most ~1.6 (fp32, bf16, TP1 vs TP2, FSDP vs HF, tiny to 32 layers:
# docs/localize.md); seeded faults reach 10 and more at their boundary.
MARGIN = 4.0
# How far an op's own drift (inputs matched) must exceed the summed local floors. Measured on
# clean pairs, 8 x 96 tokens (bench/localize.py --step; docs/localize.md "The step rule"): the
# largest local ratio is 1.00 at tiny, 16 x 1024 and 32 x 512 alike, from fp32 vs bf16, where
# it is 1 by construction (the fp32 runner fed bf16 inputs computes the bf16 side's own
# reference); eager vs SDPA attention reach 0.51-0.90, identical stacks and FSDP vs HF 0. The
# margin is twice the largest clean ratio, not fitted to a fault.
STEP_MARGIN = 2.0


def boundary_rows(names, drift: dict, floor_a: dict, floor_b: dict, dtypes: tuple) -> list[dict]:
    """One row per boundary in network order: its drift, floor, ratio and whether it is beyond.

    `drift`, `floor_a`, `floor_b` map names to Summary.as_dict(); `dtypes` are the two
    declared dtypes (their coarser unit roundoff is the least floor)."""
    least = max(UNIT_ROUNDOFF[d] for d in dtypes)
    rows = []
    for name in names:
        if name not in drift:
            continue
        d, fa, fb = drift[name], floor_a.get(name, {}), floor_b.get(name, {})
        floor = {
            "max": fa.get("max", 0.0) + fb.get("max", 0.0),
            "rms": fa.get("rms", 0.0) + fb.get("rms", 0.0),
        }
        if kind_of(name) in DISCRETE:
            # Tokens whose choice differs: precision explains as many flips as the two
            # floors show, and never fewer than one.
            flips = d["mean"] * d["tokens"]
            floor_flips = fa.get("mean", 0.0) * fa.get("tokens", 0) + fb.get("mean", 0.0) * fb.get(
                "tokens", 0
            )
            ratio = flips / max(floor_flips, 1.0)
            floor["flips"], d = floor_flips, {**d, "flips": flips}
        else:
            ratio = max(
                d["max"] / max(floor["max"], least),
                d["rms"] / max(floor["rms"], least),
            )
        rows.append(
            {
                "boundary": name,
                "layer": layer_of(name),
                "kind": kind_of(name),
                "drift": d,
                "floor": floor,
                "ratio": ratio,
                "beyond": ratio > MARGIN,
            }
        )
    return rows


def with_step(
    rows: list[dict], drift: dict, floor_a: dict, floor_b: dict, dtypes: tuple
) -> list[dict]:
    """`rows` with each op's own drift (`local`: drift, floor, ratio) and `beyond_by`, the
    rules that put it beyond ("level", "step"); `beyond` is either. `drift` maps names to the
    forced forward's Summary.as_dict(), `floor_a`/`floor_b` to each side's local floor."""
    least = max(UNIT_ROUNDOFF[d] for d in dtypes)
    out = []
    for row in rows:
        name = row["boundary"]
        by = ["level"] if row["ratio"] > MARGIN else []
        local = None
        if name in drift and kind_of(name) not in DISCRETE:
            d, fa, fb = drift[name], floor_a.get(name, {}), floor_b.get(name, {})
            floor = {
                "max": fa.get("max", 0.0) + fb.get("max", 0.0),
                "rms": fa.get("rms", 0.0) + fb.get("rms", 0.0),
            }
            ratio = max(
                d["max"] / max(floor["max"], least),
                d["rms"] / max(floor["rms"], least),
            )
            local = {"drift": _brief_summary(d), "floor": floor, "ratio": ratio}
            if ratio > STEP_MARGIN:
                by.append("step")
        out.append({**row, "local": local, "beyond_by": by, "beyond": bool(by)})
    return out


def first_beyond(rows: list[dict]) -> dict | None:
    return next((row for row in rows if row["beyond"]), None)


def within_floor(rows: list[dict], names) -> tuple[bool, dict | None]:
    """(every named boundary within the floor, the worst of them)."""
    chosen = [row for row in rows if row["boundary"] in set(names)]
    worst = max(chosen, key=lambda row: row["ratio"], default=None)
    return (bool(chosen) and not any(row["beyond"] for row in chosen)), worst


def _brief_summary(summary: dict) -> dict:
    return {key: summary[key] for key in ("max", "rms", "worst") if key in summary}
