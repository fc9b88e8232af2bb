"""Both rules over one pair of sides: the level measurement (each side declared, and in its
reference precision for its floor), the step rule's forced forwards, and the rows that judge
them (verdict.py). A side's floors come from the floor cache when it holds them, and then its
reference model is never loaded.

Per batch: A declared (kept), A reference (A's level floor), B declared (kept, and compared
with A), B reference (B's level floor). Then the step rule: the runner forced with the donor's
captures (each op's own drift), and each side that can, in its reference precision forced with
its own captures (its local floor).
"""

from __future__ import annotations

from pathlib import Path

from pipeline.localize import floor_cache, step
from pipeline.localize.capture import batches, capture_rows, compare_boundary
from pipeline.localize.measure import Summary
from pipeline.localize.store import CaptureStore
from pipeline.localize.verdict import boundary_rows, with_step
from pipeline.progress import progress_bar


def judged_rows(
    sides: dict, places: dict, device: str, sequences, names, store: CaptureStore, use_cache: bool
) -> tuple[list[dict], dict]:
    """(rows with both rules, what localize.json says about the floors and the step rule).

    `sides` maps "a"/"b" to sessions, `places` to (spec, model_dir)."""
    keys, cached = {}, {}
    if use_cache:
        for key, side in sides.items():
            spec, model_dir = places[key]
            keys[key] = floor_cache.floor_key(side, spec, Path(model_dir), device, sequences)
            cached[key] = floor_cache.read(keys[key]) or {}
    level = {key: (cached.get(key) or {}).get("level") for key in sides}
    drift, measured = _measure(
        sides, sequences, names, store, need=[k for k in sides if level[k] is None]
    )
    level = {key: level[key] if level[key] is not None else measured[key] for key in sides}
    dtypes = (sides["a"].dtype, sides["b"].dtype)
    rows = boundary_rows(names, drift, level["a"], level["b"], dtypes)

    local, about_step = _step(sides, sequences, names, store, cached)
    if local is not None:
        own, floor = local
        rows = with_step(rows, own, floor["a"], floor["b"], dtypes)
    else:
        rows = [
            {**row, "local": None, "beyond_by": ["level"] if row["beyond"] else []} for row in rows
        ]

    source = {}
    for key in sides:
        hit = bool(cached.get(key, {}).get("level")) and (
            not step.can_score_own(sides[key]) or "local" in cached.get(key, {})
        )
        source[key] = "cache" if hit else "measured"
        if use_cache and not hit:
            stored = {"level": level[key]}
            if local is not None and step.can_score_own(sides[key]):
                stored["local"] = local[1][key]
            floor_cache.write(keys[key], stored)
    about_floors = {
        "source": source,
        "cache": str(floor_cache.cache_dir()) if use_cache else None,
    }
    return rows, {"floors": about_floors, "step": about_step}


def _measure(sides: dict, sequences, names, store: CaptureStore, need: list[str]):
    """(A-B drift, {side: its level floor} for the sides in `need`), streamed batch by batch."""
    side_a, side_b = sides["a"], sides["b"]
    drift = {name: Summary() for name in names}
    floors = {key: {name: Summary() for name in names} for key in need}
    wanted = set(names)

    def keep(side):
        def sink(row, name, values):
            if name in wanted:
                store.write(side, row, name, values)

        return sink

    def against(side, out):
        def sink(row, name, values):
            if name in wanted:
                compare_boundary(store, side, row, sequences[row][0], name, values, out)

        return sink

    def keep_b_against_a(row, name, values):
        keep("b")(row, name, values)
        against("a", drift)(row, name, values)

    for rows in progress_bar(batches(sequences), desc="localize", unit="batch"):
        capture_rows(side_a, sequences, rows, "declared", keep("a"))
        if "a" in floors:
            capture_rows(side_a, sequences, rows, "reference", against("a", floors["a"]))
        capture_rows(side_b, sequences, rows, "declared", keep_b_against_a)
        if "b" in floors:
            capture_rows(side_b, sequences, rows, "reference", against("b", floors["b"]))
    return _as_dicts(drift), {key: _as_dicts(table) for key, table in floors.items()}


def _step(sides: dict, sequences, names, store: CaptureStore, cached: dict):
    """((each op's own drift, {side: local floor}), what localize.json says), or (None, why)
    when neither side can run forced with its own outputs reported."""
    found = step.runner_of(sides["a"], sides["b"])
    if found is None:
        why = (
            f"neither {sides['a'].name} nor {sides['b'].name} can report a replaced op's own "
            "output; the level rule alone judges"
        )
        return None, {"runner": None, "why": why}
    runner, _, runner_key, donor_key = found
    own = step.own_drift(runner, runner_key, donor_key, sequences, names, store)
    floors, how = {}, {}
    for key, side in sides.items():
        if step.can_score_own(side):
            stored = cached.get(key, {}).get("local")
            floors[key] = (
                stored
                if stored is not None
                else step.local_floor(side, key, sequences, names, store)
            )
            how[key] = "cache" if stored is not None else "measured"
    for key, side in sides.items():
        if key not in floors:
            floors[key] = step.stand_in_floor(floors[runner_key], runner.dtype, side.dtype)
            how[key] = (
                f"stand-in: {side.name} cannot run forced, so its local floor is "
                f"{sides[runner_key].name}'s"
                + (
                    f" scaled by the unit roundoff ratio {side.dtype}/{runner.dtype}"
                    if side.dtype != runner.dtype
                    else ""
                )
            )
    from pipeline.localize.verdict import STEP_MARGIN

    return (own, floors), {"runner": runner_key, "margin": STEP_MARGIN, "local_floor": how}


def _as_dicts(table: dict) -> dict:
    return {name: summary.as_dict() for name, summary in table.items() if summary.count}
