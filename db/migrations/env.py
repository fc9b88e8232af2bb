"""Alembic environment: lpx hands in an open connection (pipeline/history/database.py)."""

from alembic import context
from pipeline.db.models import Base

connection = context.config.attributes["connection"]
context.configure(
    connection=connection,
    target_metadata=Base.metadata,
    # SQLite cannot ALTER most things in place: later migrations use batch mode there.
    render_as_batch=connection.dialect.name == "sqlite",
)
with context.begin_transaction():
    context.run_migrations()
