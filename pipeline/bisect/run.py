"""`lpx bisect`: the builds in order, the search over them, and bisect.json.

bisect.json is written after every probe run, so a bisect that is stopped keeps every run
that finished and ``--resume`` takes them back: the search is deterministic given the
verdicts, so it walks the same path and runs only what is missing. `lpx record` stores the
file in the history, where the series page links the regression to it.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path

import click
from pydantic import ValidationError

from pipeline.bisect import probe as probes
from pipeline.bisect.builds import Build, between
from pipeline.bisect.search import BAD, GOOD, RECONFIRM, RETRIES, RUNS, Answer, bisect
from pipeline.contracts.bisect import (
    FORMAT,
    BisectResult,
    BisectState,
    BuildOfBisect,
    CauseOfBisect,
    Changed,
    ImageOfBuild,
    PlanOfBisect,
    ProbedBuild,
    ProbeRun,
    SearchOptions,
    as_written,
)
from pipeline.contracts.files import BISECT as FILE
from pipeline.contracts.files import REPORT
from pipeline.contracts.problems import describe
from pipeline.contracts.report import Finding, Report
from pipeline.contracts.sequences import finding_count
from pipeline.environments import DEFAULT_BUILD
from pipeline.errors import BadInput
from pipeline.orchestrator.outside import check_outside_paths
from pipeline.orchestrator.plan import load_plan
from pipeline.orchestrator.runners import make_runner
from pipeline.paths import output_lock, write_text_atomic


def run_bisect(
    plan_path: Path,
    pair: str,
    good: str,
    bad: str,
    out: Path,
    builds_file: Path | None = None,
    side: str = "replay",
    wheelhouse: Path | None = None,
    source: Path | None = None,
    build_command: str | None = None,
    runner_name: str = "local",
    resume: bool = False,
    runs: int = RUNS,
    reconfirm: int = RECONFIRM,
    retries: int = RETRIES,
    db: str | None = None,
) -> BisectState:
    plan = probes.pair_plan(load_plan(plan_path), pair)
    check_outside_paths(plan, plan_path)  # a missing checkpoint: exit 2 before any build
    by_series = SeriesJudge(db) if db else None
    builds = between(good, bad, builds_file, wheelhouse, source)
    out = Path(out).resolve()
    previous = _previous(out, resume)
    state = BisectState(
        lpx_bisect=FORMAT,
        bisect_id=previous.bisect_id if previous else uuid.uuid4().hex,
        plan=PlanOfBisect(name=plan.name, path=str(Path(plan_path).resolve())),
        pair=pair,
        side=side,
        runner=runner_name,
        good=good,
        bad=bad,
        options=SearchOptions(runs=runs, reconfirm=reconfirm, retries=retries),
        judged_by=["policy", "series"] if db else ["policy"],
        builds=[BuildOfBisect(**b.describe()) for b in builds],
        started_at=previous.started_at if previous else _now(),
        runs=previous.runs if previous else [],
        result=None,
    )
    if previous and previous.builds != state.builds:
        raise BadInput(
            f"--resume {out}: its bisect.json lists other builds than this command; resume "
            "with the same --good, --bad and --builds, or start in a new --out."
        )
    out.mkdir(parents=True, exist_ok=True)
    (out / "logs").mkdir(exist_ok=True)
    command = build_command or DEFAULT_BUILD
    with output_lock(out):
        click.echo(
            f"bisect: {len(builds)} builds from {builds[0].name} to {builds[-1].name}", err=True
        )
        probes.make_base(plan, side, out / "base", make_runner(runner_name, gpus=plan.gpus))
        prepared: dict[int, probes.Prepared] = {}

        def run(index: int, attempt: int) -> str:
            build = builds[index]
            done = _stored(state.runs, build.name, attempt)
            if done is not None:
                return done.outcome
            if index not in prepared:
                log = out / "logs" / f"build-{_slug(build.name)}.log"
                prepared[index] = probes.prepare(build, wheelhouse, source, command, log)
            run_dir = out / "probes" / _slug(build.name) / str(attempt)
            result = probes.run_once(
                plan, side, prepared[index], out / "base", run_dir, runner_name
            )
            if by_series and result.outcome == GOOD and result.report:
                outside = by_series.outside(result.report)
                if outside:
                    result.outcome = BAD
                    result.message = "inside the policy, outside the series' band: " + "; ".join(
                        outside
                    )
            state.runs.append(
                ProbeRun(
                    build=build.name,
                    index=index,
                    attempt=attempt,
                    outcome=result.outcome,
                    seconds=round(result.seconds, 2),
                    metrics=result.metrics,
                    message=result.message,
                    run_dir=str(run_dir.relative_to(out)),
                    environment=prepared[index].description,
                )
            )
            _write(out, state)
            said = f": {result.message}" if result.message else ""
            click.echo(
                f"[{len(state.runs)}] {build.name} run {attempt + 1}: {result.outcome} "
                f"in {result.seconds:.1f} s{said}",
                err=True,
            )
            return result.outcome

        answer = bisect(len(builds), run, runs, reconfirm, retries)
        # a build prepared in an earlier process (resumed) is described by its stored runs
        described = {r.build: r.environment for r in state.runs if r.environment}
        described |= {builds[i].name: p.description for i, p in prepared.items()}
        state.result = _result(answer, builds, described, source)
        _write(out, state)
        if answer.first_bad is not None:
            _explain(state, plan, out, runner_name)
        state.finished_at = _now()
        _write(out, state)
    return state


class SeriesJudge:
    """The nightly's second rule: a probe whose metrics leave the band of the pair's series
    at its last good point is bad, like the night that raised the alert."""

    def __init__(self, db: str):
        from pipeline.history.database import open_history

        self.history = open_history(db, create=False)
        self.bands: dict[tuple, dict] = {}

    def outside(self, report: Report) -> list[str]:
        from pipeline.history.bisects import outside_bands, series_bands, series_of_report
        from pipeline.history.values import tracked_values

        series = series_of_report(report)
        if series not in self.bands:
            with self.history.read() as session:
                self.bands[series] = series_bands(session, *series)
        return outside_bands(tracked_values(report.metrics), self.bands[series])


def _result(
    answer: Answer, builds: list[Build], described: dict, source: Path | None
) -> BisectResult:
    def name(index: int | None) -> str | None:
        return None if index is None else builds[index].name

    probed = [
        ProbedBuild(
            build=builds[i].name,
            verdict=answer.judged[i].verdict,
            runs=answer.judged[i].runs,
        )
        for i in answer.order
    ]
    result = BisectResult(
        first_bad=name(answer.first_bad),
        last_good=name(answer.last_good),
        maybe_first_bad=[name(i) for i in answer.skipped],
        stopped=answer.stopped,
        probes=probed,
        builds_probed=len(answer.order),
        runs=sum(len(j.runs) for j in answer.judged.values()),
        flaky=[builds[i].name for i, j in answer.judged.items() if j.verdict == "flaky"],
        errors=[builds[i].name for i, j in answer.judged.items() if j.verdict == "error"],
    )
    if answer.first_bad is not None:
        result.changed = _changed(
            builds[answer.last_good], builds[answer.first_bad], described, source
        )
    return result


def _explain(state: BisectState, plan, out: Path, runner_name: str) -> None:
    """The first bad build's causes: its last bad probe's comparison, verified once."""
    first_bad = state.result.first_bad
    bad = [r for r in state.runs if r.build == first_bad and r.outcome == BAD]
    if not bad:
        return
    run_dir = out / bad[-1].run_dir
    click.echo(f"bisect: verifying the causes of {first_bad}'s comparison", err=True)
    started = time.monotonic()
    report = probes.explain(plan, run_dir, runner_name)
    if report is None:
        return
    state.result.explained_seconds = round(time.monotonic() - started, 2)
    state.result.causes = [
        CauseOfBisect(
            cause=str(f.cause),
            status=str(f.status),
            sequences=finding_count(f),
            evidence=f.evidence,
        )
        for f in (Finding.model_validate(found) for found in report.diagnosis or [])
        if f.is_fault
    ]
    state.result.explained = str((run_dir / probes.EXPLAINED / REPORT).relative_to(out))


def _changed(good: Build, bad: Build, described: dict, source: Path | None) -> Changed:
    """What differs between the last good build and the first bad one: package versions and
    patches, image digests, or the commits between two revisions."""
    said = Changed(from_=good.name, to=bad.name)
    if good.kind == "pip":
        old = _versions(described.get(good.name, {}))
        new = _versions(described.get(bad.name, {}))
        said.packages = {
            name: [old.get(name), new.get(name)]
            for name in sorted(set(old) | set(new))
            if old.get(name) != new.get(name)
        }
        if good.patch != bad.patch:
            said.patch = [
                str(good.patch) if good.patch else None,
                str(bad.patch) if bad.patch else None,
            ]
    elif good.kind == "image":
        said.images = [_image_of(good.image), _image_of(bad.image)]
    elif source is not None:
        log = subprocess.run(
            [
                "git",
                "-C",
                str(source),
                "log",
                "--oneline",
                "--first-parent",
                f"{good.revision}..{bad.revision}",
            ],
            capture_output=True,
            text=True,
        )
        said.commits = log.stdout.splitlines()
    return said


def _versions(description: dict) -> dict:
    """Each package's version as the build's interpreter sees it: its own or lpx's."""
    return {**description.get("installed", {}), **description.get("versions", {})}


