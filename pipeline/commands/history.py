from __future__ import annotations

import json

import click

from pipeline.commands.options import db_option

VIEWS = ("runs", "series", "alerts")


@click.command(short_help="The run history in the terminal: runs, series, alerts.")
@click.argument("view", type=click.Choice(VIEWS), default="runs")
@click.argument("ref", required=False)
@click.option(
    "--limit", type=click.IntRange(min=1), default=30, show_default=True, help="Rows shown."
)
@click.option(
    "--all", "all_alerts", is_flag=True, help="alerts: every status, not only active ones."
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@db_option("history")
def history(view, ref, limit, all_alerts, as_json, db):
    """The run history in the terminal: runs, series (or one series' points), alerts.

    A finding is never printed without its status: `diagnosis: temperature (verified),
    stale_weights (plausible), token_shift (ruled out), unexplained`.

    \b
    Example:
      lpx history runs
      lpx history series          # every series with its latest verdict and open alerts
      lpx history series 3        # series 3 point by point: boundaries, findings
      lpx history alerts --all --json
    """
    from pipeline.history import queries
    from pipeline.history.database import open_history
    from pipeline.history.people import resolve_series

    store = open_history(db, create=False)
    try:
        with store.read() as session:
            if view == "series" and ref:
                target = resolve_series(session, ref)
                rows = queries.series_points(session, target.id)[-limit:]
                title = f"series {target.id}: {target.label}"
            elif view == "series":
                rows, title = queries.series(session)[:limit], "series"
            elif view == "alerts":
                statuses = () if all_alerts else ("active",)
                rows, title = queries.alerts(session, statuses)[:limit], "alerts"
            else:
                rows, title = queries.runs(session, limit), "runs"
    finally:
        store.dispose()
    if as_json:
        click.echo(json.dumps(rows, indent=1, default=str))
        return
    from pipeline.text import for_terminal

    # Notes, reasons, labels and stage messages are other people's text: never raw escapes.
    click.echo(for_terminal(f"{title} ({len(rows)})"))
    for row in rows:
        click.echo(for_terminal(_line(view, ref, row)))


def _line(view: str, ref, row: dict) -> str:
    if view == "runs":
        errors = (
            f"  errors: {row['errors'][0]['stage']}: {row['errors'][0]['message']}"
            if row["errors"]
            else ""
        )
        return (
            f"{row['id']:>5}  {row['started_at']}  {row['kind']:<7} {row['status'].upper():<5} "
            f"{row['comparisons']:>3} comparisons  lpx {row['lpx_version']} ({row['lpx_revision']}){errors}"
        )
    if view == "series" and ref:
        key = row["metrics"].get("max_abs_diff") or {}
        return (
            f"run {row['run']:>5}  {row['at']}  {row['verdict'].upper():<4}  "
            f"{row['rollout']['engine']} {row['rollout']['version']} / "
            f"{row['replay']['engine']} {row['replay']['version']}  "
            f"max|d| {_fmt(key.get('value'))} [{_fmt(key.get('lower'))}, {_fmt(key.get('upper'))}] "
            f"{key.get('status', '-')}{_findings(row['findings'])}"
        )
    if view == "series":
        return (
            f"{row['id']:>4}  {row['key']}  {row['latest_verdict'].upper():<4} "
            f"{row['points']:>4} points  {row['open_alerts']} open alerts  {row['label']}"
            f"{_findings(row['latest_findings'])}"
        )
    changes = "; ".join(
        f"{c['side']} {c['field']} {c['before']} -> {c['after']}" for c in row["attribution"][:2]
    )
    return (
        f"{row['id']:>4}  {row['status']:<12} {row['kind']:<16} series {row['series_id']} "
        f"{row['metric']}: {_fmt(row['value_before'])} -> {_fmt(row['value_after'])}  "
        f"first bad run {(row['first_bad'] or {}).get('run')}  {changes or row['rule']}"
        f"{_findings((row['first_bad'] or {}).get('findings') or [])}"
    )


def _findings(claims: list[dict]) -> str:
    """`  diagnosis: stale_weights (plausible), ...`: a cause is never printed without its
    status, so a guess does not read as the established cause."""
    from pipeline.history.claims import summary

    return f"  diagnosis: {summary(claims)}" if claims else ""


def _fmt(value) -> str:
    return "-" if value is None else f"{value:.3g}"
