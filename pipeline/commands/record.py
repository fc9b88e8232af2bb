from __future__ import annotations

from pathlib import Path

import click

from pipeline.commands.options import db_option


@click.command(short_help="Import finished runs into the history.")
@click.argument("run_dirs", nargs=-1, required=True, type=click.Path(path_type=Path))
@db_option("record")
@click.option(
    "--kind",
    type=click.Choice(["nightly", "smoke", "manual"]),
    help="Run kind [default: the run manifest's, else manual].",
)
@click.option("--trigger", help="What started the run (schedule, push, ...) [default: detected].")
@click.option(
    "--error",
    "error_message",
    metavar="MESSAGE",
    help="Record the run as an error run with this message (e.g. a stage crashed).",
)
@click.option(
    "--testbed", help="Testbed name for these runs (e.g. a runner pool) [env LPX_TESTBED]."
)
def record(run_dirs, db, kind, trigger, error_message, testbed):
    """Import finished runs (compare outputs, single pairs and matrices) into the history.

    A RUN_DIR that holds an `lpx bisect`'s bisect.json is stored as that bisect; the series
    page of its pair links to it.

    All RUN_DIRs go in one transaction, oldest first; a run already recorded is skipped, so
    recording twice changes nothing. A run whose stages failed (its lpx-run.json says so, a
    compare never finished, or --error) is recorded as an error run: never a regression,
    never dropped. Each point is judged on the way in (docs/history.md).

    \b
    Example:
      lpx record runs/2026-11-22 --kind nightly --db postgresql+psycopg://ci@db/lpx
      lpx record runs/smoke
    """
    import gc

    from pipeline.history.bisects import is_bisect, read_bisect, record_bisect
    from pipeline.history.collect import collect_run
    from pipeline.history.database import describe, open_history
    from pipeline.history.record import record_runs
    from pipeline.progress import progress_bar

    # Parsed reports are trees without cycles, freed by reference counts: the cyclic
    # collector would only rescan the growing pile of them (2.3 s of a year's import, and
    # 1.0 s more while the migrations of a new database allocate). record_runs freezes them.
    bisects = [(path, read_bisect(path)) for path in run_dirs if is_bisect(path)]
    gc.disable()
    try:
        runs = [
            collect_run(path, kind, trigger, error_message, testbed)
            for path in progress_bar(run_dirs, "reading runs", "run")
            if not is_bisect(path)
        ]
        history = open_history(db)
    finally:
        gc.enable()
    try:
        results = record_runs(history, runs) if runs else []
        stored = []
        if bisects:
            with history.write() as session:
                stored = [(path, record_bisect(session, path, state)) for path, state in bisects]
    finally:
        history.dispose()
    for path, new in stored:
        click.echo(f"{'recorded' if new else 'already recorded'}: bisect <- {path}")
    for result in results:
        state = "recorded" if result.new else "already recorded"
        click.echo(
            f"{state}: run {result.run_id} ({result.status}, {result.comparisons} comparisons) "
            f"<- {result.run_dir}"
        )
    click.echo(f"history: {describe(history.url)}")
