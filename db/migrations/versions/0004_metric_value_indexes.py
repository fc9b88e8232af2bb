"""Metric values: one narrow series index, and no foreign key of their own to the series.

A year of nightlies is 365,000 metric rows, and PostgreSQL checks every foreign key of every
row as it is inserted. The row's comparison already names its series (and that reference is
checked), so the second check bought nothing; the series index held each metric's name,
which no query filters on (series pages and re-evaluation ask for a whole series).

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-24
"""

from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

# SQLite's foreign keys have no names: batch mode names the reflected ones by this, so the
# one to drop can be named (SQLite rebuilds the table to drop it).
NAMING = {"fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s"}


def upgrade() -> None:
    sqlite = op.get_bind().dialect.name == "sqlite"
    with op.batch_alter_table("metric_values", naming_convention=NAMING) as batch:
        batch.drop_constraint(
            "fk_metric_values_series_id_series" if sqlite else "metric_values_series_id_fkey",
            type_="foreignkey",
        )
        batch.drop_index("ix_metric_values_series_name_time")
        batch.create_index("ix_metric_values_series", ["series_id"])


def downgrade() -> None:
    with op.batch_alter_table("metric_values") as batch:
        batch.drop_index("ix_metric_values_series")
        batch.create_index("ix_metric_values_series_name_time", ["series_id", "name", "started_at"])
        batch.create_foreign_key("metric_values_series_id_fkey", "series", ["series_id"], ["id"])
