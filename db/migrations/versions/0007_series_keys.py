"""Series keys that hold, and engine builds named with their stacks (issue 43).

A data migration, no schema change:
- a case key leaves out what differs from run to run of one case (seeds in any knob, run
  and request ids, output paths, timestamps), so the series a varying seed split are merged;
- an engine build's version names its stack (FSDP: torch and transformers; vLLM: its
  release and torch; pipeline/history/keys.py ENGINE_STACKS), so builds re-key;
- detection now keeps a baseline segment per engine build, so every series is judged again
  from its first point.
Idempotent (pipeline/history/rekey.py); downgrading leaves the data as re-keyed.

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-28
"""

from alembic import op
from sqlalchemy.orm import Session

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    from pipeline.history.evaluate import reevaluate_all
    from pipeline.history.rekey import rekey

    with Session(bind=op.get_bind()) as session:
        rekey(session)
        reevaluate_all(session)
        session.flush()


def downgrade() -> None:
    pass
