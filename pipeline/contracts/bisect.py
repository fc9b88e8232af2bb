"""bisect.json: what `lpx bisect` writes after every probe run (pipeline/bisect/run.py), reads
back on ``--resume``, and `lpx record` stores (pipeline/history/bisects.py), one model.
`lpx_bisect` marks a file as lpx's. Strict types; fields lpx does not know are kept (a newer
bisect may write more).

Written with `as_written`: a key the writer leaves out stays out and a null it writes stays
in, so the file reads the same with the model as it did before it."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field

from pipeline.contracts.base import OPEN, Open
from pipeline.contracts.problems import INT32_MAX

FORMAT = 1
SIDES = ("replay", "rollout", "both")  # which stages run on the build
KINDS = ("pip", "image", "git")  # pipeline/bisect/builds.py
OUTCOMES = ("good", "bad", "error")  # one probe run (pipeline/bisect/search.py)
VERDICTS = (*OUTCOMES, "flaky")  # a build, over its runs
JUDGES = ("policy", "series")

Count = Annotated[int, Field(ge=0, le=INT32_MAX)]
# [the last good build's, the first bad build's]; null where that build has none
Change = Annotated[list[str | None], Field(min_length=2, max_length=2)]


class Written(Open):
    # The writer fills a field in as the bisect goes (a run, the result, what changed):
    # checked as it is set, so a writer's bug fails there and not in a later `lpx record`.
    # A NaN in a probe's metrics or environment is written NaN, as json.dumps wrote it.
    model_config = ConfigDict(**OPEN, validate_assignment=True, ser_json_inf_nan="constants")


class PlanOfBisect(Written):
    name: str
    path: str


class SearchOptions(Written):
    runs: Count
    reconfirm: Count
    retries: Count


class BuildOfBisect(Written):
    """A build as pipeline/bisect/builds.py describes it: only its kind's fields."""

    name: str
    kind: Literal[KINDS]
    requirements: list[str] | None = None
    image: str | None = None
    revision: str | None = None
    patch: str | None = None


class ProbeRun(Written):
    """One run of the failing pair on one build."""

    build: str
    index: Count  # the build's place in `builds`
    attempt: Count
    outcome: Literal[OUTCOMES]
    seconds: Annotated[float, Field(ge=0)]
    metrics: dict[str, int | float]  # a few of the pair's report.json metrics
    message: str
    run_dir: str  # relative to the bisect directory
    environment: dict[str, Any]  # the build's environment (pipeline/environments.py)


class ProbedBuild(Written):
    build: str
    verdict: Literal[VERDICTS]
    runs: list[Literal[OUTCOMES]]


class ImageOfBuild(Written):
    ref: str
    digest: str | None


class Changed(Written):
    """What differs from the last good build to the first bad one: the packages whose
    versions differ and the patches (pip), the images (image), or the commits (git)."""

    model_config = ConfigDict(validate_by_name=True)  # `from` is Python's: built as from_

    from_: str = Field(alias="from")
    to: str
    packages: dict[str, Change] | None = None
    patch: Change | None = None
    images: Annotated[list[ImageOfBuild], Field(min_length=2, max_length=2)] | None = None
    commits: list[str] | None = None


class CauseOfBisect(Written):
    """A cause the first bad build's comparison names, verified once at the end."""

    cause: str
    status: str
    sequences: Count
    evidence: str


class BisectResult(Written):
    """The answer: no first bad (and `stopped` saying why) when the ends did not hold."""

    first_bad: str | None
    last_good: str | None
    maybe_first_bad: list[str]  # builds between them that could not be judged
    stopped: str | None
    probes: list[ProbedBuild]
    builds_probed: Count
    runs: Count
    flaky: list[str]
    errors: list[str]
    changed: Changed | None = None  # only with a first bad
    # only with a first bad, under a plan that diagnoses: its comparison's faults, verified
    causes: list[CauseOfBisect] | None = None
    explained: str | None = None  # that comparison's report.json, relative to the bisect
    explained_seconds: Annotated[float, Field(ge=0)] | None = None  # what verifying it took


class BisectState(Written):
    """bisect.json; `result` is null until the search has an answer (a bisect still running
    or stopped), and `finished_at` is written with it."""

    lpx_bisect: Annotated[int, Field(ge=FORMAT, le=FORMAT)]
    bisect_id: str
    plan: PlanOfBisect
    pair: str
    side: Literal[SIDES]
    runner: str
    good: str
    bad: str
    options: SearchOptions
    judged_by: list[Literal[JUDGES]]
    builds: list[BuildOfBisect]
    started_at: str
    runs: list[ProbeRun]
    result: BisectResult | None
    finished_at: str | None = None


def as_written(model: Written) -> dict:
    """The model as bisect.json holds it: the fields that were given, nulls included (a
    result still to come, a first bad not found), and none that were not (a build's other
    kinds' fields, `changed` without an answer, `finished_at` before the end)."""
    return model.model_dump(mode="json", by_alias=True, exclude_unset=True)
