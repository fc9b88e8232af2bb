"""What `lpx record` accepts: report.json and lpx-run.json checked for types and ranges
(localize.json: the pydantic model of history/localized.py).

Reports are inputs too. A report someone edited, truncated or wrote with another tool must
not reach the history as a pass: a metric written as the string "0.1" would simply go
unjudged, and an id of 2**70 would overflow the database's integers. Each check names the
field by its JSON path. Fields lpx does not know are kept as they are (a newer compare may
write more); only the fields the history reads are held to a type.

A report can also be well-formed and still contradict itself: it says pass while a limited
metric is NaN or over its limit. That is not bad input to refuse (the run happened, and its
directory may be all that is left of it) but a run the history must not count as a pass:
``contradictions`` names them and the run is recorded as an error run.

Pure functions, no I/O: collect.py reads the files and raises.
"""

from __future__ import annotations

import math
from collections.abc import Callable

INT64_MAX = 2**63 - 1
INT32_MAX = 2**31 - 1
NON_FINITE = ("nan", "inf", "-inf")  # how compare writes non-finite numbers (outputs.py)
VERDICTS = ("pass", "fail")
# Rounding may put a fraction a few ulps past its bound; anything further is not rounding.
SLACK = 1e-9

# A check returns what it expected, or None when the value is fine.
Check = Callable[[object], "str | None"]


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def as_float(value) -> float | None:
    """A metric's value as a float ("nan"/"inf" strings included); None for anything else."""
    if _is_number(value):
        return float(value)
    if value in NON_FINITE:
        return float(value)
    return None


def number(lo: float = -math.inf, hi: float = math.inf) -> Check:
    """A number within [lo, hi]; non-finite values are allowed (written "nan"/"inf") and are
    judged by the policy, not refused here."""
    if math.isinf(lo) and math.isinf(hi):
        expected = 'a number (or "nan"/"inf")'
    elif math.isinf(hi):
        expected = f'a number >= {lo:g} (or "nan"/"inf")'
    else:
        expected = f'a number in [{lo:g}, {hi:g}] (or "nan")'

    def check(value):
        x = as_float(value)
        if x is None:
            return expected
        if math.isfinite(x) and not (lo - SLACK <= x <= hi + SLACK):
            return expected
        if x == math.inf and hi != math.inf or x == -math.inf and lo != -math.inf:
            return expected
        return None

    return check


def integer(lo: int = 0, hi: int = INT64_MAX) -> Check:
    def check(value):
        ok = isinstance(value, int) and not isinstance(value, bool) and lo <= value <= hi
        return None if ok else f"an integer in [{lo}, {hi}]"

    return check


def text(value) -> str | None:
    return None if isinstance(value, str) else "a string"


def scalar(value) -> str | None:
    ok = isinstance(value, (str, int, float)) and not isinstance(value, bool)
    return None if ok else "a version string"


def boolean(value) -> str | None:
    return None if isinstance(value, bool) else "true or false"


def obj(value) -> str | None:
    return None if isinstance(value, dict) else "an object"


def array(value) -> str | None:
    return None if isinstance(value, list) else "a list"


def one_of(*choices) -> Check:
    def check(value):
        return None if value in choices else "one of " + "|".join(map(str, choices))

    return check


def optional(inner: Check) -> Check:
    """Absent or null is fine; otherwise ``inner``."""

    def check(value):
        return None if value is None else inner(value)

    return check


# The metrics compare writes, with the range each can take. A metric not listed here (a
# newer lpx's) only has to be a number.
FRACTION = number(0.0, 1.0)
NONNEGATIVE = number(0.0)
METRICS: dict[str, Check] = {
    "tokens": integer(),
    "bitwise_mismatches": integer(),
    "tau": number(0.0),
    **dict.fromkeys(
        (
            "max_abs_diff",
            "mean_abs_diff",
            "rms_diff",
            "p50_abs_diff",
            "p99_abs_diff",
            "p999_abs_diff",
            "max_rel_diff",
            "mean_rel_diff",
            "k2",
            "k3",
            "max_seq_mean_abs_diff",
        ),
        NONNEGATIVE,
    ),
    **dict.fromkeys(
        (
            "max_prob_diff",
            "mean_prob_diff",
            "frac_over_tau",
            "clip_frac",
            "ess",
            "top1_flip_rate",
            "routing_flip_rate",
            "bitwise_equal_fraction",
            "token_mult_prob_error_frac_above_1_1",
        ),
        FRACTION,
    ),
    # exp(|d|) >= 1 for every token, so its mean, median and trimmed mean are too.
    **dict.fromkeys(
        (
            "token_mult_prob_error",
            "token_mult_prob_error_median",
            "token_mult_prob_error_trimmed_mean",
        ),
        number(1.0),
    ),
    "is_ratio_mean": number(0.0),
}
ANY_NUMBER = number()

