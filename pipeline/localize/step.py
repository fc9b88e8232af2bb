"""The step rule's two measurements: each op's own drift with its inputs matched, and each
side's local precision floor (verdict.with_step judges them).

Own drift: the runner (a side that takes activations and can report a replaced op's own output,
`scores_own`) runs its declared precision with EVERY boundary forced to the donor's stored
capture. Each op then computes from the donor's inputs, reports its own output, and hands the
donor's output on, so the divergence at boundary n is op n's own contribution alone: nothing
upstream carries into it. Two identical stacks give exactly 0.

Local floor of a side: the same forced forward in its reference precision, fed the side's own
declared captures, against those captures: what the declared precision does inside each op.
A side that cannot run it (vLLM, Megatron, a server) takes the runner's local floor as a
stand-in, scaled by the two dtypes' unit roundoff ratio when they differ; the result says so.
"""

from __future__ import annotations

from collections.abc import Mapping

from pipeline.localize.capture import batches, capture_rows, compare_boundary
from pipeline.localize.measure import UNIT_ROUNDOFF, Summary
from pipeline.localize.store import CaptureStore


def runner_of(side_a, side_b):
    """(runner, donor, runner_key, donor_key) for the forced forward: A if it can, else B;
    None when neither side can report a replaced op's own output."""
    for runner, donor, keys in ((side_a, side_b, ("a", "b")), (side_b, side_a, ("b", "a"))):
        if can_score_own(runner):
            return runner, donor, *keys
    return None


def can_score_own(side) -> bool:
    """Whether `side` can run forced with every boundary replaced, reporting each op's own
    output first (HF, and FSDP and DeepSpeed through the HF hooks)."""
    return bool(getattr(side, "can_replace", False) and getattr(side, "scores_own", False))


def own_drift(runner, runner_key, donor_key, sequences, names, store: CaptureStore) -> dict:
    """Each op's own drift: the runner forced with the donor's captures, against them."""
    return _forced(runner, "declared", donor_key, sequences, names, store)


def local_floor(side, key: str, sequences, names, store: CaptureStore) -> dict:
    """What the side's declared precision does inside each op: its reference precision forced
    with its own declared captures, against them."""
    return _forced(side, "reference", key, sequences, names, store)


def stand_in_floor(floor: dict, from_dtype: str, to_dtype: str) -> dict:
    """A local floor measured on a side in `from_dtype`, as the floor of a side in `to_dtype`
    that cannot measure its own: scaled by the ratio of their unit roundoffs."""
    scale = UNIT_ROUNDOFF[to_dtype] / UNIT_ROUNDOFF[from_dtype]
    return {
        name: {**row, "max": row["max"] * scale, "rms": row["rms"] * scale}
        for name, row in floor.items()
    }


class StoredRows(Mapping):
    """One sequence's stored captures of one side, read from disk only when a hook asks, so a
    forced forward never holds every boundary of a batch at once."""

    def __init__(self, store: CaptureStore, key: str, row: int, names):
        self.store, self.key, self.row, self.names = store, key, row, frozenset(names)

    def __getitem__(self, name):
        values = self.store.read(self.key, self.row, name) if name in self.names else None
        if values is None:
            raise KeyError(name)
        return values

    def __contains__(self, name) -> bool:
        return name in self.names and self.store.path(self.key, self.row, name).is_file()

    def __iter__(self):
        return iter(n for n in self.names if n in self)

    def __len__(self) -> int:
        return sum(1 for _ in self)


def _forced(side, precision: str, key: str, sequences, names, store: CaptureStore) -> dict:
    """`side` at `precision` with every boundary forced to `key`'s captures, each op's own
    output compared with `key`'s capture of it."""
    wanted = set(names)
    drift = {name: Summary() for name in names}

    def sink(row, name, values):
        if name in wanted:
            compare_boundary(store, key, row, sequences[row][0], name, values, drift)

    for rows in batches(sequences):
        capture_rows(
            side,
            sequences,
            rows,
            precision,
            sink,
            replace=lambda row: StoredRows(store, key, row, names),
            own_first=True,
        )
    return {name: s.as_dict() for name, s in drift.items() if s.count}
