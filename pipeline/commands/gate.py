from __future__ import annotations

import click

from pipeline.commands.options import db_option


@click.command(short_help="Exit 1 when the latest run has what --fail-on names.")
@db_option("gate")
@click.option(
    "--fail-on",
    multiple=True,
    type=click.Choice(["regression", "suspicious", "policy", "never"]),
    default=("regression", "policy"),
    show_default=True,
    help="What fails the gate (repeatable): regression; suspicious (and regression); policy "
    "(a policy violation); never.",
)
@click.option(
    "--kind",
    type=click.Choice(["nightly", "smoke", "manual"]),
    help="Gate the latest run of this kind.",
)
@click.option("--run", "run_ref", help="Gate this run (id or key prefix) instead of the latest.")
def gate(db, fail_on, kind, run_ref):
    """Exit 1 when the latest run has what --fail-on names, 2 when it is an error run, else 0.

    Reads only the history (run `lpx record` first). Acknowledged and silenced alerts never
    fail the gate. Each alert that fails it is printed with the rule that fired and its
    point's findings, each with its status (verified, plausible, unexplained, ruled out).

    \b
    Example:
      lpx gate --fail-on regression --fail-on policy --kind nightly
    """
    from pipeline.errors import EXIT_BAD_INPUT, BadInput
    from pipeline.history.database import describe, open_history
    from pipeline.history.gate import decide, latest_run, open_alerts_of_run
    from pipeline.history.people import resolve_run

    history = open_history(db, create=False)
    try:
        with history.read() as session:
            run = resolve_run(session, run_ref) if run_ref else latest_run(session, kind)
            if run is None:
                raise BadInput(
                    f"the history at {describe(history.url)} has no {kind + ' ' if kind else ''}"
                    "runs; record one with `lpx record RUN_DIR` first (or check --db)."
                )
            decision = decide(run.status, run.errors, open_alerts_of_run(session, run.id), fail_on)
            header = f"run {run.id} ({run.kind}, {run.started_at:%Y-%m-%d %H:%M}, {run.status})"
    finally:
        history.dispose()
    from pipeline.text import for_terminal

    word = {0: "PASS", 1: "FAIL", 2: "ERROR"}[decision.exit_code]
    verdict = f"gate: {word} {header} --fail-on {','.join(fail_on)}"
    if decision.exit_code == EXIT_BAD_INPUT:
        # An error run judged nothing: its stage errors are the one Error line, on stderr.
        click.echo(verdict)
        raise BadInput(
            for_terminal(
                f"{header} is an error run ({'; '.join(decision.reasons)}). Nothing was "
                "judged; fix the failing stage and rerun the night (lpx run --resume), or gate "
                "an earlier run with --run ID."
            )
        )
    for reason in decision.reasons:
        click.echo(for_terminal(reason))
    click.echo(for_terminal(verdict))
    click.get_current_context().exit(decision.exit_code)
