"""A case records the reduced-precision numerics each side declares (issue 52).

An FP8 rollout and a bf16 rollout of one model are different cases: each side's numerics
(FP8/MXFP8/INT8 linear layers, an FP8 KV cache; pipeline/contracts/numerics.py) join its
dtype in the case and its key. A case without numerics keeps the key it had, so nothing is
re-keyed. Idempotent.

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
    # idempotent, as 0007 and 0008 are: a history stamped older than it holds runs in (a
    # re-run of the re-keys) may have the columns already
    present = {c["name"] for c in sa.inspect(op.get_bind()).get_columns("cases")}
    for name in ("rollout_numerics", "replay_numerics"):
        if name not in present:
            op.add_column("cases", sa.Column(name, sa.String(256), nullable=True))


def downgrade() -> None:
    # plain ALTER TABLE ... DROP COLUMN (SQLite 3.35+): a batch copy of the table would drop
    # it under the series' foreign keys
    op.drop_column("cases", "replay_numerics")
    op.drop_column("cases", "rollout_numerics")
