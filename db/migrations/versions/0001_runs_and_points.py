"""Runs, engine builds, testbeds, cases, series, comparisons and their metric values.

Revision ID: 0001
Revises:
Create Date: 2026-11-22
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

Json = sa.JSON()  # plain JSON on both backends, see db/models.py


def upgrade() -> None:
    op.create_table(
        "testbeds",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("key", sa.String(64), nullable=False, unique=True),
        sa.Column("name", sa.String(256), nullable=False),
        sa.Column("host", sa.String(256)),
        sa.Column("cpu_model", sa.String(256)),
        sa.Column("cpu_count", sa.Integer),
        sa.Column("gpu_model", sa.String(256)),
        sa.Column("gpu_count", sa.Integer, nullable=False),
    )
    op.create_table(
        "engine_builds",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("key", sa.String(64), nullable=False, unique=True),
        sa.Column("engine", sa.String(64), nullable=False),
        sa.Column("version", sa.String(128), nullable=False),
        sa.Column("image_ref", sa.Text),
        sa.Column("image_digest", sa.String(128)),
        sa.Column("torch", sa.String(64)),
        sa.Column("cuda", sa.String(64)),
        sa.Column("driver", sa.String(64)),
        sa.Column("versions", Json, nullable=False),
    )
    op.create_table(
        "cases",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("key", sa.String(64), nullable=False, unique=True),
        sa.Column("label", sa.String(256), nullable=False),
        sa.Column("model", sa.Text, nullable=False),
        sa.Column("weights_fingerprint", sa.String(128), nullable=False),
        sa.Column("tokenizer_fingerprint", sa.String(128)),
        sa.Column("prompt_set", sa.String(128), nullable=False),
        sa.Column("channel", sa.String(32), nullable=False),
        sa.Column("rollout_dtype", sa.String(16), nullable=False),
        sa.Column("replay_dtype", sa.String(16), nullable=False),
        sa.Column("knobs", Json, nullable=False),
        sa.Column("layout", Json, nullable=False),
    )
    op.create_table(
        "runs",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("key", sa.String(64), nullable=False, unique=True),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("started_at", sa.DateTime, nullable=False, index=True),
        sa.Column("ended_at", sa.DateTime),
        sa.Column("recorded_at", sa.DateTime, nullable=False),
        sa.Column("trigger", sa.String(64), nullable=False),
        sa.Column("command_line", sa.Text, nullable=False),
        sa.Column("lpx_version", sa.String(64), nullable=False),
        sa.Column("lpx_revision", sa.String(64), nullable=False),
        sa.Column("run_dir", sa.Text, nullable=False),
        sa.Column("testbed_id", sa.Integer, sa.ForeignKey("testbeds.id")),
        sa.Column("errors", Json, nullable=False),
        sa.Column("manifest", Json, nullable=False),
    )
    op.create_table(
        "series",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("key", sa.String(64), nullable=False, unique=True),
        sa.Column("case_id", sa.Integer, sa.ForeignKey("cases.id"), nullable=False),
        sa.Column("rollout_engine", sa.String(64), nullable=False),
        sa.Column("replay_engine", sa.String(64), nullable=False),
        sa.Column("testbed_id", sa.Integer, sa.ForeignKey("testbeds.id"), nullable=False),
        sa.Column("label", sa.String(512), nullable=False),
    )
    op.create_table(
        "comparisons",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column(
            "run_id",
            sa.Integer,
            sa.ForeignKey("runs.id", ondelete="CASCADE"),
            nullable=False,
            index=True,
        ),
        sa.Column("series_id", sa.Integer, sa.ForeignKey("series.id"), nullable=False),
        sa.Column("started_at", sa.DateTime, nullable=False),
        sa.Column("pair", sa.String(512), nullable=False),
        sa.Column(
            "rollout_build_id", sa.Integer, sa.ForeignKey("engine_builds.id"), nullable=False
        ),
        sa.Column("replay_build_id", sa.Integer, sa.ForeignKey("engine_builds.id"), nullable=False),
        sa.Column("verdict", sa.String(16), nullable=False),
        sa.Column("profile", sa.String(32), nullable=False),
        sa.Column("tau", sa.Float, nullable=False),
        sa.Column("tokens", sa.Integer, nullable=False),
        sa.Column("sequences", sa.Integer, nullable=False),
        sa.Column("seed", sa.Integer),
        sa.Column("findings", Json, nullable=False),
        sa.Column("violations", Json, nullable=False),
        sa.Column("details", Json, nullable=False),
        sa.UniqueConstraint("run_id", "pair"),
    )
    op.create_index("ix_comparisons_series_time", "comparisons", ["series_id", "started_at"])
    op.create_table(
        "metric_values",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column(
            "comparison_id",
            sa.Integer,
            sa.ForeignKey("comparisons.id", ondelete="CASCADE"),
            nullable=False,
        ),
        sa.Column("series_id", sa.Integer, sa.ForeignKey("series.id"), nullable=False),
        sa.Column("started_at", sa.DateTime, nullable=False),
        sa.Column("name", sa.String(128), nullable=False),
        sa.Column("value", sa.Float),
        sa.Column("unit", sa.String(32), nullable=False),
        sa.Column("better", sa.String(8), nullable=False),
        sa.UniqueConstraint("comparison_id", "name"),
    )
    op.create_index(
        "ix_metric_values_series_name_time", "metric_values", ["series_id", "name", "started_at"]
    )


def downgrade() -> None:
    for table in ("metric_values", "comparisons", "series", "runs", "cases"):
        op.drop_table(table)
    op.drop_table("engine_builds")
    op.drop_table("testbeds")
