"""Running sides over batches of sequences and comparing each boundary as it arrives: what
the measuring run (run.py) and the swaps (swap.py) share."""

from __future__ import annotations

from pipeline.errors import BadInput
from pipeline.localize.measure import token_divergence
from pipeline.localize.store import CaptureStore

# Token positions per padded capture batch: enough to amortise a forward's fixed cost over a
# handful of short sequences, small enough that the forward's own activations stay modest.
BATCH_TOKENS = 4096


def batches(sequences: list, budget: int = BATCH_TOKENS) -> list[list[int]]:
    """Row indices grouped so each padded batch holds at most `budget` token positions (a
    longer sequence runs alone): a handful of short sequences share one forward, a long one
    never makes the others wait in memory."""
    groups, current, width = [], [], 0
    for row, (_, ids) in enumerate(sequences):
        wider = max(width, len(ids))
        if current and wider * (len(current) + 1) > budget:
            groups.append(current)
            current, wider = [], len(ids)
        current.append(row)
        width = wider
    return groups + [current] if current else groups


def capture_rows(
    side, sequences, rows: list[int], precision: str, sink, replace=None, own_first=False
) -> None:
    """Capture `rows` of `sequences` on `side`, calling sink(row, boundary, values); batched
    where the adapter can, one sequence at a time where it cannot. With `own_first`, each
    replaced boundary reports the side's own output before it is replaced (the step rule)."""
    batch = [sequences[row][1] for row in rows]
    extra = {"own_first": True} if own_first else {}
    if hasattr(side, "capture_batch"):
        side.capture_batch(
            batch,
            precision,
            lambda index, name, values: sink(rows[index], name, values),
            None if replace is None else [replace(row) for row in rows],
            **extra,
        )
        return
    for row, ids in zip(rows, batch, strict=True):
        side.capture(
            ids,
            precision,
            lambda name, values, row=row: sink(row, name, values),
            None if replace is None else replace(row),
            **extra,
        )


def capture_swapped(runner, donor, sequences, store, donor_key: str, swapped, module, sink):
    """The runner's declared forward of every sequence with a swap in place: the donor's
    stored activations at the `swapped` boundaries, or (`module`) the donor's weights for the
    module computing that boundary. `sink(row, boundary, rows)` sees what the runner computes."""

    def replace(row):
        return {name: store.read(donor_key, row, name) for name in swapped}

    for rows in batches(sequences):
        if module is not None:
            with runner.module_swap(module, donor):
                capture_rows(runner, sequences, rows, "declared", sink)
        else:
            capture_rows(runner, sequences, rows, "declared", sink, replace=replace)


def compare_boundary(
    store: CaptureStore, side: str, row: int, sequence_id: str, name: str, values, out
) -> None:
    """Add one sequence's divergence at `name` from the stored capture of `side` to
    out[name] (a Summary)."""
    stored = store.read(side, row, name)
    if stored is None:
        return
    check_shapes(name, sequence_id, stored, values)
    out[name].add(sequence_id, token_divergence(name, stored, values))


def check_shapes(name: str, sequence_id: str, stored, values) -> None:
    if stored.shape != values.shape:
        raise BadInput(
            f"boundary {name} of sequence {sequence_id}: shapes differ between the sides "
            f"({stored.shape} vs {values.shape}); the two engines do not run the same model "
            "layout (check heads, experts and vocabulary)."
        )
