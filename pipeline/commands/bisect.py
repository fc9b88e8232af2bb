from __future__ import annotations

from pathlib import Path

import click

from pipeline.commands.options import OUTPUT_DIR, db_option, runner_option


@click.command("bisect", short_help="Find the first bad engine build between good and bad.")
@click.argument("plan_path", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--pair", required=True, help="The replay of the plan whose comparison failed.")
@click.option(
    "--good", required=True, help="The last build known good, e.g. pip:transformers==5.17.0."
)
@click.option(
    "--bad", required=True, help="The first build known bad, e.g. pip:transformers==5.20.0."
)
@click.option(
    "--builds",
    "builds_file",
    type=click.Path(dir_okay=False, exists=True, path_type=Path),
    help="YAML list of builds, oldest first [default: the package's releases, or git rev-list].",
)
@click.option(
    "--side",
    type=click.Choice(["replay", "rollout", "both"]),
    default="replay",
    show_default=True,
    help="Which stages run on the build; the others run as the plan says, once.",
)
@click.option(
    "--wheelhouse",
    type=click.Path(file_okay=False, path_type=Path),
    help="Install pip builds offline from this folder of wheels (and list releases from it).",
)
@click.option(
    "--source",
    type=click.Path(file_okay=False, exists=True, path_type=Path),
    help="git builds: the engine's source tree (a clone).",
)
@click.option(
    "--build-command",
    help="git builds: how a revision is built into its environment ({pip}, {python}, {source}) "
    "[default: {pip} install --no-deps --no-build-isolation {source}].",
)
@runner_option(
    "local: stages as processes (pip and git builds); docker: in containers (image builds)."
)
@db_option("bisect")
@click.option(
    "--out", type=OUTPUT_DIR, help="Bisect directory [default: runs/bisect-<pair>-<UTC time>]."
)
@click.option(
    "--resume", is_flag=True, help="Finish the bisect in --out, keeping every run it made."
)
@click.option(
    "--runs",
    type=click.IntRange(1),
    default=2,
    show_default=True,
    help="Runs per probe; all must agree.",
)
@click.option(
    "--reconfirm",
    type=click.IntRange(0),
    default=3,
    show_default=True,
    help="More runs of the last good and first bad before they are named.",
)
@click.option(
    "--retries",
    type=click.IntRange(0),
    default=1,
    show_default=True,
    help="Times a run that errs is tried again before the build counts as an error.",
)
def bisect(
    plan_path,
    pair,
    good,
    bad,
    builds_file,
    side,
    wheelhouse,
    source,
    build_command,
    runner,
    db,
    out,
    resume,
    runs,
    reconfirm,
    retries,
):
    """Find the first bad engine build between a good one and a bad one.

    Each probe runs the plan's failing pair (--pair) on one build and judges it like the
    nightly: by the plan's policy, and with a history (--db, LPX_DB) by the band of the
    pair's series at its last good point. Every verdict is re-confirmed: a build whose runs
    disagree is flaky and skipped, one that cannot be built is an error and skipped; neither
    is ever blamed. Writes OUT/bisect.json after every run (--resume finishes a stopped
    bisect); `lpx record OUT` stores it in the history. Exit 0 with an answer, 1 when the
    ends do not hold (the good build fails, or the bad one passes), 2 on bad input.
    Builds and examples: docs/bisect.md.

    \b
    Example:
      lpx bisect plan.yaml --pair hf-fp32 --good transformers==5.17.0 \\
          --bad transformers==5.20.0 --wheelhouse wheels/ --out runs/bisect-1
    """
    import sys
    from datetime import UTC, datetime

    from pipeline.bisect.run import run_bisect, summary

    if out is None:
        if resume:
            from pipeline.errors import BadInput

            raise BadInput("--resume needs --out DIR: the bisect to finish.")
        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
        out = Path("runs") / f"bisect-{pair}-{stamp}"
    state = run_bisect(
        plan_path,
        pair,
        good,
        bad,
        out,
        builds_file,
        side,
        wheelhouse,
        source,
        build_command,
        runner,
        resume,
        runs,
        reconfirm,
        retries,
        db,
    )
    click.echo(summary(state))
    click.echo(f"bisect: {Path(out) / 'bisect.json'}")
    sys.exit(1 if state.result.stopped else 0)