# Fields the history reads, by path; "[]" is each element of a list.
REPORT_FIELDS: dict[str, Check] = {
    "verdict": one_of(*VERDICTS),
    "metrics": obj,
    "metrics.by_region": optional(obj),
    "policy": obj,
    "policy.verdict": optional(one_of(*VERDICTS)),
    "policy.profile": optional(text),
    "policy.tau": optional(number(0.0)),
    "policy.limits": optional(obj),
    "policy.violations": optional(array),
    "policy.violations[]": obj,
    "policy.violations[].metric": text,
    "policy.failing_findings": optional(array),
    "metadata": obj,
    "metadata.command_line": optional(text),
    "metadata.testbed": optional(obj),
    "diagnosis": optional(array),
    "diagnosis[]": obj,
    "diagnosis[].cause": text,
    "worst": optional(array),
    "worst[]": obj,
    "worst[].sequence_id": optional(text),
    "worst[].position": optional(integer(0, INT32_MAX)),
    "worst[].token_id": optional(integer(0, INT32_MAX)),
    "worst[].context_ids": optional(array),
    "sequences": optional(array),
    "sequences[]": obj,
    "sequences[].sequence_id": text,
    "sequences[].tokens": optional(integer()),
    # lpx localize picks a report's worst sequences by it
    "sequences[].max_abs_diff": optional(NONNEGATIVE),
    "drift_map": optional(obj),
    "drift_map.rows": optional(array),
    "drift_map.rows[]": obj,
    "drift_map.rows[].cells": optional(array),
    "calibration": optional(obj),
}
SIDE_FIELDS: dict[str, Check] = {
    "": obj,
    "path": optional(text),
    "channel": optional(text),
    "dtype": optional(text),
    "engine": optional(obj),
    "engine.name": optional(text),
    "engine.versions": optional(obj),
    "model": optional(obj),
    "model.path": optional(text),
    "model.architecture": optional(text),
    "model.weights_fingerprint": optional(text),
    "model.tokenizer_fingerprint": optional(text),
    "prompt_set_fingerprint": optional(text),
    "sampling": optional(obj),
    "sampling.seed": optional(integer(-INT64_MAX, INT64_MAX)),
    "knobs": optional(obj),
    "layout": optional(obj),
    "layout.world_size": optional(integer(0, INT32_MAX)),
    "layout.tensor_parallel_size": optional(integer(0, INT32_MAX)),
    "hardware": optional(obj),
}
TESTBED_FIELDS: dict[str, Check] = {
    "name": optional(text),
    "host": optional(text),
    "cpu_model": optional(text),
    "cpu_count": optional(integer(0, INT32_MAX)),
    "gpu_model": optional(text),
    "gpu_count": optional(integer(0, INT32_MAX)),
    "driver": optional(text),
}
MANIFEST_FIELDS: dict[str, Check] = {
    "run_id": text,
    "kind": optional(text),
    "trigger": optional(text),
    "started_at": optional(text),
    "ended_at": optional(text),
    "command_line": optional(text),
    "lpx_version": optional(text),
    "lpx_revision": optional(text),
    "status": optional(one_of("running", "pass", "fail", "error")),
    "testbed": optional(obj),
    "stages": optional(array),
    "stages[]": obj,
    "stages[].name": text,
    "stages[].message": optional(text),
    "stages[].outputs": optional(array),
    "stages[].image": optional(obj),
    "stages[].image.ref": optional(text),
    "stages[].image.digest": optional(text),
    # a stage whose failure leaves the run's verdict standing (localize), and its pair
    "stages[].optional": optional(boolean),
    "stages[].skipped": optional(boolean),
    "stages[].pair": optional(text),
}


REPORT_FIELDS.update(
    {
        f"metadata.{side}.{key}" if key else f"metadata.{side}": check
        for side in ("fixture", "replay")
        for key, check in SIDE_FIELDS.items()
    }
)


def report_problems(report: dict) -> list[str]:
    """What is wrong with a single-pair report's types and ranges, each as
    "`path` must be EXPECTED, not VALUE"; empty when it can be recorded."""
    problems = check_fields(report, _REPORT_TREE)
    meta = report.get("metadata")
    if isinstance(meta, dict):
        for side in ("fixture", "replay"):
            for name, version in _engine_versions(meta.get(side)).items():
                if (expected := optional(scalar)(version)) is not None:
                    where = f"metadata.{side}.engine.versions.{name}"
                    problems.append(_problem(where, expected, version))
        problems += _check_testbed(meta.get("testbed"), "metadata.testbed")
    metrics = report.get("metrics")
    if isinstance(metrics, dict):
        problems += _check_metrics(metrics, "metrics")
        regions = metrics.get("by_region")
        if isinstance(regions, dict):
            for region, values in regions.items():
                where = f"metrics.by_region.{region}"
                if not isinstance(values, dict):
                    problems.append(_problem(where, "an object", values))
                else:
                    problems += _check_metrics(values, where)
    policy = report.get("policy")
    if isinstance(policy, dict) and isinstance(policy.get("limits"), dict):
        for metric, limit in policy["limits"].items():
            if (expected := NONNEGATIVE(limit)) is not None:
                problems.append(_problem(f"policy.limits.{metric}", expected, limit))
    return problems


