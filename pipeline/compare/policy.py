"""Threshold policies: which limits a comparison must meet, and the verdict."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from pipeline.compare.correction import CorrectionSettings, health_violations
from pipeline.compare.precision_gate import failed_tests
from pipeline.contracts.causes import KNOWN_CAUSES, Severity
from pipeline.contracts.metrics import LIMITED_METRICS
from pipeline.contracts.report import Finding, Judgement
from pipeline.errors import BadInput
from pipeline.yaml_text import parse_yaml

PRECISION_ORDER = ("float32", "float16", "bfloat16")  # most to least precise
VERDICT_PASS, VERDICT_FAIL = "pass", "fail"


@dataclass
class Policy:
    source: str
    profiles: dict[str, dict]
    fail_on_findings: list[str] = field(default_factory=list)
    # the importance-sampling correction the report shows (compare/correction.py), and the
    # bounds its metrics must stay in: the bundled policy holds verl's health check; a
    # policy without a correction section gates none (its limits are the whole gate)
    correction: CorrectionSettings = field(default_factory=CorrectionSettings)
    correction_checks: dict = field(default_factory=dict)

    def profile(self, name: str) -> dict:
        if name not in self.profiles:
            raise BadInput(
                f"{self.source}: no profile {name!r}; it has {', '.join(self.profiles)}."
            )
        return self.profiles[name]


def load_policy(path: Path | None = None) -> Policy:
    """Read a policy YAML (the bundled default when ``path`` is None), validated strictly:
    unknown keys, metric names and causes, and thresholds that are not finite numbers >= 0
    (tau > 0) are refused with the key path, so a typo can never quietly pass drift."""
    if path is None:
        source = "default policy"
        text = resources.files("pipeline.compare").joinpath("policies/default.yaml").read_text()
    else:
        source = str(path)
        try:
            text = Path(path).read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise BadInput(f"{path}: not UTF-8 text; save the policy as UTF-8 YAML.") from None
        except OSError as error:
            raise BadInput(f"{path}: cannot read the policy file ({error.strerror}).") from None
    data = parse_yaml(text, source)
    try:
        parsed = PolicyFile.model_validate(data)
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "the file"
        raise BadInput(f"{source}: {where}: {_reason(first)} (see docs/policy.md).") from None
    profiles = {
        name: {"tau": profile.tau, "limits": dict(profile.limits)}
        for name, profile in parsed.profiles.items()
    }
    policy = Policy(source, profiles, list(parsed.fail_on_findings))
    if parsed.correction is not None:
        given = parsed.correction
        try:
            policy.correction = CorrectionSettings(
                given.rollout_is, str(given.rollout_is_threshold), given.rollout_rs,
                str(given.rollout_rs_threshold),
            )  # fmt: skip
        except ValueError as error:
            raise BadInput(f"{source}: correction: {error} (see docs/policy.md).") from None
        if given.checks is not None:
            policy.correction_checks = {
                name: tuple(bounds) for name, bounds in given.checks.items()
            }
    return policy


def _reason(error: dict) -> str:
    if error["type"] == "extra_forbidden":
        return "unknown key"
    if error["type"] == "literal_error":
        return f"{error['input']!r} is not one of {error['ctx']['expected']}"
    return error["msg"]


def _plain_number(value):
    if isinstance(value, bool):
        raise ValueError("a number, not true/false")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"a finite number, not {value}")
    return value


def _whole_number(value):
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"the integer 1, not {value!r}")
    return value


Threshold = Annotated[float, BeforeValidator(_plain_number), Field(ge=0, allow_inf_nan=False)]
Tau = Annotated[float, BeforeValidator(_plain_number), Field(gt=0, allow_inf_nan=False)]
LimitedMetric = Literal[LIMITED_METRICS]
CauseName = Literal[tuple(cause.value for cause in KNOWN_CAUSES)]


class ProfileSchema(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tau: Tau
    limits: dict[LimitedMetric, Threshold] = {}


Bound = Annotated[float, BeforeValidator(_plain_number), Field(allow_inf_nan=False)] | None


class CorrectionSchema(BaseModel):
    """The correction view (compare/correction.py) in verl's config words, and the bounds
    [low, high] (null: none) on its `rollout_corr/*` and `training/*` metrics."""

    model_config = ConfigDict(extra="forbid")
    rollout_is: Literal["token", "sequence"] = "token"
    rollout_is_threshold: float | str = 2.0
    rollout_rs: str = ""
    rollout_rs_threshold: float | str = ""
    checks: dict[str, tuple[Bound, Bound]] | None = None


class PolicyFile(BaseModel):
    model_config = ConfigDict(extra="forbid")
    version: Annotated[Literal[1], BeforeValidator(_whole_number)]
    profiles: dict[str, ProfileSchema] = Field(min_length=1)
    fail_on_findings: list[CauseName] = []
    correction: CorrectionSchema | None = None


def profile_for(dtypes: list[str]) -> str:
    """The least precise of the sides' dtypes: a comparison is as strict as its weakest side."""
    known = [d for d in dtypes if d in PRECISION_ORDER]
    return max(known, key=PRECISION_ORDER.index) if known else "float32"


def judge(
    policy: Policy,
    profile_name: str,
    metrics: dict,
    findings: list[Finding],
    limits: dict | None = None,
    exact: bool = False,
    gate: dict | None = None,
) -> Judgement:
    """Verdict plus every violated limit and failing finding. ``limits`` replaces the
    profile's (a calibrated comparison's, `calibrated.effective_limits`); ``gate`` is a
    calibrated comparison's precision gate (`precision_gate.precision_gate`), whose failed tests
    are violations too.

    A limited metric these inputs cannot give (top1_flip_rate without top-k alternatives on
    both sides) is listed as not measured, in the report and the summary, and judges nothing:
    one policy serves every pair, and the names in the policy were validated when it loaded.
    ``exact`` (lpx compare --exact, for batch-invariant stacks) also fails on any token whose
    logprobs are not bitwise equal; the profile's limits still apply."""
    profile = policy.profile(profile_name)
    limits = profile.get("limits", {}) if limits is None else limits
    violations, not_measured = [], []
    for metric, limit in limits.items():
        if metric not in metrics:
            not_measured.append(metric)
            continue
        if not metrics[metric] <= limit:  # NaN fails too
            violations.append({"metric": metric, "value": metrics[metric], "limit": limit})
    violations += failed_tests(gate)
    violations += health_violations(metrics, policy.correction_checks)
    if exact and metrics["bitwise_mismatches"] != 0:
        violations.append(
            {"metric": "bitwise_mismatches", "value": metrics["bitwise_mismatches"], "limit": 0}
        )
    failing = [
        str(f.cause)
        for f in findings
        if f.cause in policy.fail_on_findings and f.severity == Severity.FAULT
    ]
    verdict = VERDICT_FAIL if violations or failing else VERDICT_PASS
    return Judgement(
        verdict=verdict,
        profile=profile_name,
        tau=profile["tau"],
        limits=limits,
        violations=violations,
        not_measured=not_measured,
        failing_findings=sorted(set(failing)),
        source=policy.source,
        exact=exact,
        gate=None if gate is None else {"passed": gate["passed"], "alpha": gate["alpha"]},
    )
