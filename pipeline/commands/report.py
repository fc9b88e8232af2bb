from __future__ import annotations

import click

from pipeline.commands.options import OUTPUT_DIR, db_option


@click.command(short_help="Render the history as a static HTML site (opens from disk).")
@db_option("report")
@click.option(
    "--out",
    "out_dir",
    required=True,
    type=OUTPUT_DIR,
    help="Directory for the site (index.html, series/, runs/, assets/); replaced whole.",
)
def report(db, out_dir):
    """Render the history as a static HTML site that opens from disk (no server, no network).

    The index has the status banner, open regressions with their last good -> first bad
    builds, pass->fail changes since the previous run, the engine x version matrix and every
    series' trend; each series and run has its own page (trend charts with bands, change
    points and version changes; worst tokens, diagnosis, drift heatmaps, how to reproduce).

    \b
    Example:
      lpx report --out runs/report && xdg-open runs/report/index.html
      lpx report --db postgresql+psycopg://ci@db/lpx --out /srv/www/lpx
    """
    from pipeline.history.database import open_history
    from pipeline.report.site import build_site

    history = open_history(db, create=False)
    try:
        index = build_site(history, out_dir)
    finally:
        history.dispose()
    click.echo(f"report: {index}")
