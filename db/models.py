"""The run history's tables: SQLAlchemy 2 models shared by SQLite and PostgreSQL.

One run holds comparisons; each comparison is one point of a series (case + engine pair by
name + testbed, never the engine versions, so one series spans upgrades) and carries its
metric values with the boundaries detection computed for them at that point. Alerts and
annotations belong to a series. The schema itself is created and upgraded by the Alembic
migrations beside this module, never by ``create_all``.

Times are naive UTC datetimes (SQLite has no time zones; PostgreSQL gets the same values).
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

# Plain JSON on both backends: these columns are written on every point (series detection
# state, run-page details) and never searched inside, and JSONB's binary conversion made
# PostgreSQL record a year of nightlies 2x slower (bench/history.py).
Json = JSON()
KEY = 64  # sha256 hex digests


class Base(DeclarativeBase):
    pass


class Run(Base):
    """One pipeline run: a smoke, a nightly or a manual import of compare outputs."""

    __tablename__ = "runs"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    # The idempotency key: the run manifest's run_id, else a digest of the reports.
    key: Mapped[str] = mapped_column(String(KEY), unique=True)
    kind: Mapped[str] = mapped_column(String(16))  # nightly | smoke | manual
    status: Mapped[str] = mapped_column(String(16))  # pass | fail | error
    started_at: Mapped[datetime] = mapped_column(index=True)
    ended_at: Mapped[datetime | None]
    recorded_at: Mapped[datetime]
    trigger: Mapped[str] = mapped_column(String(64))
    command_line: Mapped[str] = mapped_column(Text, default="")
    lpx_version: Mapped[str] = mapped_column(String(64))
    lpx_revision: Mapped[str] = mapped_column(String(64))
    run_dir: Mapped[str] = mapped_column(Text)
    testbed_id: Mapped[int | None] = mapped_column(ForeignKey("testbeds.id"))
    errors: Mapped[list] = mapped_column(Json, default=list)  # [{stage, message}]
    manifest: Mapped[dict] = mapped_column(Json, default=dict)


class EngineBuild(Base):
    """An engine as it ran: name, version, image, and the software stack under it."""

    __tablename__ = "engine_builds"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    key: Mapped[str] = mapped_column(String(KEY), unique=True)
    engine: Mapped[str] = mapped_column(String(64))
    version: Mapped[str] = mapped_column(String(128))
    image_ref: Mapped[str | None] = mapped_column(Text)
    image_digest: Mapped[str | None] = mapped_column(String(128))
    torch: Mapped[str | None] = mapped_column(String(64))
    cuda: Mapped[str | None] = mapped_column(String(64))
    driver: Mapped[str | None] = mapped_column(String(64))
    versions: Mapped[dict] = mapped_column(Json, default=dict)


class Testbed(Base):
    """Where a run ran. The key is the hardware class, not the host: a pool of identical
    runners is one testbed."""

    __tablename__ = "testbeds"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    key: Mapped[str] = mapped_column(String(KEY), unique=True)
    name: Mapped[str] = mapped_column(String(256))
    host: Mapped[str | None] = mapped_column(String(256))
    cpu_model: Mapped[str | None] = mapped_column(String(256))
    cpu_count: Mapped[int | None]
    gpu_model: Mapped[str | None] = mapped_column(String(256))
    gpu_count: Mapped[int] = mapped_column(Integer, default=0)


class Case(Base):
    """What was compared: model, prompt set, channel, dtypes, knobs and parallel layout."""

    __tablename__ = "cases"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    key: Mapped[str] = mapped_column(String(KEY), unique=True)
    label: Mapped[str] = mapped_column(String(256))
    model: Mapped[str] = mapped_column(Text)
    weights_fingerprint: Mapped[str] = mapped_column(String(128))
    tokenizer_fingerprint: Mapped[str | None] = mapped_column(String(128))
    prompt_set: Mapped[str] = mapped_column(String(128))
    channel: Mapped[str] = mapped_column(String(32))
    rollout_dtype: Mapped[str] = mapped_column(String(16))
    replay_dtype: Mapped[str] = mapped_column(String(16))
    # reduced-precision numerics a side declares (contracts/numerics.py), None for none.
    # Deferred: the data migrations before 0009 read cases through this model, from a table
    # that has no such columns yet (pipeline/history/rekey.py reads them where they exist)
    rollout_numerics: Mapped[str | None] = mapped_column(String(256), deferred=True)
    replay_numerics: Mapped[str | None] = mapped_column(String(256), deferred=True)
    # a multi-turn agent loop's turns and mode (migration 0010), None for one completion
    agent_loop: Mapped[str | None] = mapped_column(String(256), deferred=True)
    knobs: Mapped[dict] = mapped_column(Json, default=dict)  # {rollout, replay, sampling}
    layout: Mapped[dict] = mapped_column(Json, default=dict)


class Series(Base):
    """The same comparison over time: case + engine pair by name + testbed."""

    __tablename__ = "series"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    key: Mapped[str] = mapped_column(String(KEY), unique=True)
    case_id: Mapped[int] = mapped_column(ForeignKey("cases.id"))
    rollout_engine: Mapped[str] = mapped_column(String(64))
    replay_engine: Mapped[str] = mapped_column(String(64))
    testbed_id: Mapped[int] = mapped_column(ForeignKey("testbeds.id"))
    label: Mapped[str] = mapped_column(String(512))
    # Detection state per metric (baseline window, violation streak, open alert): a cache
    # that lets a new point be judged without rereading the series; rebuilt from the
    # stored points whenever an annotation or acknowledgement changes the past.
    detection_state: Mapped[dict] = mapped_column(Json, default=dict)
    last_started_at: Mapped[datetime | None]


class Comparison(Base):
    """One rollout side x replay side comparison of one run: a point of its series."""

    __tablename__ = "comparisons"
    __table_args__ = (
        UniqueConstraint("run_id", "pair"),
        # "The same comparison over time" is this index.
        Index("ix_comparisons_series_time", "series_id", "started_at"),
    )
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    series_id: Mapped[int] = mapped_column(ForeignKey("series.id"))
    started_at: Mapped[datetime]  # the run's, copied so the series index orders by it
    pair: Mapped[str] = mapped_column(String(512))  # the compare directory inside the run
    rollout_build_id: Mapped[int] = mapped_column(ForeignKey("engine_builds.id"))
    replay_build_id: Mapped[int] = mapped_column(ForeignKey("engine_builds.id"))
    verdict: Mapped[str] = mapped_column(String(16))  # pass | fail
    profile: Mapped[str] = mapped_column(String(32))
    tau: Mapped[float] = mapped_column(Float)
    tokens: Mapped[int] = mapped_column(Integer)
    sequences: Mapped[int] = mapped_column(Integer)
    seed: Mapped[int | None] = mapped_column(BigInteger)  # sampling seeds are 64-bit
    findings: Mapped[list] = mapped_column(Json, default=list)  # [{cause, severity, ...}]
    violations: Mapped[list] = mapped_column(Json, default=list)
    # What the run page shows: worst tokens (decoded), diagnosis, heatmap, reproduce.
    details: Mapped[dict] = mapped_column(Json, default=dict)
    # the prompt set, the token digest and the agreement with the series' previous night
    # (pipeline/history/workload.py); NULL for reports without a digest
    workload: Mapped[dict | None] = mapped_column(Json)
    # `lpx localize` on this pair (localize/ beside its report.json): clean | localized |
    # verified, or error | skipped when the run's localize stage did not finish; NULL: none.
    localize_verdict: Mapped[str | None] = mapped_column(String(16))
    localize_boundary: Mapped[str | None] = mapped_column(String(128))  # the first beyond
    # first, verification, margin, sides, sequences, tokens, seconds (or the stage's message)
    localize: Mapped[dict | None] = mapped_column(Json)


class LocalizeBoundary(Base):
    """One boundary of a comparison's localize.json: drift against the two sides' precision
    floors, by the largest token and by RMS, and whether it is beyond them."""

    __tablename__ = "localize_boundaries"
    __table_args__ = (
        UniqueConstraint("comparison_id", "boundary"),
        # A series page asks for one boundary over the series' runs.
        Index("ix_localize_boundaries_series", "series_id", "boundary"),
    )
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    comparison_id: Mapped[int] = mapped_column(ForeignKey("comparisons.id", ondelete="CASCADE"))
    series_id: Mapped[int] = mapped_column(Integer)  # the comparison's, copied for the index
    started_at: Mapped[datetime]
    boundary: Mapped[str] = mapped_column(String(128))  # embed, layers.{i}.{kind}, logits ...
    layer: Mapped[int | None] = mapped_column(Integer)  # NULL outside the layers
    kind: Mapped[str] = mapped_column(String(32))
    drift_max: Mapped[float] = mapped_column(Float)
    drift_rms: Mapped[float] = mapped_column(Float)
    floor_max: Mapped[float] = mapped_column(Float)
    floor_rms: Mapped[float] = mapped_column(Float)
    ratio: Mapped[float] = mapped_column(Float)  # drift / floor, the larger of max and RMS
    beyond: Mapped[bool] = mapped_column(Boolean)  # ratio past localize's margin


class MetricValue(Base):
    """One metric of one comparison, with the boundaries detection computed at this point."""

    __tablename__ = "metric_values"
    __table_args__ = (
        UniqueConstraint("comparison_id", "name"),
        # Series pages and re-evaluation read a whole series; nothing filters on the name.
        Index("ix_metric_values_series", "series_id"),
    )
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    comparison_id: Mapped[int] = mapped_column(ForeignKey("comparisons.id", ondelete="CASCADE"))
    # The comparison's series, copied for the index; not a foreign key of its own, since the
    # comparison's reference is checked already and a year's import would check 365,000 more.
    series_id: Mapped[int] = mapped_column(Integer)
    started_at: Mapped[datetime]
    name: Mapped[str] = mapped_column(String(128))
    value: Mapped[float | None] = mapped_column(Float)  # NULL: not finite
    unit: Mapped[str] = mapped_column(String(32))
    better: Mapped[str] = mapped_column(String(8))  # lower | higher | none (two-sided)
    baseline: Mapped[float | None] = mapped_column(Float)
    band: Mapped[float | None] = mapped_column(Float)
    lower: Mapped[float | None] = mapped_column(Float)
    upper: Mapped[float | None] = mapped_column(Float)
    baseline_points: Mapped[int] = mapped_column(Integer, default=0)
    # ok | suspicious | regression | insufficient_data | excluded | error_run | untracked
    status: Mapped[str] = mapped_column(String(24))


class Alert(Base):
    """A detected problem on a series: active, acknowledged (with a note) or silenced."""

    __tablename__ = "alerts"
    __table_args__ = (Index("ix_alerts_series_status", "series_id", "status"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    series_id: Mapped[int] = mapped_column(ForeignKey("series.id"))
    metric: Mapped[str] = mapped_column(String(128))  # or "policy" for policy violations
    kind: Mapped[str] = mapped_column(String(24))  # regression | suspicious | policy_violation
    status: Mapped[str] = mapped_column(String(16))  # active|acknowledged|silenced|resolved
    first_bad_id: Mapped[int] = mapped_column(ForeignKey("comparisons.id", ondelete="CASCADE"))
    last_good_id: Mapped[int | None] = mapped_column(
        ForeignKey("comparisons.id", ondelete="SET NULL")
    )
    latest_id: Mapped[int] = mapped_column(ForeignKey("comparisons.id", ondelete="CASCADE"))
    value_before: Mapped[float | None] = mapped_column(Float)
    value_after: Mapped[float | None] = mapped_column(Float)
    rule: Mapped[str] = mapped_column(Text)
    attribution: Mapped[list] = mapped_column(Json, default=list)
    note: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime]
    updated_at: Mapped[datetime]


class Annotation(Base):
    """A person's word on a series point: a distribution change starts here, or exclude it."""

    __tablename__ = "annotations"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    series_id: Mapped[int] = mapped_column(ForeignKey("series.id"), index=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    kind: Mapped[str] = mapped_column(String(24))  # distribution_change | excluded
    reason: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime]


