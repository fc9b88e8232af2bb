"""Calibrations: each model's measured noise floor, reused by later nights.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-24
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

Json = sa.JSON()  # plain JSON on both backends, see db/models.py


def upgrade() -> None:
    op.create_table(
        "calibrations",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("key", sa.String(64), nullable=False, index=True),
        sa.Column("model_fingerprint", sa.Text),
        sa.Column("engine", sa.String(64), nullable=False),
        sa.Column("hardware", sa.Text),
        sa.Column("precisions", Json, nullable=False),
        sa.Column("created_at", sa.DateTime, nullable=False),
        sa.Column("run_id", sa.Integer, sa.ForeignKey("runs.id", ondelete="SET NULL")),
        sa.Column("payload", Json, nullable=False),
        sa.UniqueConstraint("key", "created_at", name="uq_calibration_made"),
    )


def downgrade() -> None:
    op.drop_table("calibrations")
