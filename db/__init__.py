"""lpx's run history schema: SQLAlchemy models (models.py) and Alembic migrations (migrations/).

Installed as ``pipeline.db`` (pyproject maps this directory there), so a plain
``pip install .`` in a container ships the migrations with the code that runs them.
"""

from pathlib import Path

MIGRATIONS = Path(__file__).parent / "migrations"
