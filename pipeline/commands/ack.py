from __future__ import annotations

import click

from pipeline.commands.options import db_option


@click.command(short_help="Acknowledge an alert with a note; a new baseline starts.")
@click.argument("alert_id", type=int)
@click.option("--note", required=True, help="Why: shown beside the alert in the report.")
@click.option(
    "--silence", is_flag=True, help="Silence instead: keep the baseline, never alert on it again."
)
@db_option("ack")
def ack(alert_id, note, silence, db):
    """Acknowledge an alert with a note: it stops failing the gate and the series starts a new
    baseline at its first bad point (the new level is accepted). The other open alerts of the
    same event (same series, same first bad run) are acknowledged with it. --silence mutes
    them instead and keeps the baseline.

    \b
    Example:
      lpx ack 12 --note "vLLM 0.32 changed the bf16 GEMM path; accepted, tracked in #431"
    """
    from pipeline.history.database import open_history
    from pipeline.history.people import acknowledge
    from pipeline.text import for_terminal

    history = open_history(db, create=False)
    try:
        with history.write() as session:
            for alert in acknowledge(session, alert_id, note, silence):
                line = f"alert {alert.id} {alert.status}: {alert.kind} {alert.metric}: {alert.note}"
                click.echo(for_terminal(line))
    finally:
        history.dispose()
