"""Bisects: `lpx bisect`'s answer (first bad and last good build, probes) per failing pair.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-26
"""

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "bisects",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("bisect_id", sa.String(64), nullable=False, unique=True),
        sa.Column("case_key", sa.String(64), index=True),
        sa.Column("rollout_engine", sa.String(64)),
        sa.Column("replay_engine", sa.String(64)),
        sa.Column("plan", sa.String(256), nullable=False),
        sa.Column("pair", sa.String(256), nullable=False),
        sa.Column("side", sa.String(16), nullable=False),
        sa.Column("good", sa.Text, nullable=False),
        sa.Column("bad", sa.Text, nullable=False),
        sa.Column("first_bad", sa.Text),
        sa.Column("last_good", sa.Text),
        sa.Column("stopped", sa.Text),
        sa.Column("runs", sa.Integer, nullable=False),
        sa.Column("path", sa.Text, nullable=False),
        sa.Column("result", sa.JSON()),
        sa.Column("finished_at", sa.DateTime),
    )


def downgrade() -> None:
    op.drop_table("bisects")
