"""Trajectories in a fixture: rebuilt from its metadata, checked for token-exactness, and the
mask compare judges precision on.

A fixture of trajectories (agent_loop.py, or ingested) keeps per sequence the turns' roles
and spans over prompt + completion, and each model turn's context where it is not the
sequence's own prefix. Compare judges against precision only the model tokens whose whole
context is exact; every parting is a `trajectory_tokens` finding of its own.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pipeline.errors import BadInput
from pipeline.trajectory.parting import (
    MASK_CLASSES,
    Parting,
    exact_model_positions,
    token_partings,
)
from pipeline.trajectory.shape import Trajectory, make_trajectory


def has_trajectories(table) -> bool:
    return bool(table.metadata.get("trajectories"))


def trajectories_of(table, source: str = "") -> list[Trajectory]:
    described = table.metadata.get("trajectories") or {}
    out = []
    for row, sequence_id in enumerate(table.sequence_ids):
        entry = described.get(sequence_id)
        if entry is None:
            raise BadInput(f"{source}: sequence {sequence_id!r} has no trajectory in the metadata")
        prompt = [int(v) for v in table.prompt_of(row)]
        completion_slice = table.completion_slice(row)
        flat = prompt + [int(v) for v in table.completion_ids[completion_slice]]
        mask = [0] * len(prompt) + [int(v) for v in table.completion_mask[completion_slice]]
        rollout = table.channels.get("rollout")
        turns = []
        for k, turn in enumerate(entry["turns"]):
            start, end = int(turn["start"]), int(turn["end"])
            if not 0 <= start < end <= len(flat):
                raise BadInput(
                    f"{source}: trajectory {sequence_id!r}, turn {k}: span [{start}, {end}) does "
                    f"not fit its {len(flat)} tokens"
                )
            raw = {"role": turn["role"], "ids": flat[start:end]}
            if turn["role"] == "assistant":
                at = completion_slice.start + start - len(prompt)
                raw["logprobs"] = (
                    rollout[at : at + end - start].tolist() if rollout is not None
                    else [0.0] * (end - start)
                )  # fmt: skip
                context = turn.get("context_ids")
                raw["context_ids"] = context if context is not None else flat[:start]
            turns.append(raw)
        out.append(make_trajectory(sequence_id, turns, flat, mask, source))
    return out


def token_check(table, tokenizer, source: str = "") -> tuple[list[Parting], np.ndarray]:
    """Every parting, and the completion mask of the tokens compare may judge against
    precision (model tokens whose whole context is exact, in turns no mask fault names)."""
    partings: list[Parting] = []
    exact = np.zeros_like(table.completion_mask)
    ingested = (table.metadata.get("agent_loop") or {}).get("mode") == "ingested"
    for row, trajectory in enumerate(trajectories_of(table, source)):
        found = token_partings(trajectory, tokenizer)
        if ingested:
            found += mask_against_logprobs(table, row, trajectory)
        partings += found
        faulty = {p.turn for p in found if p.cause in MASK_CLASSES}
        spans = trajectory.spans()
        prompt_len = len(table.prompt_of(row))
        base = table.completion_slice(row).start
        for position in exact_model_positions(trajectory):
            in_fault = any(s <= position < e for k, (s, e) in enumerate(spans) if k in faulty)
            if position >= prompt_len and not in_fault:
                exact[base + position - prompt_len] = True
    return partings, exact & table.completion_mask


def turns_from_mask(table, source) -> dict:
    """An agent loop's dump as turns: the prompt one user turn, then each run of the
    response mask a turn, model (1) or tool (0). Contexts are the sequence's own prefix
    (a dump of token-in-token-out turns records no other)."""
    described = {}
    for row, sequence_id in enumerate(table.sequence_ids):
        prompt_len = len(table.prompt_of(row))
        mask = table.completion_mask[table.completion_slice(row)].astype(bool)
        if not mask.any():
            raise BadInput(
                f"{source}: trajectory {sequence_id!r} has no model token (its mask is all 0); "
                "a multi-turn dump masks 1 on generated tokens"
            )
        turns = [{"role": "user", "start": 0, "end": prompt_len}]
        start = 0
        for i in range(1, len(mask) + 1):
            if i == len(mask) or mask[i] != mask[start]:
                role = "assistant" if mask[start] else "tool"
                turns.append({"role": role, "start": prompt_len + start, "end": prompt_len + i})
                start = i
        described[sequence_id] = {"turns": turns}
    return described


def _has_logprob(values: np.ndarray) -> np.ndarray:
    """Where a dump recorded a logprob: frameworks write 0.0 (verl, SkyRL) or nothing on
    the tokens they did not generate."""
    with np.errstate(invalid="ignore"):
        return np.isfinite(values) & (values != 0.0)


def mask_against_logprobs(table, row: int, trajectory: Trajectory) -> list[Parting]:
    """A dump's mask against where its logprobs are: a model turn whose 1s sit one token
    off from its logprobs at both ends (the first generated token masked, a token with no
    logprob scored, or the other way) is `mask_off_by_one`."""
    rollout = table.channels.get("rollout")
    if rollout is None:
        return []
    prompt_len = len(table.prompt_of(row))
    values = rollout[table.completion_slice(row)].astype(np.float64)
    present = _has_logprob(values)
    faults = []
    for k, (start, end) in enumerate(trajectory.spans()):
        if not trajectory.turns[k].is_model:
            continue
        s, e = start - prompt_len, end - prompt_len  # completion coordinates
        # both ends must show it, but for an end the sequence cuts (its last turn)
        late = s >= 1 and present[s - 1] and (not present[e - 1] or e == len(present))
        early = e < len(present) and present[e] and (not present[s] or s == 0)
        if late or early:
            shift = 1 if late else -1
            faults.append(Parting(
                trajectory.id, k, start - 1 if late else start, "mask_off_by_one", "verified",
                turns=[k],
                evidence=(f"the mask's 1s sit {shift:+d} token from the turn's logprobs: "
                          f"token {start - 1 if late else end} has a logprob and no mask, token "
                          f"{end - 1 if late else start} a mask and no logprob"),
            ))  # fmt: skip
    return faults


def tokenizer_for(table, model_dir: Path | None = None):
    """The fixture model's tokenizer (the model directory it names, or the one given); None
    where there is none to read: partings are then found but not classed."""
    from transformers import AutoTokenizer

    path = model_dir or (table.metadata.get("model") or {}).get("path")
    if not path or not Path(path).is_dir():
        return None
    return AutoTokenizer.from_pretrained(path)


PARTINGS_SHOWN = 20  # partings listed in a finding's details; the count says how many in all


def token_findings(partings: list[Parting], excluded_tokens: int) -> list:
    """One `trajectory_tokens` finding per class of parting: its trajectories, the first
    turn and position, and the partings themselves (the first PARTINGS_SHOWN)."""
    from pipeline.contracts.causes import Cause, Severity, Status
    from pipeline.contracts.report import Finding

    by_class: dict[str, list[Parting]] = {}
    for parting in partings:
        by_class.setdefault(parting.cause, []).append(parting)
    findings = []
    for name, found in by_class.items():
        first = min(found, key=lambda p: (p.turn, p.position))
        trajectories = sorted({p.trajectory for p in found})
        findings.append(Finding(
            cause=Cause.TRAJECTORY_TOKENS,
            sequences=trajectories,
            sequence_count=len(trajectories),
            first_position={"sequence": first.trajectory, "turn": first.turn,
                            "position": first.position},
            evidence=f"{name}: {first}; {first.evidence}",
            severity=Severity.FAULT,
            status=Status.VERIFIED if all(p.status == "verified" for p in found)
            else Status.PLAUSIBLE,
            details={"class": name, "partings": [p.as_dict() for p in found[:PARTINGS_SHOWN]],
                     "partings_count": len(found),
                     "model_tokens_outside_precision": excluded_tokens},
        ))  # fmt: skip
    return findings


def token_turns(table, aligned) -> np.ndarray:
    """Per compared completion token, the index of its model turn (0 = each trajectory's
    first model turn; -1 outside every model turn)."""
    described = table.metadata.get("trajectories") or {}
    index = table.index_of()
    region = aligned.completion
    turn = np.full(len(region.positions), -1, dtype=np.int64)
    for i, sequence_id in enumerate(aligned.sequence_ids):
        row = index[sequence_id]
        prompt_len = len(table.prompt_of(row))
        lo, hi = int(region.offsets[i]), int(region.offsets[i + 1])
        positions = region.positions[lo:hi]
        spans = [(t["start"] - prompt_len, t["end"] - prompt_len)
                 for t in described.get(sequence_id, {}).get("turns", [])
                 if t["role"] == "assistant"]  # fmt: skip
        for n, (start, end) in enumerate(spans):
            turn[lo:hi][(positions >= start) & (positions < end)] = n
    return turn


def by_turn(turn: np.ndarray, aligned, expected=None) -> list[dict]:
    """The compared tokens' drift per model-turn index (1 = each trajectory's first model
    turn; ``turn`` from `token_turns`): where a gap grows with the turns, it shows here. With
    ``expected`` (each token's calibrated mean |d|), also the floor those tokens have."""
    region = aligned.completion
    diff = region.train.astype(np.float64) - region.rollout.astype(np.float64)
    rows = []
    for n in range(int(turn.max(initial=-1)) + 1):
        chosen = turn == n
        if chosen.any():
            row = {"turn": n + 1, "tokens": int(chosen.sum()),
                   "mean_abs_diff": float(np.abs(diff[chosen]).mean()),
                   "max_abs_diff": float(np.abs(diff[chosen]).max()),
                   "mean_diff": float(diff[chosen].mean())}  # fmt: skip
            if expected is not None:
                row["floor_mean_abs_diff"] = float(np.asarray(expected)[chosen].mean())
            rows.append(row)
    return rows
