"""Verification by swapping: run one side with the other's activations, or weights, at the
localised boundary, and see whether everything after it falls back within the floor.

The attempts, smallest first:
1. the other side's activation at that one boundary;
2. the other side's weights (in its dtype) for the module that computes it;
3. the other side's activations for that op at its layer and every later one (a
   misconfiguration such as an eps or a rope theta reaches the op at every layer);
4. as 3, plus the next op that is still beyond the floor (a fault with two sites, such as a
   row-parallel all-reduce that both attention and MLP outputs go through).
The first that leaves every checked boundary within the floor verifies the localisation.

A boundary only the step rule put beyond had everything after it within the level floor
before any swap, so the level floor alone cannot show a swap did anything: such a swap must
also cut the worst level ratio after it by the step margin (to 0, for two stacks that differ
only there).
"""

from __future__ import annotations

from pipeline.localize.boundaries import family_from, parse
from pipeline.localize.capture import capture_swapped, compare_boundary
from pipeline.localize.measure import Summary
from pipeline.localize.store import CaptureStore
from pipeline.localize.verdict import STEP_MARGIN, boundary_rows, first_beyond, within_floor


def verify(side_a, side_b, sequences, rows: list[dict], first: dict, store: CaptureStore):
    names = [row["boundary"] for row in rows]
    floors = _floors(rows)
    target = first["boundary"]
    step_only = first.get("beyond_by") == ["step"]
    try:
        runner, donor, runner_key, donor_key = who_runs(side_a, side_b)
    except NoSwap as why:
        return {"verified": False, "by": None, "why": str(why), "attempts": []}
    attempts = []

    def attempt(label: str, swapped: list[str], module: str | None = None) -> dict:
        checked = [n for n in names if parse(n) > parse(target) and n not in swapped]
        if module is not None:
            checked = [n for n in names if parse(n) >= parse(target)]
        after = _rescore(
            runner, sequences, store, runner_key, donor_key, swapped, module, donor, names
        )
        after_rows = boundary_rows(names, after, *floors, (side_a.dtype, side_b.dtype))
        ok, worst = within_floor(after_rows, checked)
        before = max((r["ratio"] for r in rows if r["boundary"] in set(checked)), default=0.0)
        if step_only and worst is not None:
            ok = ok and worst["ratio"] <= before / STEP_MARGIN
        remaining = first_beyond([r for r in after_rows if r["boundary"] in set(checked)])
        record = {
            "swap": label,
            "swapped": len(swapped) if module is None else module,
            "checked": len(checked),
            "within_floor": ok,
            "worst": None if worst is None else _brief(worst),
            "worst_ratio_before": before,
            "first_remaining": None if remaining is None else _brief(remaining),
            "logits_ratio": _ratio_of(after_rows, "logits"),
        }
        attempts.append(record)
        return record

    record = attempt(f"{donor_key}'s activation at {target}", [target])
    if not record["within_floor"] and hasattr(runner, "module_swap"):
        if type(runner) is type(donor):
            record = attempt(f"{donor_key}'s weights for {target}", [], module=target)
    if not record["within_floor"]:
        family = family_from(names, target)
        label = f"{donor_key}'s {parse(target).family} from {target} on"
        if len(family) > 1:
            record = attempt(label, family)
        if not record["within_floor"] and record["first_remaining"]:
            second = record["first_remaining"]["boundary"]
            both = sorted(set(family) | set(family_from(names, second)), key=parse)
            record = attempt(f"{label}, and its {parse(second).family} from {second} on", both)
    return {
        "verified": bool(record["within_floor"]),
        "by": record["swap"] if record["within_floor"] else None,
        "runner": runner_key,
        "attempts": attempts,
        "logits_ratio_before": _ratio_of(rows, "logits"),
    }


def who_runs(side_a, side_b):
    """(runner, donor, runner_key, donor_key): the side that takes the other's activations,
    A if it can, else B; NoSwap when neither can."""
    if getattr(side_a, "can_replace", False):
        return side_a, side_b, "a", "b"
    if getattr(side_b, "can_replace", False):
        return side_b, side_a, "b", "a"
    raise NoSwap(f"neither {side_a.name} nor {side_b.name} can take the other's activations")


class NoSwap(LookupError):
    pass


def _rescore(runner, sequences, store, runner_key, donor_key, swapped, module, donor, names):
    """The runner's drift from the donor's stored captures with the swap in place."""
    wanted = set(names)
    drift = {name: Summary() for name in names}

    def sink(row, name, values):
        if name in wanted:
            compare_boundary(store, donor_key, row, sequences[row][0], name, values, drift)

    capture_swapped(runner, donor, sequences, store, donor_key, swapped, module, sink)
    return {name: s.as_dict() for name, s in drift.items() if s.count}


def _floors(rows: list[dict]) -> tuple[dict, dict]:
    """The floors as boundary_rows takes them: the summed floor as A's, zero as B's."""
    floor_a = {}
    for row in rows:
        floor = row["floor"]
        entry = {"max": floor["max"], "rms": floor["rms"]}
        if "flips" in floor:
            entry.update(mean=floor["flips"], tokens=1)
        floor_a[row["boundary"]] = entry
    return floor_a, {}


def _ratio_of(rows: list[dict], name: str) -> float | None:
    return next((row["ratio"] for row in rows if row["boundary"] == name), None)


def _brief(row: dict) -> dict:
    return {"boundary": row["boundary"], "ratio": row["ratio"]}