def _image_of(reference: str) -> ImageOfBuild:
    try:
        from pipeline.orchestrator.stages import Stage

        found = make_runner("docker").image(Stage("bisect", [], [], image=reference))
        return ImageOfBuild(ref=reference, digest=found["digest"])
    except BadInput:
        return ImageOfBuild(ref=reference, digest=None)


def summary(state: BisectState) -> str:
    """What the bisect found, for the terminal."""
    result = state.result
    lines = [f"bisect {state.bisect_id[:12]}: {state.pair} of plan {state.plan.name}"]
    for row in result.probes:
        lines.append(f"  {row.verdict:>6}  {row.build}  ({', '.join(row.runs)})")
    if result.stopped:
        lines.append(f"no answer: {result.stopped}")
        return "\n".join(lines)
    lines.append(f"last good: {result.last_good}")
    lines.append(f"first bad: {result.first_bad}")
    if result.maybe_first_bad:
        lines.append(
            "  (builds between them could not be judged: the first bad is one of "
            f"{', '.join(result.maybe_first_bad + [result.first_bad])})"
        )
    if result.changed is not None:
        for package, (old, new) in (result.changed.packages or {}).items():
            lines.append(f"  changed: {package} {old} -> {new}")
        for commit in (result.changed.commits or [])[:20]:
            lines.append(f"  commit: {commit}")
    for cause in result.causes or []:
        lines.append(
            f"  cause: {cause.cause} ({cause.status}, {cause.sequences} sequences): {cause.evidence}"
        )
    if result.explained:
        lines.append(f"  its comparison, verified: {result.explained}")
    lines.append(f"{result.runs} runs over {result.builds_probed} builds")
    return "\n".join(lines)


def _previous(out: Path, resume: bool) -> BisectState | None:
    path = out / FILE
    if resume:
        if not path.is_file():
            raise BadInput(f"--resume {out}: no {FILE} there; resume a bisect lpx started.")
        try:
            state = json.loads(path.read_text(encoding="utf-8"))
        except ValueError as error:
            raise BadInput(
                f"{path}: not valid JSON ({error}); start a new bisect in a new --out."
            ) from None
        try:
            return BisectState.model_validate(state)
        except ValidationError as error:
            raise BadInput(
                f"{path}: not a bisect.json as lpx writes it: {describe(error, count=3)}; "
                "start a new bisect in a new --out."
            ) from None
    if out.exists() and any(out.iterdir()):
        raise BadInput(
            f"--out {out}: exists and is not empty; choose a new directory, or pass --resume "
            "to finish the bisect in it."
        )
    return None


def _stored(runs: list[ProbeRun], build: str, attempt: int) -> ProbeRun | None:
    return next((r for r in runs if r.build == build and r.attempt == attempt), None)


def _write(out: Path, state: BisectState) -> None:
    write_text_atomic(out / FILE, json.dumps(as_written(state), indent=1) + "\n")


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._=-]+", "_", name)[:80]


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")
