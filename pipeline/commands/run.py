from __future__ import annotations

import sys
from pathlib import Path

import click

from pipeline.commands.options import OUTPUT_DIR, db_option, runner_option


@click.command("run", short_help="Run a plan: rollout, replays, compare, record, report.")
@click.argument("plan_path", type=click.Path(dir_okay=False, path_type=Path))
@click.option(
    "--out",
    "run_dir",
    type=OUTPUT_DIR,
    help="Run directory [default: runs/<plan name>-<UTC time>]; with --resume, the run to finish.",
)
@click.option("--resume", is_flag=True, help="Finish the run in --out: rerun only what is missing.")
@runner_option("local: each stage as a process here; docker: each stage in its image's container.")
@db_option("run")
@click.option(
    "--report-out",
    type=OUTPUT_DIR,
    help="Render the report here [default: the plan's history.report].",
)
def run(
    plan_path: Path,
    run_dir: Path | None,
    resume: bool,
    runner: str,
    db: str | None,
    report_out: Path | None,
) -> None:
    """Run a plan: model, rollout, replays, compare, then record and report.

    Each stage is one `lpx` command in its own process, logged to RUN/logs/STAGE.log and
    noted in RUN/lpx-run.json as it ends. A stage that fails or times out keeps what
    finished; the run is recorded as an error run and ends with one Error: line naming the
    stage, its log and the --resume that finishes it (exit 2). Plan format and what each
    fault does: docs/orchestrator.md.

    \b
    Example:
      lpx run examples/smoke.yaml --out runs/nightly-1
      lpx run examples/smoke.yaml --out runs/nightly-1 --resume
    """
    from datetime import UTC, datetime

    from pipeline.errors import BadInput
    from pipeline.orchestrator.plan import load_plan
    from pipeline.orchestrator.run import run_plan

    plan = load_plan(plan_path)
    if db:  # --db / LPX_RUN_DB / LPX_DB: where the team's history lives, over the plan's
        plan.history.db = db
    if report_out:
        plan.history.report = str(report_out)
    if run_dir is None:
        if resume:
            raise BadInput("--resume needs --out RUN_DIR: the run to finish.")
        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
        run_dir = Path("runs") / f"{plan.name}-{stamp}"
    sys.exit(run_plan(plan, plan_path, run_dir, resume=resume, runner_name=runner))
