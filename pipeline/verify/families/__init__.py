"""The hypothesis families, in the order their alternatives are tried on drift no signature
explained: the sampler's (truncation, temperature, the rollout's whole processing) and
routing first, then what edits the input, what moves positions, labels or padding, then
how the model config was read (a window, RoPE, eps, soft-caps, a tied head), then
precisions and numerics other than declared (a plain dtype first: its finding is never taken
away by a format), and other weights last (they explain any drift, so every cheaper reading
goes first). Data bugs
(no model) are tried before all of them by the flow.

The sampler's families re-process one forward's head logits; the input and position
families re-score the sequences under each setting they search (a position offset search
is tens of forwards at 16 x 1024), so a processing the signatures took for a truncation
is reached first (min-p at 16 x 1024: 177 s before, with 100 s of position and padding
searches ahead of it)."""

from __future__ import annotations

from pipeline.verify.families.inflight import InFlight
from pipeline.verify.families.model_config import ModelConfig
from pipeline.verify.families.numerics import NumericsFamily
from pipeline.verify.families.padding import Padding
from pipeline.verify.families.positions import Positions
from pipeline.verify.families.precision import Precision
from pipeline.verify.families.processing import LogitsProcessing
from pipeline.verify.families.prompt import Prompt
from pipeline.verify.families.routing import Routing
from pipeline.verify.families.shifts import Shifts
from pipeline.verify.families.temperature import Temperature
from pipeline.verify.families.truncation import Truncation
from pipeline.verify.families.weights import Weights
from pipeline.verify.hypothesis import Family

FAMILIES: tuple[Family, ...] = (
    Truncation(),
    Routing(),
    Temperature(),
    LogitsProcessing(),
    Prompt(),
    Positions(),
    Shifts(),
    Padding(),
    ModelConfig(),
    Precision(),
    NumericsFamily(),
    Weights(),
    InFlight(),
)
_BY_KIND = {kind: family for family in FAMILIES for kind in family.kinds}
_BY_CAUSE = {cause: family for family in FAMILIES for cause in family.causes}
_PLAIN = Family()  # a kind faults.rescore commits as it is


def register(family: Family, before: type[Family] | None = None) -> Family:
    """Adds a family (a plugin's, a test's): its alternatives are tried in FAMILIES' order,
    so it goes before ``before`` (default: before the precisions and weights, which explain
    any drift and so come last). Returns it."""
    global FAMILIES
    ahead = before or Precision
    at = next(i for i, f in enumerate(FAMILIES) if isinstance(f, ahead))
    FAMILIES = (*FAMILIES[:at], family, *FAMILIES[at:])
    _BY_KIND.update(dict.fromkeys(family.kinds, family))
    _BY_CAUSE.update(dict.fromkeys(family.causes, family))
    return family


def unregister(family: Family) -> None:
    global FAMILIES
    FAMILIES = tuple(f for f in FAMILIES if f is not family)
    for table, keys in ((_BY_KIND, family.kinds), (_BY_CAUSE, family.causes)):
        for key in keys:
            if table.get(key) is family:
                del table[key]


def families() -> tuple[Family, ...]:
    """Every family, in the order their alternatives are tried (registered ones included)."""
    return FAMILIES


def is_data(kind: str) -> bool:
    """Whether a kind is written into the logprobs after the forward (judged without the
    model)."""
    return kind in family_of(kind).data_kinds


def family_of(kind: str) -> Family:
    """The family that commits a fault kind (a plain one for faults.py's own kinds)."""
    return _BY_KIND.get(kind, _PLAIN)


def for_cause(cause: str) -> Family | None:
    """The family whose hypotheses a finding of this cause calls for."""
    return _BY_CAUSE.get(cause)
