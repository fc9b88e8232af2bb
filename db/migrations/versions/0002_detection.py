"""Detection: per-point boundaries and status, series detection state, alerts, annotations.

Points recorded before this revision get status `unevaluated`; lpx re-evaluates every
series right after upgrading past it (pipeline/history/database.py), so no point is lost
and every point ends up with the boundaries it would have had.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-22
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

Json = sa.JSON()  # plain JSON on both backends, see db/models.py


def upgrade() -> None:
    with op.batch_alter_table("series") as batch:
        batch.add_column(sa.Column("detection_state", Json, nullable=False, server_default="{}"))
        batch.add_column(sa.Column("last_started_at", sa.DateTime))
    with op.batch_alter_table("metric_values") as batch:
        for name in ("baseline", "band", "lower", "upper"):
            batch.add_column(sa.Column(name, sa.Float))
        batch.add_column(
            sa.Column("baseline_points", sa.Integer, nullable=False, server_default="0")
        )
        batch.add_column(
            sa.Column("status", sa.String(24), nullable=False, server_default="unevaluated")
        )
    op.create_table(
        "alerts",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("series_id", sa.Integer, sa.ForeignKey("series.id"), nullable=False),
        sa.Column("metric", sa.String(128), nullable=False),
        sa.Column("kind", sa.String(24), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column(
            "first_bad_id",
            sa.Integer,
            sa.ForeignKey("comparisons.id", ondelete="CASCADE"),
            nullable=False,
        ),
        sa.Column("last_good_id", sa.Integer, sa.ForeignKey("comparisons.id", ondelete="SET NULL")),
        sa.Column(
            "latest_id",
            sa.Integer,
            sa.ForeignKey("comparisons.id", ondelete="CASCADE"),
            nullable=False,
        ),
        sa.Column("value_before", sa.Float),
        sa.Column("value_after", sa.Float),
        sa.Column("rule", sa.Text, nullable=False),
        sa.Column("attribution", Json, nullable=False),
        sa.Column("note", sa.Text),
        sa.Column("created_at", sa.DateTime, nullable=False),
        sa.Column("updated_at", sa.DateTime, nullable=False),
    )
    op.create_index("ix_alerts_series_status", "alerts", ["series_id", "status"])
    op.create_table(
        "annotations",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("series_id", sa.Integer, sa.ForeignKey("series.id"), nullable=False, index=True),
        sa.Column(
            "run_id", sa.Integer, sa.ForeignKey("runs.id", ondelete="CASCADE"), nullable=False
        ),
        sa.Column("kind", sa.String(24), nullable=False),
        sa.Column("reason", sa.Text, nullable=False),
        sa.Column("created_at", sa.DateTime, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("annotations")
    op.drop_index("ix_alerts_series_status", "alerts")
    op.drop_table("alerts")
    with op.batch_alter_table("metric_values") as batch:
        for name in ("baseline", "band", "lower", "upper", "baseline_points", "status"):
            batch.drop_column(name)
    with op.batch_alter_table("series") as batch:
        batch.drop_column("detection_state")
        batch.drop_column("last_started_at")
