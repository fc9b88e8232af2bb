"""Series keys that hold, engine builds named with their stacks, the workload (issue 43).

comparisons.workload (JSON, NULL where a report has no token digest): the prompt set, the
digest of the compared tokens and the agreement with the series' previous night. Then:
- a case key leaves out what differs from run to run of one case (seeds in any knob, run
  and request ids, output paths, timestamps), so the series a varying seed split are merged;
- an engine build's version names its stack (FSDP: torch and transformers; vLLM: its
  release and torch; pipeline/history/keys.py ENGINE_STACKS), so builds re-key;
- detection now keeps a baseline segment per engine build, so every series is judged again
  from its first point.
Idempotent (pipeline/history/rekey.py); downgrading drops the column and leaves the keys
as re-keyed.

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-28
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.orm import Session

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("comparisons", sa.Column("workload", sa.JSON()))
    from pipeline.history.evaluate import reevaluate_all
    from pipeline.history.rekey import rekey

    with Session(bind=op.get_bind()) as session:
        rekey(session)
        reevaluate_all(session)
        session.flush()


def downgrade() -> None:
    # Not a batch (SQLite's copy-and-rename would cascade-delete every metric value; its
    # own DROP COLUMN, 3.35+, does not)
    op.execute("ALTER TABLE comparisons DROP COLUMN workload")
