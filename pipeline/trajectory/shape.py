"""A trajectory as the field dumps one: turns with their token ids, what the engine generated
each model turn from, and the sequence the trainer scores with its loss mask.

A model turn (role ``assistant``) carries the engine's logprobs, one per token, and the
context the engine generated it from (its prompt ids as sent). Every other turn (system,
user, tool) carries ids only. ``flat_ids`` and ``loss_mask`` are the trainer's: 1 marks a
token the loss scores (a model token), 0 a tool, environment or template token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from pipeline.errors import BadInput

MODEL_ROLE = "assistant"
ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class Turn:
    role: str
    ids: tuple[int, ...]
    logprobs: tuple[float, ...] | None = None  # model turns: the rollout engine's
    context_ids: tuple[int, ...] | None = None  # model turns: what the engine generated from

    @property
    def is_model(self) -> bool:
        return self.role == MODEL_ROLE


@dataclass(frozen=True)
class Trajectory:
    id: str
    turns: tuple[Turn, ...]
    flat_ids: tuple[int, ...]
    loss_mask: tuple[int, ...]
    source: str = ""  # the file (and line) it came from, for messages
    meta: dict = field(default_factory=dict, compare=False)

    def where(self, turn: int | None = None) -> str:
        place = f"{self.source}: " if self.source else ""
        return f"{place}trajectory {self.id!r}" + ("" if turn is None else f", turn {turn}")

    def model_turns(self) -> list[int]:
        return [k for k, turn in enumerate(self.turns) if turn.is_model]

    def concatenated(self) -> tuple[int, ...]:
        """The turns' ids end to end: the sequence token-in-token-out builds."""
        return tuple(i for turn in self.turns for i in turn.ids)

    def spans(self) -> list[tuple[int, int]]:
        """Each turn's [start, end) in the concatenated sequence."""
        out, start = [], 0
        for turn in self.turns:
            out.append((start, start + len(turn.ids)))
            start += len(turn.ids)
        return out


def _ints(values, what: str) -> tuple[int, ...]:
    try:
        out = tuple(int(v) for v in values)
    except (TypeError, ValueError):
        raise BadInput(f"{what}: token ids must be integers") from None
    if any(v < 0 for v in out):
        raise BadInput(f"{what}: token ids must not be negative")
    return out


def make_turn(raw: dict, trajectory: str, k: int) -> Turn:
    """A turn from a dict with role, ids and, on model turns, logprobs and context_ids."""
    where = f"{trajectory}, turn {k}"
    role = raw.get("role")
    if role not in ROLES:
        raise BadInput(f"{where}: role {role!r} is not one of {', '.join(ROLES)}")
    ids = _ints(raw.get("ids") or (), f"{where} ({role})")
    if not ids:
        raise BadInput(f"{where} ({role}): a turn needs at least one token id")
    logprobs = raw.get("logprobs")
    context = raw.get("context_ids")
    if role != MODEL_ROLE:
        if logprobs is not None:
            raise BadInput(
                f"{where} ({role}): logprobs on a {role} turn; only model turns ({MODEL_ROLE}) "
                "are generated, so only they carry the engine's logprobs"
            )
        return Turn(role, ids)
    if logprobs is None or len(logprobs) != len(ids):
        count = "none" if logprobs is None else len(logprobs)
        raise BadInput(
            f"{where} (assistant): {count} logprobs for {len(ids)} tokens; a model turn needs "
            "one logprob per generated token"
        )
    values = tuple(float(v) for v in logprobs)
    if any(not (v <= 0.0) for v in values):  # also NaN
        raise BadInput(f"{where} (assistant): a logprob above 0 or NaN; logprobs are log p <= 0")
    return Turn(role, ids, values, _ints(context, f"{where} context") if context else None)


def make_trajectory(
    trajectory_id: str,
    turns: Sequence[dict],
    flat_ids: Sequence[int] | None = None,
    loss_mask: Sequence[int] | None = None,
    source: str = "",
) -> Trajectory:
    """A checked trajectory. Without flat_ids the trainer's sequence is the turns end to end
    and the mask is 1 on model turns (what a token-in-token-out loop hands the trainer)."""
    where = f"{source}: trajectory {trajectory_id!r}" if source else f"trajectory {trajectory_id!r}"
    if not turns:
        raise BadInput(f"{where}: no turns")
    built = tuple(make_turn(raw, where, k) for k, raw in enumerate(turns))
    if not any(turn.is_model for turn in built):
        raise BadInput(f"{where}: no model ({MODEL_ROLE}) turn to judge")
    if flat_ids is None:
        flat = tuple(i for turn in built for i in turn.ids)
        mask = tuple(int(turn.is_model) for turn in built for _ in turn.ids)
    else:
        flat = _ints(flat_ids, f"{where} flat_ids")
        if loss_mask is None:
            raise BadInput(f"{where}: flat_ids without a loss_mask; give one 0/1 per token")
        mask_values = tuple(loss_mask)
        if len(mask_values) != len(flat):
            raise BadInput(
                f"{where}: loss_mask has {len(mask_values)} values for {len(flat)} flat_ids; "
                "give one 0/1 per token"
            )
        bad = [v for v in mask_values if v not in (0, 1, True, False)]
        if bad:
            raise BadInput(f"{where}: loss_mask holds {bad[0]!r}; a loss mask is 0 or 1")
        mask = tuple(int(v) for v in mask_values)
    return Trajectory(trajectory_id, built, flat, mask, source)
