"""The registry of hypothesis families: every family in the order its alternatives are tried
(why that order: the package's docstring), found by the fault kind it commits or the cause
it explains; `register` adds a plugin's or a test's."""

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
