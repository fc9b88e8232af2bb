"""Metric values: one narrow series index, and no foreign key of their own to the series;
comparison seeds 64-bit.

A year of nightlies is 365,000 metric rows, and PostgreSQL checks every foreign key of every
row as it is inserted. The row's comparison already names its series (and that reference is
checked), so the second check bought nothing; the series index held each metric's name,
which no query filters on (series pages and re-evaluation ask for a whole series).
Sampling seeds are 64-bit integers, which PostgreSQL's INTEGER cannot hold (SQLite stores
any integer in up to 8 bytes whatever the declared type, so its table is left as it is).

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-24
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

# SQLite's foreign keys made by 0001 have no names: batch mode names the reflected ones by
# this, so the one to drop can be named (SQLite rebuilds the table to drop it).
NAMING = {"fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s"}


def upgrade() -> None:
    sqlite = op.get_bind().dialect.name == "sqlite"
    with op.batch_alter_table("metric_values", naming_convention=NAMING) as batch:
        batch.drop_constraint(_series_foreign_key(), type_="foreignkey")
        batch.drop_index("ix_metric_values_series_name_time")
        batch.create_index("ix_metric_values_series", ["series_id"])
    if not sqlite:
        op.alter_column("comparisons", "seed", type_=sa.BigInteger)


def _series_foreign_key() -> str:
    """The metric values' foreign key to the series, by the name it has or NAMING gives it."""
    for key in sa.inspect(op.get_bind()).get_foreign_keys("metric_values"):
        if key["referred_table"] == "series":
            return key["name"] or "fk_metric_values_series_id_series"
    raise LookupError("metric_values has no foreign key to series")


def downgrade() -> None:
    if op.get_bind().dialect.name != "sqlite":
        op.alter_column("comparisons", "seed", type_=sa.Integer)
    with op.batch_alter_table("metric_values") as batch:
        batch.drop_index("ix_metric_values_series")
        batch.create_index("ix_metric_values_series_name_time", ["series_id", "name", "started_at"])
        batch.create_foreign_key("metric_values_series_id_fkey", "series", ["series_id"], ["id"])
