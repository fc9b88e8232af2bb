"""A case records a multi-turn agent loop's turns and mode (issue 60).

A fixture of agent trajectories (`lpx rollout --agent-turns`, or an agent loop's dump) is
another workload than one completion per prompt, and 4 token-in-token-out turns another than
8 re-rendered ones: the loop joins the case and its key. A case without one keeps the key it
had, so nothing is re-keyed. Idempotent.

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-29
"""

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    present = {c["name"] for c in sa.inspect(op.get_bind()).get_columns("cases")}
    if "agent_loop" not in present:
        op.add_column("cases", sa.Column("agent_loop", sa.String(256), nullable=True))


def downgrade() -> None:
    op.drop_column("cases", "agent_loop")
