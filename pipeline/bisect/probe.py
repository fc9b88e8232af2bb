"""One probe run: the plan's failing pair, with the stages under bisect on one build.

The stages that do not change between builds (the model, and for a replay-side bisect the
rollout and the calibration) run once, in ``base/``, and every probe run links to them; the
stages on the build run fresh each time, then the plan's own compare stage judges the pair
by the plan's policy. Stages run through the orchestrator's runners, so a probe in a
container is the nightly's stage in that container. Nothing here imports an engine.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from pipeline import environments
from pipeline.bisect.builds import Build
from pipeline.bisect.search import BAD, ERROR, GOOD
from pipeline.contracts.files import MANIFEST, REPORT
from pipeline.contracts.report import Report, load_report
from pipeline.errors import BadInput
from pipeline.orchestrator.plan import Plan
from pipeline.orchestrator.run import RunStopped, execute_stage, run_stages
from pipeline.orchestrator.runners import LocalRunner, StageFailed, make_runner
from pipeline.orchestrator.stages import COMPARE, LOGS, PROMPTS, compare_stage, expand
from pipeline.run_manifest import new_manifest, write_manifest


@dataclass
class Prepared:
    """A build made ready to run on: an interpreter (pip, git) or an image."""

    build: Build
    python: Path | None = None
    image: str | None = None
    description: dict = field(default_factory=dict)
    error: str | None = None  # it could not be built: every probe run of it is an error


def pair_plan(plan: Plan, pair: str) -> Plan:
    """The plan cut to the one pair the nightly failed: its rollout and that replay."""
    names = [r.name for r in plan.replays]
    if pair not in names:
        raise BadInput(
            f"--pair {pair!r} is not a replay of plan {plan.name}; its replays: {', '.join(names)}."
        )
    chosen = [r for r in plan.replays if r.name == pair]
    return plan.model_copy(update={"replays": chosen, "localize": None})


def verdict_only(plan: Plan) -> Plan:
    """The plan a probe runs: its compare judges the pair and stops there. A bisect needs
    each build's verdict, not its cause, and verifying a failing pair by re-scoring costs
    several forwards (a bad probe cost 4.5x a good one); the first bad build's comparison
    is verified once, at the end (`explain`)."""
    return plan.model_copy(update={"diagnose": False})


def explain(plan: Plan, run_dir: Path, runner_name: str) -> Report | None:
    """The first bad build's comparison as the plan's own compare stage makes it, verified
    by re-scoring where the plan diagnoses: run in that build's last bad probe run, into
    its own folder (the probe's report stays as judged). None where the plan does not
    diagnose or the stage could not run: the bisect's answer stands without it."""
    if not plan.diagnose:
        return None
    compare = compare_stage(plan, [r.name for r in plan.replays])
    argv = list(compare.argv)
    argv[argv.index("--out") + 1] = EXPLAINED
    stage = replace(compare, name="explain", argv=argv, outputs=[f"{EXPLAINED}/{REPORT}"])
    manifest = new_manifest("manual", f"lpx bisect: the first bad build's causes ({run_dir})")
    runner = make_runner(runner_name, gpus=plan.gpus)
    try:
        execute_stage(stage, run_dir, plan.stage_timeout_s, manifest, runner)
        return load_report(run_dir / EXPLAINED / REPORT)
    except (RunStopped, OSError, ValueError):
        return None


EXPLAINED = "explained"  # the first bad probe's comparison, verified


def stages_on_build(plan: Plan, side: str) -> set[str]:
    names = set()
    if side in ("rollout", "both"):
        names |= {"rollout", "calibrate"}
    if side in ("replay", "both"):
        names |= {f"replay-{r.name}" for r in plan.replays}
    return names


def base_stages(plan: Plan, side: str) -> list[str]:
    """The stages run once for the whole bisect: those before the first stage on the build."""
    on_build = stages_on_build(plan, side)
    kept = []
    for stage in expand(plan):
        if stage.name in on_build or stage.name.startswith("replay-"):
            break
        kept.append(stage.name)
    return kept


def prepare(
    build: Build, wheelhouse: Path | None, source: Path | None, command: str, log: Path
) -> Prepared:
    """Make the build's environment (cached); an environment that will not build is an
    error of that build, never a verdict."""
    if build.kind == "image":
        return Prepared(build, image=build.image, description={"image": build.image})
    try:
        if build.kind == "pip":
            environment = (
                environments.for_requirement(build.requirements[0], build.patch, wheelhouse)
                if len(build.requirements) == 1
                else environments.Environment(build.requirements, build.patch, wheelhouse)
            )
        else:
            tree = _checkout(source, build.revision)
            environment = environments.Environment(
                (), source=tree, command=command, source_id=build.revision
            )
        directory = environments.ensure(environment, log)
    except environments.EnvironmentFailed as error:
        return Prepared(build, error=str(error))
    return Prepared(
        build,
        python=environments.python_of(directory),
        description=environments.description(directory),
    )


def make_base(plan: Plan, side: str, base: Path, runner) -> None:
    """Run the stages no build changes, once (kept on --resume)."""
    (base / LOGS).mkdir(parents=True, exist_ok=True)
    if plan.prompts == "bundled" and not (base / PROMPTS).is_file():
        from pipeline.prompts import smoke_prompt_texts

        (base / PROMPTS).write_text("\n".join(smoke_prompt_texts()) + "\n", encoding="utf-8")
    manifest = new_manifest("manual", f"lpx bisect: stages every build shares ({base})")
    wanted = base_stages(plan, side)
    for stage in expand(plan):
        if stage.name not in wanted or all((base / o).exists() for o in stage.outputs):
            continue
        status = execute_stage(stage, base, plan.stage_timeout_s, manifest, runner)
        if status != "ok":
            raise BadInput(
                f"the shared stage {stage.name} failed before any build was probed "
                f"({manifest['stages'][-1]['message']}); log: {base / LOGS / (stage.name + '.log')}."
            )
    write_manifest(base, manifest)


@dataclass
class RunResult:
    outcome: str  # good | bad | error
    seconds: float
    metrics: dict
    message: str = ""
    report: Report | None = None  # the pair's report.json (not kept in bisect.json)


def run_once(
    plan: Plan, side: str, prepared: Prepared, base: Path, run_dir: Path, runner_name: str
) -> RunResult:
    """The pair once on the build: link the shared outputs, run the rest, read the verdict."""
    started = time.monotonic()
    if prepared.error:
        return RunResult(ERROR, 0.0, {}, f"cannot be built: {prepared.error}")
    if run_dir.exists():  # a run cut short before its result was written: start it again
        shutil.rmtree(run_dir)
    (run_dir / LOGS).mkdir(parents=True)
    shared = base_stages(plan, side)
    for item in base.iterdir():
        if item.name not in (LOGS, MANIFEST):
            _link(item, run_dir / item.name)
    manifest = new_manifest("manual", f"lpx bisect probe of {prepared.build.name} ({run_dir})")
    runner = OnBuild(
        make_runner(runner_name, gpus=plan.gpus), prepared, stages_on_build(plan, side)
    )
    try:
        run_stages(verdict_only(plan), run_dir, manifest, set(shared), runner)
    except (StageFailed, BadInput) as error:
        return RunResult(ERROR, time.monotonic() - started, {}, str(error))
    finally:
        write_manifest(run_dir, manifest)
    seconds = time.monotonic() - started
    compare = next((s for s in manifest["stages"] if s["name"] == "compare"), None)
    if compare is None:
        failed = [s for s in manifest["stages"] if s["status"] == "error"]
        why = failed[0]["message"] if failed else "the compare stage did not run"
        return RunResult(ERROR, seconds, {}, why)
    if compare["status"] == "error":
        return RunResult(ERROR, seconds, {}, compare["message"])
    try:
        report = load_report(run_dir / COMPARE / REPORT)
    except (OSError, ValueError) as error:
        why = " ".join(str(error).split())[:200]
        return RunResult(ERROR, seconds, {}, f"its report.json cannot be read: {why}")
    outcome = GOOD if compare["status"] == "ok" else BAD
    return RunResult(outcome, seconds, _metrics(report.metrics), report=report)


class OnBuild:
    """The probe's runner: the stages under bisect run on the build (its interpreter or its
    image, and a rollout's server with them), the others as the plan says."""

    def __init__(self, plain, prepared: Prepared, on_build: set[str]):
        self.plain, self.prepared, self.on_build = plain, prepared, on_build
        self.name = plain.name
        self.built = LocalRunner(prepared.python) if prepared.python else plain

    def _pick(self, stage):
        if stage.name not in self.on_build:
            return self.plain, stage
        if self.prepared.image:
            if stage.server is not None:
                stage = replace(stage, server=stage.server.model_copy(update={"image": None}))
            return self.plain, replace(stage, image=self.prepared.image)
        return self.built, stage

    def image(self, stage):
        runner, stage = self._pick(stage)
        return runner.image(stage)

    def run(self, stage, run_dir, log, timeout_s):
        runner, stage = self._pick(stage)
        return runner.run(stage, run_dir, log, timeout_s)

    def start_server(self, stage, run_dir, model, log):
        runner, stage = self._pick(stage)
        return runner.start_server(stage, run_dir, model, log)

    def stop_server(self, handle) -> None:
        self.plain.stop_server(handle)


def _metrics(metrics: dict) -> dict:
    keep = ("mean_abs_diff", "max_abs_diff", "p99_abs_diff", "k3", "is_ratio_mean", "ess")
    chosen = {k: metrics[k] for k in keep if isinstance(metrics.get(k), int | float)}
    return chosen or {k: v for k, v in list(metrics.items())[:6] if isinstance(v, int | float)}


def _link(source: Path, target: Path) -> None:
    """The shared outputs as hard links: real files inside the run directory (a container
    sees only the run directory it mounts, so a symlink out of it would dangle there), at no
    cost in space; a copy where the two lie on different filesystems."""

    def link(src, dst):
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)

    if source.is_dir():
        shutil.copytree(source, target, copy_function=link)
    else:
        link(source, target)


def _checkout(source: Path | None, revision: str) -> Path:
    """The revision's tree, exported once into the cache (git archive: the user's clone and
    its worktrees are left as they are)."""
    import subprocess

    tree = environments.cache_root().parent / "sources" / revision
    if (tree / ".lpx-exported").is_file():
        return tree
    shutil.rmtree(tree, ignore_errors=True)
    tree.mkdir(parents=True)
    archive = subprocess.run(
        ["git", "-C", str(source), "archive", "--format=tar", revision],
        capture_output=True,
    )
    if archive.returncode != 0:
        raise environments.EnvironmentFailed(
            f"git archive {revision} failed: {archive.stderr.decode(errors='replace')[:300]}"
        )
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True)
    (tree / ".lpx-exported").write_text(revision + "\n")
    return tree
