"""A case records the reduced-precision numerics each side declares (issue 52).

An FP8 rollout and a bf16 rollout of one model are different cases: each side's numerics
(FP8/MXFP8/INT8 linear layers, an FP8 KV cache; pipeline/contracts/numerics.py) join its
dtype in the case and its key. A case without numerics keeps the key it had, so nothing is
re-keyed.

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-28
"""

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("cases") as batch:
        batch.add_column(sa.Column("rollout_numerics", sa.String(256), nullable=True))
        batch.add_column(sa.Column("replay_numerics", sa.String(256), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("cases") as batch:
        batch.drop_column("replay_numerics")
        batch.drop_column("rollout_numerics")
