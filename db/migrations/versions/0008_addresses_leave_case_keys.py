"""A case key leaves out where the engine was reached: re-key, merge, judge again (issue 43).

0007 left out what differs from run to run of one case (seeds, ids, outputs, timestamps).
Where the engine was reached differs too: a server's URL, host and port, a process id, a path
in a temporary directory (pipeline/history/keys.py ``run_specific``), and which GPU of a node
it ran on (a knob's "cuda:3" keys as "cuda"). A nightly that reaches its server on whichever
runner is free split its series each night. This re-keys the cases
and merges the series that now share a key, then judges every series again: an alert's
attribution no longer lists the knobs that change every night (seeds, ids, outputs,
addresses), which hid the knob that did change. Idempotent (pipeline/history/rekey.py);
nothing to undo on a downgrade (the keys stay as re-keyed).

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-28
"""

from alembic import op
from sqlalchemy.orm import Session

revision = "0008"
down_revision = "0007"
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