class Calibration(Base):
    """A model's measured noise floor (`lpx calibrate`), kept so later nights reuse it: keyed
    by the weights, engine, layout, hardware and library versions it was measured with."""

    __tablename__ = "calibrations"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    key: Mapped[str] = mapped_column(String(KEY), index=True)  # digest of its key
    model_fingerprint: Mapped[str | None] = mapped_column(Text)
    engine: Mapped[str] = mapped_column(String(64))
    hardware: Mapped[str | None] = mapped_column(Text)
    precisions: Mapped[list] = mapped_column(Json, default=list)
    created_at: Mapped[datetime]
    run_id: Mapped[int | None] = mapped_column(ForeignKey("runs.id", ondelete="SET NULL"))
    payload: Mapped[dict] = mapped_column(Json, default=dict)
    __table_args__ = (UniqueConstraint("key", "created_at", name="uq_calibration_made"),)


class Bisect(Base):
    """An `lpx bisect`: the first bad engine build of a failing pair, and every probe. It
    belongs to the series of its case and engine pair (any testbed), found by the case's key."""

    __tablename__ = "bisects"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    bisect_id: Mapped[str] = mapped_column(String(KEY), unique=True)
    case_key: Mapped[str | None] = mapped_column(String(KEY), index=True)
    rollout_engine: Mapped[str | None] = mapped_column(String(64))
    replay_engine: Mapped[str | None] = mapped_column(String(64))
    plan: Mapped[str] = mapped_column(String(256))
    pair: Mapped[str] = mapped_column(String(256))
    side: Mapped[str] = mapped_column(String(16))
    good: Mapped[str] = mapped_column(Text)
    bad: Mapped[str] = mapped_column(Text)
    first_bad: Mapped[str | None] = mapped_column(Text)
    last_good: Mapped[str | None] = mapped_column(Text)
    stopped: Mapped[str | None] = mapped_column(Text)  # why there is no answer
    runs: Mapped[int] = mapped_column(Integer)
    path: Mapped[str] = mapped_column(Text)
    result: Mapped[dict] = mapped_column(Json, default=dict)  # bisect.json's result
    finished_at: Mapped[datetime | None]
