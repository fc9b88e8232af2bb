"""Localization: where two engines part, per comparison, and each boundary's drift over runs.

`lpx localize` writes localize.json beside a failing pair's report.json; `lpx record` keeps its
verdict and first boundary on the comparison (with the verification and sides as JSON) and one
row per boundary, so a series can say at which run a boundary first went beyond its
precision floor and with which engine builds.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-26
"""

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

Json = sa.JSON()  # plain JSON on both backends, see db/models.py


COLUMNS = ("localize_verdict", "localize_boundary", "localize")


def upgrade() -> None:
    # Plain ALTER TABLE on both backends: SQLite's batch mode would rebuild `comparisons`,
    # and dropping the old table cascades (foreign keys are on) to every metric value.
    op.add_column("comparisons", sa.Column("localize_verdict", sa.String(16)))
    op.add_column("comparisons", sa.Column("localize_boundary", sa.String(128)))
    op.add_column("comparisons", sa.Column("localize", Json))
    op.create_table(
        "localize_boundaries",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column(
            "comparison_id",
            sa.Integer,
            sa.ForeignKey("comparisons.id", ondelete="CASCADE"),
            nullable=False,
        ),
        sa.Column("series_id", sa.Integer, nullable=False),
        sa.Column("started_at", sa.DateTime, nullable=False),
        sa.Column("boundary", sa.String(128), nullable=False),
        sa.Column("layer", sa.Integer),
        sa.Column("kind", sa.String(32), nullable=False),
        sa.Column("drift_max", sa.Float, nullable=False),
        sa.Column("drift_rms", sa.Float, nullable=False),
        sa.Column("floor_max", sa.Float, nullable=False),
        sa.Column("floor_rms", sa.Float, nullable=False),
        sa.Column("ratio", sa.Float, nullable=False),
        sa.Column("beyond", sa.Boolean, nullable=False),
        sa.UniqueConstraint("comparison_id", "boundary"),
    )
    op.create_index(
        "ix_localize_boundaries_series", "localize_boundaries", ["series_id", "boundary"]
    )


def downgrade() -> None:
    op.drop_index("ix_localize_boundaries_series", table_name="localize_boundaries")
    op.drop_table("localize_boundaries")
    for column in reversed(COLUMNS):
        if op.get_bind().dialect.name == "sqlite":  # ALTER TABLE DROP COLUMN: SQLite 3.35+
            op.execute(f"ALTER TABLE comparisons DROP COLUMN {column}")
        else:
            op.drop_column("comparisons", column)
