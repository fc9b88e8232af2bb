"""calibration.json: what `lpx calibrate` writes (calibrate/run.py) and compare judges by,
one model. Types, ranges, finite values and monotone quantiles are held: a NaN quantile
compares false with every |d| and a negative one makes every token drift, and either could
end as a PASS. Fields lpx does not know are kept: a newer `lpx calibrate` may write more (the
format number says when an old reader must refuse). Floors: compare/floor.py.

`lpx calibrate` writes the model with `calibration_text`: fields in the order declared here,
the unknown ones after them, and no default it was not given, so the model holds the file as
written and gives its bytes back."""

from __future__ import annotations

import json
import math
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    Field,
    StringConstraints,
    ValidatorFunctionWrapHandler,
    WrapValidator,
    model_validator,
)

from pipeline.contracts.base import Open
from pipeline.contracts.numerics import check_precision

CALIBRATION_FORMAT = 2  # 1 predates the precision gate (no design, no variant levels)
# the plain ones; a precision with numerics (bfloat16+fp8_e4m3:w=tensor,a=tensor) is one of
# these dtypes and what contracts/numerics.py writes after it
PRECISIONS = ("float32", "bfloat16", "float16", "float32+tf32")
# Rounding puts a mean of equal samples, or an interpolated quantile, a few ulps past its
# neighbour; anything further is not rounding.
RELATIVE_SLACK = 1e-9
COUNT_MAX = 2**63 - 1  # counts go into the history's integer columns


def _whole_kept(value: Any, check: ValidatorFunctionWrapHandler) -> Any:
    """A whole number stays an int: a strict float field accepts 16 but holds 16.0, and the
    model dumped would say 16.0 where the file said 16 (position edges are whole numbers)."""
    checked = check(value)
    return value if type(value) is int else checked


AsWritten = WrapValidator(_whole_kept)
Count = Annotated[int, Field(ge=1, le=COUNT_MAX)]
Tally = Annotated[int, Field(ge=0, le=COUNT_MAX)]
Magnitude = Annotated[float, Field(ge=0, allow_inf_nan=False), AsWritten]  # |d|, its moments
Signed = Annotated[float, Field(allow_inf_nan=False), AsWritten]
Fraction = Annotated[float, Field(ge=0, le=1, allow_inf_nan=False), AsWritten]
AtLeastOne = Annotated[float, Field(ge=1, allow_inf_nan=False), AsWritten]
Name = Annotated[str, StringConstraints(min_length=1)]
Precision = Annotated[str, AfterValidator(check_precision)]
PairKey = Annotated[str, StringConstraints(pattern=r"^[^|]+\|[^|]+$")]


class Cell(Open):
    """The |d| samples of one bucket (floor.py `_cell`)."""

    n: Count
    mean: Magnitude
    max: Magnitude
    q50: Magnitude
    q90: Magnitude
    q99: Magnitude
    q999: Magnitude
    var: Magnitude
    m3: Signed  # a third central moment: either sign
    mean_sq: Magnitude
    var_sq: Magnitude
    mean_expm1: Magnitude
    var_expm1: Magnitude
    sketch: Annotated[list[Magnitude], Field(min_length=1)]

    @model_validator(mode="after")
    def _monotone(self) -> Cell:
        ladder = [("q50", self.q50), ("q90", self.q90), ("q99", self.q99)]
        ladder += [("q999", self.q999), ("max", self.max)]
        for (low_name, low), (high_name, high) in zip(ladder, ladder[1:], strict=False):
            _ordered(low, high, f"{low_name} ({low:g}) must not exceed {high_name} ({high:g})")
        _ordered(self.mean, self.max, f"mean ({self.mean:g}) must not exceed max ({self.max:g})")
        for index, (low, high) in enumerate(zip(self.sketch, self.sketch[1:], strict=False)):
            _ordered(
                low, high, f"sketch[{index + 1}] ({high:g}) is below sketch[{index}] ({low:g})"
            )
        _ordered(
            self.sketch[-1], self.max, f"sketch ends at {self.sketch[-1]:g}, past max {self.max:g}"
        )
        return self


class Design(Open):
    """How strongly one sequence's tokens share their noise (precision_gate.design_of)."""

    icc: Fraction
    icc_tail: Fraction
    sequences: Count
    mean_length: Magnitude
    design_effect: AtLeastOne
    design_effect_tail: AtLeastOne


class TauExceedance(Open):
    count: Tally
    samples: Tally

    @model_validator(mode="after")
    def _within(self) -> TauExceedance:
        if self.count > self.samples:
            raise ValueError(f"count ({self.count}) exceeds samples ({self.samples})")
        return self


class Estimate(Open):
    """A statistic and its standard error (compare/signed.py)."""

    value: Signed
    se: Magnitude
    # the standard deviation of the value across the correct ways it was measured
    spread: Magnitude | None = None


