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
from pipeline.trajectory.parting import Parting, exact_model_positions, token_partings
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
    precision (model tokens whose whole context is exact)."""
    partings: list[Parting] = []
    exact = np.zeros_like(table.completion_mask)
    for row, trajectory in enumerate(trajectories_of(table, source)):
        partings += token_partings(trajectory, tokenizer)
        prompt_len = len(table.prompt_of(row))
        base = table.completion_slice(row).start
        for position in exact_model_positions(trajectory):
            if position >= prompt_len:
                exact[base + position - prompt_len] = True
    return partings, exact & table.completion_mask


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
