from __future__ import annotations

import click

from pipeline.commands.options import db_option


@click.command(short_help="Mark a series point: a distribution change, or an outlier.")
@click.argument("series_ref", metavar="SERIES")
@click.option("--change", "change_run", metavar="RUN", help="A distribution change begins at RUN.")
@click.option("--exclude", "exclude_run", metavar="RUN", help="Leave RUN's point out of detection.")
@click.option("--reason", required=True, help="Why: shown on the series page.")
@db_option("annotate")
def annotate(series_ref, change_run, exclude_run, reason, db):
    """Annotate a series point: a distribution change starts there (the baseline resets), or
    exclude it (an outlier, a broken runner). The series is re-judged at once.

    SERIES and RUN are ids or key prefixes from `lpx history series` / `lpx history runs`.

    \b
    Example:
      lpx annotate 3 --change 41 --reason "moved to FlashAttention-3; new bf16 floor"
      lpx annotate 3 --exclude 40 --reason "runner had a bad GPU"
    """
    from pipeline.errors import BadInput
    from pipeline.history.database import open_history
    from pipeline.history.evaluate import CHANGE, EXCLUDE
    from pipeline.history.people import annotate as add_annotation
    from pipeline.text import for_terminal

    if bool(change_run) == bool(exclude_run):
        raise BadInput("give exactly one of --change RUN or --exclude RUN.")
    kind, run_ref = (CHANGE, change_run) if change_run else (EXCLUDE, exclude_run)
    history = open_history(db, create=False)
    try:
        with history.write() as session:
            note = add_annotation(session, series_ref, run_ref, kind, reason)
            line = f"annotated series {note.series_id} at run {note.run_id}: {kind}: {note.reason}"
            click.echo(for_terminal(line))
    finally:
        history.dispose()
