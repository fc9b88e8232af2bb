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


class Family:
    """A hypothesis family: the bugs of one kind, their parameter space, and how to commit
    them in the reference model. The shared flow asks it for hypotheses, lets it search its
    space on the observation, and re-scores, judges and reports for it.

    - ``hypotheses``: what a finding of one of its ``causes`` calls for, from the finding's
      parameters and the fixture's records;
    - ``alternatives``: what it offers for drift another cause failed to reproduce;
    - ``search``: the hypothesis with its free parameters fitted to the observed side
      (with the shared search in `verify/search.py`); most families have none;
    - ``commit``: the rows re-scored under a hypothesis of its ``kinds``, where the plain
      `faults.rescore` of one sequence at a time is not how the bug happens (batches, other
      weights, forced routing); None for the plain re-score;
    - ``judged``: per row, the tokens a reproduction is judged on, where the bug moves only
      some (None: every compared token);
    - ``data``: for bugs written into the logprobs after the forward (no model needed):
      (side, reproduction, what it is set against, tokens judged, judged by the median)."""

    name = ""
    causes: tuple[str, ...] = ()
    kinds: tuple[str, ...] = ()

    def hypotheses(self, ref, finding: Finding) -> list[Candidate]:
        return []

    def alternatives(self, ref, finding: Finding) -> list[Candidate]:
        return []

    def search(self, ref, candidate: Candidate, rows, observed, clean, side) -> Candidate:
        return candidate

    def commit(self, ref, candidate: Candidate, rows: list[int]):
        return None

    def judged(self, ref, rows: list[int]):
        return None

    def data(self, candidate: Candidate, rollout, replay, drifting):
        raise NotImplementedError(f"{self.name} commits no data bug")
