"""Prompt edits: the prompt one side scored is not the fixture's. A BOS added (tokenizer BOS
plus a template's) or dropped; the chat template's tokens that every prompt shares, at its
start or its end, doubled (a template applied to a templated prompt) or missing; long prompts
cut from the left at a max prompt length (searched between the longest clean prompt and the
shortest cut one)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from pipeline.contracts.causes import Cause
from pipeline.contracts.report import Finding
from pipeline.faults import rescore
from pipeline.verify.hypothesis import Candidate, Family
from pipeline.verify.search import closest, rescored_gap, with_settings

TEMPLATE_LENGTHS = 32  # template lengths searched, up to what every prompt shares
TRUNCATION_SPAN = 64  # max prompt lengths searched above the longest clean prompt


class Prompt(Family):
    name = "prompt"
    causes = (Cause.PROMPT_MISMATCH,)
    kinds = ("bos_extra", "bos_missing", "template_edit", "prompt_truncated")

    def hypotheses(self, ref, finding: Finding) -> list[Candidate]:
        return self.alternatives(ref, finding)

    def alternatives(self, ref, finding: Finding) -> list[Candidate]:
        base = ref.base
        return [
            Candidate(Cause.PROMPT_MISMATCH, "bos_extra", base, {"extra_leading": base.bos_id}),
            Candidate(Cause.PROMPT_MISMATCH, "bos_missing", base, {"missing_leading": 1}),
            *_template_edits(ref),
            *_truncation(ref, finding),
        ]

    def search(self, ref, candidate, rows, observed, clean, side) -> Candidate:
        if candidate.kind == "template_edit":
            # the template is what every prompt shares, or a leading part of it (prompts can
            # share their first words too): its length searched on one sequence
            gap = rescored_gap(ref, rows[0], observed[0])
            most = candidate.params["tokens"]
            lengths = np.unique(np.linspace(1, most, min(most, TEMPLATE_LENGTHS)).round())
            tries = ({**candidate.params, "tokens": int(n)} for n in lengths)
            return closest((replace(candidate, params=p) for p in tries), gap)
        if candidate.kind != "prompt_truncated":
            return candidate
        lengths = [len(ref.fixture.prompt_of(r)) for r in rows]
        shortest = int(np.argmin(lengths))
        low = candidate.settings.max_prompt or 1
        gap = rescored_gap(ref, rows[shortest], observed[shortest])
        limits = range(low, min(lengths[shortest], low + TRUNCATION_SPAN))
        if not limits:
            return candidate
        tries = (with_settings(candidate, {"max_prompt": n}, max_prompt=n) for n in limits)
        return closest(tries, gap)

    def commit(self, ref, candidate, rows):
        if candidate.kind != "template_edit":
            return None
        edited = [(edit(prompt, candidate.params), c) for prompt, c in ref.pairs(rows)]
        return ref.compared(rescore(ref.model, edited, "clean", ref.base), rows)


def edit(prompt, params: dict) -> np.ndarray:
    """The prompt with its template tokens (after a leading BOS, which stays) doubled or
    removed."""
    prompt = np.asarray(prompt, dtype=np.int64)
    lead, n = params.get("after", 0), params["tokens"]
    head, body = prompt[:lead], prompt[lead:]
    part = body[:n] if params["where"] == "prefix" else body[-n:]
    if params["edit"] == "doubled":
        body = np.concatenate([part, body] if params["where"] == "prefix" else [body, part])
    else:
        body = body[n:] if params["where"] == "prefix" else body[:-n]
    edited = np.concatenate([head, body])
    return edited if len(edited) else prompt[:1]


def _template_edits(ref) -> list[Candidate]:
    prompts = [np.asarray(ref.fixture.prompt_of(r)) for r in range(ref.fixture.num_sequences)]
    # a leading BOS is the tokenizer's, not the template's: it stays where it is
    lead = int(all(len(p) and p[0] == ref.base.bos_id for p in prompts))
    out = []
    for where in ("prefix", "suffix"):
        tokens = _shared([p[lead:] for p in prompts], from_end=where == "suffix")
        if tokens < 1:
            continue
        for how in ("doubled", "missing"):
            params = {"where": where, "edit": how, "tokens": tokens, "after": lead}
            out.append(Candidate(Cause.PROMPT_MISMATCH, "template_edit", ref.base, params))
    return out


def _shared(prompts: list[np.ndarray], from_end: bool = False) -> int:
    """How many leading (or trailing) tokens every prompt shares, short of a whole prompt."""
    if len(prompts) < 2:
        return 0
    shortest = min(len(p) for p in prompts)
    n = 0
    while n < shortest - 1:
        column = {int(p[-1 - n] if from_end else p[n]) for p in prompts}
        if len(column) != 1:
            break
        n += 1
    return n


def _truncation(ref, finding: Finding) -> list[Candidate]:
    """A max prompt length that cut exactly the drifting prompts: the longest clean one."""
    drifting = set(finding.sequences) | ref.drifting
    fixture = ref.fixture
    clean = [len(fixture.prompt_of(row)) for sid, row in ref.rows.items() if sid not in drifting]
    longest = max((len(fixture.prompt_of(ref.rows[s])) for s in drifting if s in ref.rows),
                  default=0)  # fmt: skip
    if not clean or max(clean) >= longest:
        return []
    limit = max(clean)
    settings = replace(ref.base, max_prompt=limit)
    return [Candidate(Cause.PROMPT_MISMATCH, "prompt_truncated", settings, {"max_prompt": limit})]
