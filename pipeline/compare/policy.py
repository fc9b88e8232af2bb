"""Threshold policies: which limits a comparison must meet, and the verdict."""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import yaml

from pipeline.errors import BadInput

PRECISION_ORDER = ("float32", "float16", "bfloat16")  # most to least precise
VERDICT_PASS, VERDICT_FAIL = "pass", "fail"


@dataclass
class Policy:
    source: str
    profiles: dict[str, dict]
    fail_on_findings: list[str] = field(default_factory=list)

    def profile(self, name: str) -> dict:
        if name not in self.profiles:
            raise BadInput(
                f"{self.source}: no profile {name!r}; it has {', '.join(self.profiles)}."
            )
        return self.profiles[name]


def load_policy(path: Path | None = None) -> Policy:
    """Read a policy YAML (the bundled default when ``path`` is None) and check its shape."""
    if path is None:
        source = "default policy"
        text = resources.files("pipeline.compare").joinpath("policies/default.yaml").read_text()
    else:
        source = str(path)
        try:
            text = Path(path).read_text()
        except OSError as error:
            raise BadInput(f"{path}: cannot read the policy file ({error.strerror}).") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise BadInput(
            f"{source}{where}: not valid YAML ({getattr(error, 'problem', error)})."
        ) from None
    if not isinstance(data, dict) or data.get("version") != 1:
        raise BadInput(f"{source}: expected a mapping with `version: 1` (see docs/policy.md).")
    profiles = data.get("profiles")
    if not isinstance(profiles, dict) or not profiles:
        raise BadInput(f"{source}: `profiles` must map profile names to {{tau, limits}}.")
    for name, profile in profiles.items():
        if not isinstance(profile, dict) or not isinstance(profile.get("tau"), (int, float)):
            raise BadInput(f"{source}: profile {name!r} needs a numeric `tau`.")
        limits = profile.get("limits", {})
        if not isinstance(limits, dict) or not all(
            isinstance(v, (int, float)) for v in limits.values()
        ):
            raise BadInput(f"{source}: profile {name!r} `limits` must map metric names to numbers.")
    return Policy(source, profiles, list(data.get("fail_on_findings") or []))


def profile_for(dtypes: list[str]) -> str:
    """The least precise of the sides' dtypes: a comparison is as strict as its weakest side."""
    known = [d for d in dtypes if d in PRECISION_ORDER]
    return max(known, key=PRECISION_ORDER.index) if known else "float32"


def judge(policy: Policy, profile_name: str, metrics: dict, findings: list[dict]) -> dict:
    """Verdict plus every violated limit and failing finding."""
    profile = policy.profile(profile_name)
    violations = []
    for metric, limit in profile.get("limits", {}).items():
        if metric not in metrics:
            raise BadInput(
                f"{policy.source}: profile {profile_name!r} limits unknown metric {metric!r}."
            )
        if not metrics[metric] <= limit:  # NaN fails too
            violations.append({"metric": metric, "value": metrics[metric], "limit": limit})
    failing = [
        f["cause"]
        for f in findings
        if f["cause"] in policy.fail_on_findings and f.get("severity") == "fault"
    ]
    verdict = VERDICT_FAIL if violations or failing else VERDICT_PASS
    return {
        "verdict": verdict,
        "profile": profile_name,
        "tau": profile["tau"],
        "limits": profile.get("limits", {}),
        "violations": violations,
        "failing_findings": sorted(set(failing)),
        "source": policy.source,
    }
