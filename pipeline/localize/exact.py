"""`lpx localize --exact`: for stacks meant to be bitwise equal, the first boundary whose
captures differ in any bit, the first element that differs there, and a swap that shows it.

No floor is measured: with nothing allowed to differ, one differing element is the verdict.
Verification runs the runner with the donor's activation at that boundary (then, for two HF
sides, the donor's module for it; then the donor's activations for the op's family from there
on, as swap.py does): every later boundary must come back bitwise equal, or the attempt names
those that still differ.
"""

from __future__ import annotations

import numpy as np

from pipeline.localize.boundaries import family_from, kind_of, layer_of, parse
from pipeline.localize.capture import batches, capture_rows, capture_swapped, check_shapes
from pipeline.localize.measure import Summary, token_divergence
from pipeline.localize.store import CaptureStore


class Bitwise:
    """Elements of one boundary that differ in any bit, fed sequence by sequence, and the
    first of them (in sequence order, then token position, then feature)."""

    __slots__ = ("differing", "elements", "first", "drift")

    def __init__(self) -> None:
        self.differing = 0
        self.elements = 0
        self.first: dict | None = None
        self.drift = Summary()

    def add(self, sequence_id: str, name: str, ours: np.ndarray, theirs: np.ndarray) -> None:
        differs = differing(ours, theirs)
        self.elements += int(differs.size)
        count = int(differs.sum())
        self.drift.add(sequence_id, token_divergence(name, ours, theirs))
        if not count:
            return
        if self.first is None:
            position, feature = (int(i) for i in np.argwhere(differs)[0])
            self.first = {
                "sequence_id": sequence_id,
                "position": position,
                "feature": feature,
                "a": _number(ours[position, feature]),
                "b": _number(theirs[position, feature]),
            }
        self.differing += count


def differing(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """[T, F] booleans: where the two captures are not the same bits (a -0.0 against a 0.0
    differs; the same NaN does not). Captures of two dtypes are compared by value."""
    a, b = a.reshape(a.shape[0], -1), b.reshape(b.shape[0], -1)
    if a.dtype == b.dtype:
        unsigned = np.dtype(f"u{a.dtype.itemsize}")
        return a.view(unsigned) != b.view(unsigned)
    return a.astype(np.float64) != b.astype(np.float64)


def exact_rows(names, tallies: dict[str, Bitwise]) -> list[dict]:
    """One row per boundary: its drift, how many elements differ (the ratio is their share,
    so `beyond` = ratio > margin 0 = any bit differs) and the first that does."""
    rows = []
    for name in names:
        tally = tallies.get(name)
        if tally is None or not tally.elements:
            continue
        rows.append(
            {
                "boundary": name,
                "layer": layer_of(name),
                "kind": kind_of(name),
                "drift": tally.drift.as_dict(),
                "floor": {"max": 0.0, "rms": 0.0},
                "ratio": tally.differing / tally.elements,
                "differing": tally.differing,
                "elements": tally.elements,
                "first_difference": tally.first,
                "beyond": tally.differing > 0,
                "beyond_by": ["bitwise"] if tally.differing else [],
            }
        )
    return rows


def measure(side_a, side_b, sequences, names, store: CaptureStore) -> dict[str, Bitwise]:
    """Both sides' declared forwards, A kept on disk, B compared bit by bit as it arrives."""
    tallies = {name: Bitwise() for name in names}
    wanted = set(names)

    def keep_a(row, name, values):
        if name in wanted:
            store.write("a", row, name, values)

    def against_a(row, name, values):
        if name in wanted:
            store.write("b", row, name, values)
            _tally(store, "a", row, sequences[row][0], name, values, tallies)

    for rows in batches(sequences):
        capture_rows(side_a, sequences, rows, "declared", keep_a)
        capture_rows(side_b, sequences, rows, "declared", against_a)
    return tallies


def verify(side_a, side_b, sequences, names, first: dict, store: CaptureStore) -> dict:
    """Swap the donor's activation (then its module) at `first`: verified when every later
    boundary is bitwise equal to the donor's."""
    from pipeline.localize.swap import who_runs

    target = first["boundary"]
    try:
        runner, donor, runner_key, donor_key = who_runs(side_a, side_b)
    except LookupError as why:
        return {"verified": False, "by": None, "why": str(why), "attempts": []}
    attempts = []

    def attempt(label: str, swapped: list[str], module: str | None) -> dict:
        later = [n for n in names if parse(n) > parse(target) and n not in swapped]
        checked = later if module is None else [target, *later]
        tallies = _rescore(runner, donor, sequences, store, donor_key, swapped, module, names)
        still = [n for n in checked if n in tallies and tallies[n].differing]
        record = {
            "swap": label,
            "swapped": len(swapped) if module is None else module,
            "checked": len(checked),
            "bitwise_equal": not still,
            "still_differing": [
                {"boundary": n, "differing": tallies[n].differing} for n in still[:5]
            ],
        }
        attempts.append(record)
        return record

    record = attempt(f"{donor_key}'s activation at {target}", [target], None)
    if not record["bitwise_equal"] and hasattr(runner, "module_swap"):
        if type(runner) is type(donor):
            record = attempt(f"{donor_key}'s weights for {target}", [], target)
    family = family_from(names, target)
    if not record["bitwise_equal"] and len(family) > 1:
        # a setting every member of the op's family shares (an eps, a rope theta)
        record = attempt(f"{donor_key}'s {parse(target).family} from {target} on", family, None)
    return {
        "verified": record["bitwise_equal"],
        "by": record["swap"] if record["bitwise_equal"] else None,
        "runner": runner_key,
        "attempts": attempts,
    }


def _rescore(runner, donor, sequences, store, donor_key, swapped, module, names):
    tallies = {name: Bitwise() for name in names}
    wanted = set(names)

    def sink(row, name, values):
        if name in wanted:
            _tally(store, donor_key, row, sequences[row][0], name, values, tallies)

    capture_swapped(runner, donor, sequences, store, donor_key, swapped, module, sink)
    return tallies


def _tally(store, key, row, sequence_id, name, values, tallies) -> None:
    """Compare `values` with `key`'s stored capture; `a` and `b` of a first difference are
    always side A's and side B's values, whichever side ran."""
    stored = store.read(key, row, name)
    if stored is None:
        return
    check_shapes(name, sequence_id, stored, values)
    a, b = (stored, values) if key == "a" else (values, stored)
    tallies[name].add(sequence_id, name, a, b)


def _number(value) -> float | int | str:
    """A JSON number for one element ("nan", "inf" as strings: JSON has no such number)."""
    if np.issubdtype(type(value), np.integer):
        return int(value)
    return float(value) if np.isfinite(value) else str(float(value))