class SignedStatistics(Open):
    """The sign statistics of noise alone with one side as the rollout."""

    surprisal_slope: Estimate
    position_slope: Estimate
    ratio_mean: Estimate
    mean_sq: Estimate
    # where the draws held tokens seen earlier in their context and tokens not
    seen_gap: Estimate | None = None
    tokens: Count
    sequences: Count

    @model_validator(mode="after")
    def _square_not_negative(self) -> SignedStatistics:
        if self.mean_sq.value < 0:
            raise ValueError(f"mean_sq.value ({self.mean_sq.value:g}) must not be negative")
        return self


class SignedNull(Open):
    """What noise alone gives the drift's sign structure (calibrate/run.py `signed_null`):
    drawn at the rollout's temperature, keyed by the precision that rolled out."""

    temperature: Annotated[float, Field(gt=0, allow_inf_nan=False), AsWritten]
    draws: Count
    by_rollout: Annotated[dict[Precision, SignedStatistics], Field(min_length=1)]


class Floor(Open):
    """One pair of precisions (calibrate/run.py `fit_pair`, floor.py `fit_floor`)."""

    tokens: Count
    all: Cell
    cells: dict[str, Cell]
    surprisal_edges: Annotated[list[Magnitude], Field(min_length=1)]
    position_edges: Annotated[list[Magnitude], Field(min_length=1)]
    spread: Annotated[float, Field(ge=1 - RELATIVE_SLACK, allow_inf_nan=False), AsWritten]
    # fit_pair's widest over narrowest wide variant; declared for its place in the file, and
    # as loosely as the unknown field it was (a type would refuse files read today)
    allowance: Any = None
    variant_means: dict[Name, Magnitude]
    variants: Count
    fitted_on: Annotated[list[Name], Field(min_length=1)]
    design: Design
    tau_exceedance: TauExceedance
    sequence_mean_abs_max: Magnitude
    # absent in calibrations made before the sign statistics, and for greedy rollouts
    signed: SignedNull | None = None

    @model_validator(mode="after")
    def _consistent(self) -> Floor:
        for name, edges in (("surprisal", self.surprisal_edges), ("position", self.position_edges)):
            if any(b <= a for a, b in zip(edges, edges[1:], strict=False)):
                raise ValueError(f"{name}_edges must increase, not {edges}")
        if self.all.n != self.tokens:
            raise ValueError(f"all.n ({self.all.n}) must equal tokens ({self.tokens})")
        rows, columns = len(self.surprisal_edges), len(self.position_edges)
        for name in self.cells:
            parts = name.split(",")
            if not (
                1 <= len(parts) <= 2
                and all(p.isdigit() and p.isascii() for p in parts)
                and int(parts[0]) < rows
                and (len(parts) == 1 or int(parts[1]) < columns)
            ):
                raise ValueError(
                    f"cell {name!r} is not a bucket of these edges (S or S,P with S < {rows}, "
                    f"P < {columns})"
                )
        unknown = [label for label in self.fitted_on if label not in self.variant_means]
        if unknown:
            raise ValueError(f"fitted_on names {unknown[0]!r}, which is not in variant_means")
        return self


class Key(Open):
    """What the calibration is valid for (calibrate/run.py `calibration_key`)."""

    format: Count | None = None
    model_fingerprint: str | None = None
    model_path: str | None = None
    engine: str | None = None
    layout: dict[str, object] | None = None
    hardware: str | None = None
    versions: dict[str, str | None] | None = None


class Calibration(Open):
    lpx_calibration: Literal[2]
    key: Key
    created_at: str
    sequences: Count
    tokens: Count
    micro_batches: Annotated[list[Count], Field(min_length=1)]
    precisions: Annotated[list[Precision], Field(min_length=1)]
    timing_s: dict[str, Magnitude] = {}
    pairs: Annotated[dict[PairKey, Floor], Field(min_length=1)]

    @model_validator(mode="after")
    def _pairs_of_precisions(self) -> Calibration:
        for key in self.pairs:
            a, b = key.split("|")
            if a not in self.precisions or b not in self.precisions:
                measured = ", ".join(self.precisions)
                raise ValueError(f"`pairs.{key}`: not two of the precisions measured ({measured})")
            if a > b:  # compare looks pairs up by their sorted names (calibrated.pair_key)
                raise ValueError(f"`pairs.{key}`: must name its precisions in order, {b}|{a}")
        return self


def calibration_text(calibration: Calibration) -> str:
    """calibration.json's text: the fields as given (none of the defaults added), indented
    by one space."""
    return json.dumps(calibration.model_dump(exclude_unset=True), indent=1) + "\n"


def _ordered(low: float, high: float, message: str) -> None:
    if low > high + RELATIVE_SLACK * abs(high) + math.ulp(0.0):
        raise ValueError(message)
