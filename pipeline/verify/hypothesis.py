"""What verification passes around: a hypothesis (a fault kind with its parameters), the
outcome of re-scoring it, the family interface, and the margins every family is judged by."""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.contracts.report import Finding
from pipeline.faults import FaultSettings

VERIFY_MARGIN = 3.0  # a reproduction leaves at most this many times the floor's mean |d|
EXPLAINED = 0.5  # and removes at least this fraction of the drift it set out to explain
DATA_DRIFT = 5.0  # a data bug is judged on tokens whose |d| is this many times their floor
FILL_EXACT = 1e-6  # a constant written into logprobs is the constant, to float32 rounding
MIN_DRIFTING = 3  # drifting tokens a reproduction is judged on, where there are this many
MAX_SEQUENCES = 16  # re-scored per hypothesis, spread evenly over the finding's sequences
# A hypothesis is first judged on this many of them (the most drifting and the median one);
# only one that comes within SCREEN_SLACK times the verdict's margin there, or explains the
# drift there, is re-scored on all of them. Most hypotheses are wrong, and far from it.
SCREEN_SEQUENCES = 2
SCREEN_SLACK = 2.0


@dataclass
class Candidate:
    """One hypothesis to re-score: a fault kind with its parameters."""

    cause: str
    kind: str
    settings: FaultSettings
    params: dict


@dataclass
class Outcome:
    candidate: Candidate
    side: str  # rollout or replay: the side the reproduction matches best
    before: float
    after: float
    floor: float
    verified: bool
    seconds: float
    screened_on: int = 0  # ruled out on this many sequences (the screen), else 0


class Family:
    """A hypothesis family: the bugs of one kind, their parameter space, and how to commit
    them in the reference model. The shared flow asks it for hypotheses, lets it search its
    space on the observation, and re-scores, judges and reports for it; it knows no family
    by name, so a family is its module and its place in `families.registry.FAMILIES`
    (`register`).

    What a family declares:
    - ``causes``: the findings whose hypotheses it gives; ``kinds``: the fault kinds it
      commits; ``data_kinds``: those written into the logprobs after the forward (judged
      without the model, by ``data``); ``own_judgement``: kinds it judges itself (``judge``);
    - ``explains_fills``: its alternatives may explain a constant in the logprobs (a one-token
      kept set scores exactly 0), so they are tried against a verified fill;
    - ``per_sequence``: parameters it searches per sequence (not part of a reproduction's
      shape when findings are merged);
    - ``screened``: its hypotheses are judged on SCREEN_SEQUENCES sequences first (False for
      a family whose search needs the spread of many sequences to see its bug at all).

    What it does (every method has a neutral default):
    - ``hypotheses``: what a finding of one of its ``causes`` calls for;
    - ``alternatives``: what it offers for drift another cause failed to reproduce;
    - ``any_shape``: what it offers before the runner-up, for drift of any shape (a lower
      precision than declared, other published weights);
    - ``search``: the hypothesis with its free parameters fitted to the observed side;
    - ``commit``: the rows re-scored under a hypothesis of its ``kinds`` (None: the plain
      `faults.rescore` of one sequence at a time);
    - ``judged``: per row, the tokens a reproduction is judged on (None: every one);
    - ``data``: (side, reproduction, what it is set against, tokens judged, judged by the
      median) for a data kind;
    - ``judge``: the outcome of an ``own_judgement`` kind;
    - ``finished``: a verified finding completed (a shift's onset);
    - ``untestable``: after every reproduction failed, the finding that remains plausible
      without what re-scoring would need (other weights), or None;
    - ``words``: how a verified outcome of its kinds reads, and its severity;
    - ``tried_words``: how a failed try of its kinds reads (None: the shared wording);
    - ``merged``: the findings after verification, with its own duplicates merged."""

    name = ""
    causes: tuple[str, ...] = ()
    kinds: tuple[str, ...] = ()
    data_kinds: tuple[str, ...] = ()
    own_judgement: tuple[str, ...] = ()
    explains_fills = False
    per_sequence: tuple[str, ...] = ()
    screened = True

    def hypotheses(self, ref, finding: Finding) -> list[Candidate]:
        return []

    def alternatives(self, ref, finding: Finding) -> list[Candidate]:
        return []

    def any_shape(self, ref, finding: Finding) -> list[Candidate]:
        return []

    def search(self, ref, candidate: Candidate, rows, observed, clean, side) -> Candidate:
        return candidate

    def commit(self, ref, candidate: Candidate, rows: list[int]):
        return None

    def judged(self, ref, rows: list[int]):
        return None

    def data(self, candidate: Candidate, rollout, replay, drifting):
        raise NotImplementedError(f"{self.name} commits no data bug")

    def judge(self, ref, candidate: Candidate, rows, observed) -> Outcome:
        raise NotImplementedError(f"{self.name} judges nothing itself")

    def finished(self, ref, finding: Finding, candidate: Candidate) -> Finding:
        return finding

    def untestable(self, ref, finding: Finding) -> Finding | None:
        return None

    def words(self, outcome: Outcome, how: str) -> tuple[str, str]:
        from pipeline.contracts.causes import Severity

        return how, Severity.FAULT

    def tried_words(self, tried: dict) -> str | None:
        return None

    def merged(self, findings: list[Finding]) -> list[Finding]:
        return findings