def manifest_problems(manifest: dict) -> list[str]:
    """lpx-run.json's types (the version, kind and stage statuses are checked by
    run_manifest.read_manifest)."""
    return check_fields(manifest, _MANIFEST_TREE) + _check_testbed(
        manifest.get("testbed"), "testbed"
    )


def contradictions(report: dict) -> list[str]:
    """Why a report that says pass cannot be one: a NaN where the verdict needed a number, a
    limited metric over its limit, violations or failing findings listed beside a pass."""
    if report.get("verdict") != "pass":
        return []
    metrics = report.get("metrics") or {}
    policy = report.get("policy") or {}
    found = []
    if policy.get("verdict") == "fail":
        found.append("policy.verdict is fail")
    if policy.get("violations"):
        found.append(f"policy.violations lists {len(policy['violations'])}")
    if policy.get("failing_findings"):
        found.append(f"policy.failing_findings lists {len(policy['failing_findings'])}")
    for name in ("max_abs_diff", "mean_abs_diff"):
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


def describe_problems(problems: list[str], shown: int = 3) -> str:
    more = len(problems) - shown
    return "; ".join(problems[:shown]) + (f" (and {more} more)" if more > 0 else "")


# -- walking -------------------------------------------------------------------------------


class _Field:
    """One node of the field tree: its own check, its keys, and what each list item holds.
    The paths are compiled once, so a report is walked in one pass (a year of nightlies
    is 18,000 reports)."""

    __slots__ = ("check", "keys", "each")

    def __init__(self):
        self.check: Check | None = None
        self.keys: dict[str, _Field] = {}
        self.each: _Field | None = None


def compile_fields(fields: dict[str, Check]) -> _Field:
    root = _Field()
    for path, check in fields.items():
        node = root
        for part in path.split("."):
            each = part.endswith("[]")
            node = node.keys.setdefault(part[:-2] if each else part, _Field())
            if each:
                node.each = node.each or _Field()
                node = node.each
        node.check = check
    return root


def check_fields(document: dict, tree: _Field) -> list[str]:
    problems: list[str] = []
    _walk(tree, document, "", problems)
    return problems


def _walk(node: _Field, value, where: str, problems: list[str]) -> None:
    """Check ``value`` against ``node``; a value that fails its own check is not looked
    into. A missing key is checked as None (fine when optional); a missing container's
    fields are not checked (its own check says it is missing)."""
    if isinstance(value, dict):
        for key, child in node.keys.items():
            here = f"{where}.{key}" if where else key
            if key in value:
                item = value[key]
                if child.check is not None and (expected := child.check(item)) is not None:
                    problems.append(_problem(here, expected, item))
                elif child.keys or child.each:
                    _walk(child, item, here, problems)
            elif child.check is not None and (expected := child.check(None)) is not None:
                problems.append(_problem(here, expected, None, present=False))
    if node.each is not None and isinstance(value, list):
        each = node.each
        for index, item in enumerate(value):
            here = f"{where}[{index}]"
            if each.check is not None and (expected := each.check(item)) is not None:
                problems.append(_problem(here, expected, item))
            elif each.keys or each.each:
                _walk(each, item, here, problems)


def _engine_versions(side) -> dict:
    engine = side.get("engine") if isinstance(side, dict) else None
    versions = engine.get("versions") if isinstance(engine, dict) else None
    return versions if isinstance(versions, dict) else {}


def _check_metrics(metrics: dict, where: str) -> list[str]:
    problems = []
    for name, value in metrics.items():
        if isinstance(value, (dict, list)) and name not in METRICS:
            continue  # a group of metrics (by_region, kl_input_drift): not a point value
        check = METRICS.get(name, ANY_NUMBER)
        if value is None and name not in METRICS:
            continue  # a newer metric this run could not measure
        if (expected := check(value)) is not None:
            problems.append(_problem(f"{where}.{name}", expected, value))
    return problems


def _check_testbed(testbed, where: str) -> list[str]:
    if not isinstance(testbed, dict):
        return []
    return [
        _problem(f"{where}.{key}", expected, testbed[key])
        for key, check in TESTBED_FIELDS.items()
        if key in testbed and (expected := check(testbed[key])) is not None
    ]


_REPORT_TREE = compile_fields(REPORT_FIELDS)
_MANIFEST_TREE = compile_fields(MANIFEST_FIELDS)


def _problem(where: str, expected: str, value, present: bool = True) -> str:
    shown = repr(value) if present else "missing"
    if len(shown) > 40:
        shown = shown[:37] + "..."
    return f"`{where}` must be {expected}, not {shown}"
