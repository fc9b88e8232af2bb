"""report.json: what `lpx compare` writes and `lpx record` and `lpx localize --report`
validate, as one set of models.

Compare builds a `Report` and writes its JSON; a reader validates the file with the same
model. Reports are inputs too: a report someone edited, truncated or wrote with another tool
must not reach the history as a pass (a metric written as the string "0.1" would go
unjudged, an id of 2**70 would overflow the database's integers), so types are strict
and ranges are held. Fields lpx does not know are kept as they are: a newer compare may write
more. The bulk rows (sequences, worst tokens) and the metadata stay plain dicts, typed by
TypedDicts, so a year of reports validates in pydantic-core without a Python object a row.

A report can also be well-formed and still contradict itself: it says pass while a limited
metric is NaN or over its limit. That is not bad input to refuse (the run happened, and its
directory may be all that is left of it) but a run the history must not count as a pass:
`contradictions` names them.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Annotated, Any, Literal, NotRequired, Required

from pydantic import (
    Field,
    PlainValidator,
    ValidationError,
    WrapValidator,
    with_config,
)
from pydantic_core import InitErrorDetails
from typing_extensions import TypedDict

from pipeline.contracts.base import OPEN, Open, held_as_written
from pipeline.contracts.causes import Cause, Severity, Status
from pipeline.contracts.metrics import BY_NAME, VERDICT_METRICS
from pipeline.contracts.problems import INT32_MAX, INT64_MAX, must_be

VERDICTS = ("pass", "fail")
NON_FINITE = ("nan", "inf", "-inf")  # how JSON holds non-finite numbers (compare/outputs.py)
# Rounding may put a fraction a few ulps past its bound; anything further is not rounding.
SLACK = 1e-9

Verdict = Literal[VERDICTS]
Count = Annotated[int, Field(ge=0, le=INT64_MAX)]
Index = Annotated[int, Field(ge=0, le=INT32_MAX)]
Seed = Annotated[int, Field(ge=-INT64_MAX, le=INT64_MAX)]


def _version(value):
    if isinstance(value, (str, int, float)) and not isinstance(value, bool):
        return value
    raise must_be("a version string")


Version = Annotated[str | int | float, PlainValidator(_version)]


def _named(enum):
    """A value of ``enum``, or a string it does not know (a newer lpx's), kept as written."""

    def validate(value):
        if not isinstance(value, str):
            raise must_be("a string")
        try:
            return enum(value)
        except ValueError:
            return value

    return PlainValidator(validate)


# -- numbers that may be non-finite ------------------------------------------------------


def as_float(value) -> float | None:
    """A number as a float ("nan"/"inf" strings included); None for anything else."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if value in NON_FINITE:
        return float(value)
    return None


def number_check(low: float = -math.inf, high: float = math.inf):
    """A number within [low, high]; non-finite values are allowed (written "nan"/"inf") and
    are judged by the policy, not refused here. Returns the check and what it expects."""
    if math.isinf(low) and math.isinf(high):
        expected = 'a number (or "nan"/"inf")'
    elif math.isinf(high):
        expected = f'a number >= {low:g} (or "nan"/"inf")'
    else:
        expected = f'a number in [{low:g}, {high:g}] (or "nan")'

    def check(value) -> bool:
        if type(value) is float or type(value) is int:  # the usual case, without a call
            if low - SLACK <= value <= high + SLACK:
                return True
        x = as_float(value)
        if x is None:
            return False
        if math.isfinite(x):
            return low - SLACK <= x <= high + SLACK
        return not (x == math.inf and high != math.inf or x == -math.inf and low != -math.inf)

    return check, expected


def _number(low: float = -math.inf, high: float = math.inf):
    check, expected = number_check(low, high)

    def validate(value):
        if not check(value):
            raise must_be(expected)
        return value

    return PlainValidator(validate)


Number = Annotated[Any, _number()]
NonNegative = Annotated[Any, _number(0.0)]


# -- metrics ---------------------------------------------------------------------------------


def _metric_checks():
    checks = {}
    for metric in BY_NAME.values():
        if metric.integer:
            hi = INT64_MAX if math.isinf(metric.high) else metric.high
            checks[metric.name] = (
                lambda v, lo=metric.low, hi=hi: (
                    isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi
                ),
                f"an integer in [{metric.low:g}, {hi}]",
            )
        else:
            checks[metric.name] = number_check(metric.low, metric.high)
    return checks


METRIC_CHECKS = _metric_checks()
ANY_NUMBER = number_check()


def metric_errors(metrics: dict) -> list[InitErrorDetails]:
    """Each metric against its range (the one list, contracts/metrics.py); a metric lpx does
    not know only has to be a number, and groups (by_region, kl_input_drift) are looked
    into where lpx knows their shape."""
    errors = []
    for name, value in metrics.items():
        known = name in METRIC_CHECKS
        if name == "by_region" and isinstance(value, dict):
            for region, values in value.items():
                if not isinstance(values, dict):
                    errors.append(_error(must_be("an object"), (name, region), values))
                    continue
                errors += [{**e, "loc": (name, region, *e["loc"])} for e in metric_errors(values)]
            continue
        if not known and (value is None or isinstance(value, (dict, list))):
            continue  # a group of metrics, or a newer metric this run could not measure
        check, expected = METRIC_CHECKS.get(name, ANY_NUMBER)
        if not check(value):
            errors.append(_error(must_be(expected), (name,), value))
    return errors


def _validate_metrics(value, handler):
    if not isinstance(value, dict):
        raise must_be("an object")
    errors = metric_errors(value)
    if errors:
        raise ValidationError.from_exception_data("metrics", errors)
    return value


def _error(kind, loc, value) -> InitErrorDetails:
    return InitErrorDetails(type=kind, loc=loc, input=value)


Metrics = Annotated[dict[str, Any], WrapValidator(_validate_metrics)]


def _validate_limits(value, handler):
    if not isinstance(value, dict):
        raise must_be("an object")
    check, expected = number_check(0.0)
    errors = [_error(must_be(expected), (k,), v) for k, v in value.items() if not check(v)]
    if errors:
        raise ValidationError.from_exception_data("limits", errors)
    return value


Limits = Annotated[dict[str, Any], WrapValidator(_validate_limits)]


# -- rows --------------------------------------------------------------------------------------


@with_config(OPEN)
class SequenceRow(TypedDict, total=False):
    """One sequence's drift (compare/metrics.py:sequence_metrics); `lpx localize` picks a
    report's worst sequences by max_abs_diff."""

    sequence_id: Required[str]
    tokens: Count | None
    max_abs_diff: NonNegative | None
    mean_abs_diff: NonNegative | None
    over_tau: bool


@with_config(OPEN)
class SequenceTable(TypedDict, total=False):
    """Where the per-sequence rows are (contracts/sequences.py): the file beside report.json
    and how many rows it holds."""

    file: Required[str]
    rows: Required[Count]


@with_config(OPEN)
class WorstToken(TypedDict, total=False):
    sequence_id: str | None
    position: Index | None
    token_id: Index | None
    region: str
    logprob_rollout: Number
    logprob_train: Number
    abs_diff: NonNegative
    context_ids: list[int] | None  # the tokens before it, decoded as context on run pages


@with_config(OPEN)
class DriftRow(TypedDict, total=False):
    cells: list | None


@with_config(OPEN)
class DriftMap(TypedDict, total=False):
    rows: list[DriftRow] | None


# -- metadata ----------------------------------------------------------------------------------


@with_config(OPEN)
class Engine(TypedDict, total=False):
    name: str | None
    versions: dict[str, Version | None] | None


@with_config(OPEN)
class ModelInfo(TypedDict, total=False):
    path: str | None
    architecture: str | None
    weights_fingerprint: str | None
    tokenizer_fingerprint: str | None
    chat_template_fingerprint: str | None


@with_config(OPEN)
class Sampling(TypedDict, total=False):
    seed: Seed | None


@with_config(OPEN)
class Layout(TypedDict, total=False):
    world_size: Index | None
    tensor_parallel_size: Index | None


@with_config(OPEN)
class Side(TypedDict, total=False):
    """One side of a comparison: the fixture's or the replay's metadata and where it was."""

    path: str | None
    channel: str | None
    dtype: str | None
    engine: Engine | None
    model: ModelInfo | None
    prompt_set_fingerprint: str | None
    sampling: Sampling | None
    knobs: dict | None
    layout: Layout | None
    hardware: dict | None


@with_config(OPEN)
class Testbed(TypedDict, total=False):
    name: str | None
    host: str | None
    cpu_model: str | None
    cpu_count: Index | None
    gpu_model: str | None
    gpu_count: Index | None
    driver: str | None


@with_config(OPEN)
class Metadata(TypedDict, total=False):
    fixture: Required[Side]
    replay: Required[Side]
    command_line: str | None
    testbed: Testbed | None


# -- the verdict -------------------------------------------------------------------------------


@with_config(OPEN)
class Violation(TypedDict, total=False):
    metric: Required[str]
    value: Any
    limit: Any
    source: NotRequired[str]  # "precision gate ..." for a failed noise test
    bound: NotRequired[str]  # "lower" where the value fell below its limit (else upper)


@with_config(OPEN)
class Judgement(TypedDict, total=False):
    """The policy's verdict (compare/policy.py:judge): every violated limit and failing
    finding, and what judged it."""

    verdict: Verdict | None
    profile: str | None
    tau: NonNegative | None
    limits: Limits | None
    violations: list[Violation] | None
    not_measured: list[str] | None
    failing_findings: list[str] | None
    source: str | None
    exact: bool | None
    calibrated: bool | None
    gate: dict | None


class Finding(Open):
    """One cause a diagnosis names, with its evidence; verification re-scores it and sets
    its status and residuals."""

    # a cause a newer lpx names is kept as its string
    cause: Annotated[Cause | str, _named(Cause)]
    # in report.json: the first ids (contracts/sequences.py SAMPLE), with the whole list's
    # length and its sequences.parquet column; inline in full in reports before that layout
    sequences: list[str] = []
    sequence_count: Count | None = None
    sequences_column: str | None = None
    first_position: dict = {}
    evidence: str = ""
    severity: Annotated[Severity | str, _named(Severity)] = Severity.FAULT
    details: dict = {}
    confidence: Number = 1.0
    runner_up: dict | None = None  # {"cause", "why_not"}
    status: Annotated[Status | str, _named(Status)] = Status.PLAUSIBLE
    residual_before: Number | None = None  # mean |d| on the finding's tokens
    residual_after: Number | None = None  # mean |d| left once the bug is reproduced
    floor: Number | None = None  # mean |d| precision alone gives those tokens

    @property
    def is_fault(self) -> bool:
        return self.severity == Severity.FAULT

    @property
    def verified(self) -> bool:
        return self.status == Status.VERIFIED

    def but(self, **changes) -> Finding:
        """A copy with ``changes``: verification's outcomes never edit the finding it was
        given (the report keeps what the signatures said until the verdict is rejudged)."""
        return self.model_copy(update=changes)

    def as_dict(self) -> dict:
        """Shallow, as JSON has it (enums are str); a deep dump copies every sequence id
        (80 ms on 30k sequences)."""
        return {**dict(self), **(self.model_extra or {})}


class Report(Open):
    """report.json. ``verification`` is the note `lpx compare` adds when it re-scores
    findings; ``routing`` is a MoE pair's routing agreement (pipeline/routing.py)."""

    verdict: Verdict
    sign_convention: str | None = None
    metrics: Metrics
    # inline in reports before sequences.parquet; ``sequence_table`` names that file now
    sequences: list[SequenceRow] | None = []
    sequence_table: SequenceTable | None = None
    worst: list[WorstToken] | None = []
    drift_map: DriftMap | None = None
    routing: dict | None = None
    diagnosis: list[Finding] | None = []
    policy: Judgement
    precision_gate: dict | None = None
    calibration: dict | None = None
    verification: dict | None = None
    # the prompt set and a digest of the compared tokens (compare/run.py workload_of)
    workload: dict | None = None
    # what an importance-sampling correction would do (compare/correction.py): verl's
    # rollout_corr metrics per view, the configured one among the flat metrics too
    correction: dict | None = None
    # where drift starts at one absolute position in many sequences (compare/onset.py)
    onset: dict | None = None
    metadata: Metadata

    def as_dict(self) -> dict:
        """The report as JSON has it, shallow (the rows are dicts already); unknown fields
        kept where a reader found them."""
        data = {name: getattr(self, name) for name in type(self).model_fields}
        data["diagnosis"] = [f.as_dict() for f in self.diagnosis or []]
        return {**data, **(self.model_extra or {})}


def contradictions(report: Report) -> list[str]:
    """Why a report that says pass cannot be one: a NaN where the verdict needed a number, a
    limited metric over its limit, violations or failing findings listed beside a pass."""
    if report.verdict != "pass":
        return []
    metrics, policy = report.metrics, report.policy
    found = []
    if policy.get("verdict") == "fail":
        found.append("policy.verdict is fail")
    if policy.get("violations"):
        found.append(f"policy.violations lists {len(policy['violations'])}")
    if policy.get("failing_findings"):
        found.append(f"policy.failing_findings lists {len(policy['failing_findings'])}")
    for name in VERDICT_METRICS:
        value = as_float(metrics.get(name))
        if value is None:  # compare measures both on every comparison: a pass stands on them
            found.append(f"metrics.{name} is missing")
        elif not math.isfinite(value):
            found.append(f"metrics.{name} is {metrics[name]}")
    for metric, limit in (policy.get("limits") or {}).items():
        value, bound = as_float(metrics.get(metric)), as_float(limit)
        if metric not in metrics or bound is None or f"metrics.{metric} is" in " ".join(found):
            continue  # not measured (compare lists it as such), or a NaN already named
        if value is None:
            found.append(f"metrics.{metric}, which its policy limits, is not a number")
        elif not value <= bound:  # NaN is over every limit, as compare's judge() has it
            found.append(f"metrics.{metric} = {value:.4g} is over its limit {bound:.4g}")
    return found


def load_report(path: Path) -> Report:
    """A report.json lpx wrote, validated and held as written; OSError or ValueError (a
    ValidationError is one) when it is not readable as one."""
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    Report.model_validate(data)
    return held_as_written(Report, data)
