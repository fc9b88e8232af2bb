"""Open the run history: resolve the URL, migrate on first use, hand out transactions.

SQLite (a file, the embedded default) and PostgreSQL (the shared-team backend) run the same
Alembic migrations. Writers are serialised — SQLite with ``BEGIN IMMEDIATE``, PostgreSQL with
a transaction-scoped advisory lock — so two `lpx record` processes never interleave their
detection updates, and every write is one transaction that commits whole or not at all.
"""

from __future__ import annotations

import functools
import os
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import orjson
from sqlalchemy import Engine, create_engine, event, exc, make_url, text
from sqlalchemy.orm import Session

from pipeline.errors import BadInput

DEFAULT_DB = Path("runs") / "lpx.db"
WRITE_LOCK_ID = 0x6C7078  # "lpx": the advisory lock every PostgreSQL writer takes
SQLITE_BUSY_TIMEOUT_S = 120
DETECTION_REVISION = "0002"  # points recorded before it are re-evaluated after upgrading


def json_dumps(value) -> str:
    return orjson.dumps(value, option=orjson.OPT_NON_STR_KEYS).decode()


# orjson for the JSON columns: series detection states are rewritten on every point.
JSON_CODEC = {"json_serializer": json_dumps, "json_deserializer": orjson.loads}


def resolve_url(db: str | None) -> str:
    """A SQLAlchemy URL from --db: a URL as is, a plain path as a SQLite file, None -> default."""
    value = db or os.environ.get("LPX_DB") or str(DEFAULT_DB)
    if "://" in value:
        return value
    return f"sqlite:///{Path(value).expanduser().resolve()}"


def describe(url: str) -> str:
    """The URL for messages, password hidden."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except exc.ArgumentError:
        return url


class History:
    """A migrated history database: `read()` and `write()` sessions, one transaction each."""

    def __init__(self, url: str, engine: Engine):
        self.url = url
        self.engine = engine

    @contextmanager
    def read(self) -> Iterator[Session]:
        with self.engine.connect() as connection, Session(bind=connection) as session:
            yield session

    @contextmanager
    def write(self) -> Iterator[Session]:
        """One serialised write transaction: committed when the block ends, rolled back on
        any error, so a failed record leaves the database as it was. A server that goes
        away mid-write (killed, restarted) is one error naming the database."""
        try:
            with self.engine.connect() as connection:
                connection = connection.execution_options(lpx_write=True)
                with Session(bind=connection) as session, session.begin():
                    _take_write_lock(session)
                    yield session
        except exc.DBAPIError as error:
            if not error.connection_invalidated:
                raise
            reason = str(error.orig or error).strip().splitlines() or [type(error).__name__]
            raise BadInput(
                f"lost the history database {describe(self.url)} during the write "
                f"({reason[0]}); the write is one transaction, so none of it is kept (or, lost "
                "at its very commit, all of it): once the server is up, run the same command "
                "again; runs already recorded are skipped."
            ) from None

    def dispose(self) -> None:
        self.engine.dispose()


def open_history(db: str | None = None, migrate: bool = True, *, create: bool = True) -> History:
    """Connect, check the schema, and bring it to this lpx's head (never dropping anything).

    Only commands that record may create the database; the others pass ``create=False``, and
    for them a database that does not exist, or holds no lpx history yet, is an error naming
    it (a typo'd --db must not leave an empty database behind). Nothing is written to a database this lpx cannot use: a
    SQLite file is checked read-only (a SQLite database at all, a schema revision this lpx
    knows) before the first connection switches it to WAL mode or migrates it.
    """
    url = resolve_url(db)
    sqlite_path = _sqlite_file(_parse_url(url))
    if sqlite_path is not None:
        if sqlite_path.exists():
            _check_revision(url, _sqlite_revision(sqlite_path), create)
        elif not create:
            raise BadInput(_no_history(url))
    engine = _create_engine(url, create)
    try:
        with engine.connect() as connection:
            current = _current_revision(connection)
    except (exc.OperationalError, exc.DatabaseError, exc.InterfaceError) as error:
        engine.dispose()
        reason = (str(error.orig) if getattr(error, "orig", None) else str(error)).strip()
        raise BadInput(
            f"cannot open the history database {describe(url)}: "
            f"{reason.splitlines()[0] if reason else type(error).__name__}; "
            "check --db / LPX_DB (a SQLite path or a postgresql+psycopg:// URL) and that the "
            "server is up."
        ) from None
    try:
        _check_revision(url, current, create)
    except BadInput:
        engine.dispose()
        raise
    head = head_revision()
    if current != head:
        if not migrate:
            engine.dispose()
            raise BadInput(f"the history database {describe(url)} needs migrating to {head}.")
        _upgrade(engine)
    return History(url, engine)


def schema_revision(history: History) -> str | None:
    with history.engine.connect() as connection:
        return _current_revision(connection)


def head_revision() -> str:
    return _script_revisions()[0]


def _parse_url(url: str):
    try:
        return make_url(url)
    except exc.ArgumentError:
        raise BadInput(
            f"--db {url!r} is not a database URL or path; use e.g. runs/lpx.db or "
            "postgresql+psycopg://user@host/lpx."
        ) from None


def _create_engine(url: str, create: bool = True) -> Engine:
    parsed = _parse_url(url)
    if parsed.get_backend_name() == "sqlite":
        return _create_sqlite_engine(parsed, create)
    try:
        return create_engine(parsed, pool_pre_ping=True, **JSON_CODEC)
    except (exc.NoSuchModuleError, ImportError, exc.ArgumentError) as error:
        raise BadInput(
            f"cannot use the history database {describe(url)}: {error}; lpx supports SQLite "
            "and PostgreSQL (postgresql+psycopg://)."
        ) from None


def _sqlite_file(parsed) -> Path | None:
    """The SQLite database file a URL names; None for PostgreSQL and in-memory databases."""
    if parsed.get_backend_name() != "sqlite":
        return None
    database = parsed.database
    if not database or database == ":memory:" or database.startswith("file:"):
        return None
    return Path(database).expanduser().resolve()


def _sqlite_revision(path: Path) -> str | None:
    """The schema revision of an existing SQLite file, read so that a file lpx refuses keeps
    every byte and gains no -wal/-shm/-journal beside it."""
    if not path.is_file():  # a FIFO would block the read forever, a directory fail later
        raise BadInput(f"{path} is not a regular file, so not an lpx history; check --db / LPX_DB.")
    try:
        with path.open("rb") as file:
            header = file.read(100)
    except OSError as error:
        raise BadInput(
            f"cannot read the history database {path}: {error.strerror}; check --db / LPX_DB."
        ) from None
    if not header:
        return None  # an empty file is an empty SQLite database
    if len(header) < 100 or not header.startswith(b"SQLite format 3\x00"):
        raise BadInput(
            f"{path} is not a SQLite database, so not an lpx history; check --db / LPX_DB "
            "(a file `lpx record` wrote, or a postgresql+psycopg:// URL)."
        )
    uri = f"{path.as_uri()}?mode=ro"
    # A read-only connection to a WAL database creates -wal and -shm and leaves them behind.
    # With no -wal file every page is in the main file, so read it as immutable (no lock
    # files); a -wal that exists is read the normal way, its files being there already.
    if header[18] == 2 and not Path(f"{path}-wal").exists():
        uri += "&immutable=1"
    try:
        connection = sqlite3.connect(uri, uri=True, timeout=SQLITE_BUSY_TIMEOUT_S)
        try:
            tables = {
                name
                for (name,) in connection.execute(
                    "SELECT name FROM sqlite_master WHERE type='table'"
                )
            }
            if "alembic_version" not in tables:
                return None
            row = connection.execute("SELECT version_num FROM alembic_version").fetchone()
            return row[0] if row else None
        finally:
            connection.close()
    except sqlite3.Error as error:
        raise BadInput(
            f"cannot read the history database {path}: {error}; check --db / LPX_DB, it "
            "should name a file `lpx record` wrote."
        ) from None


def _check_revision(url: str, current: str | None, create: bool) -> None:
    """Refuse a schema newer than this lpx, and a database without a history unless the
    command is one that records."""
    head, known = _script_revisions()
    if current is not None and current not in known:
        raise BadInput(
            f"the history database {describe(url)} is at schema revision {current}, newer than "
            f"this lpx knows (up to {head}); upgrade lpx to read or write it."
        )
    if current is None and not create:
        raise BadInput(_no_history(url))


def _no_history(url: str) -> str:
    path = _sqlite_file(make_url(url))
    where = str(path) if path is not None else describe(url)
    return (
        f"no lpx history at {where}; check --db / LPX_DB, or record a run first with "
        f"`lpx record RUN_DIR --db {where}`."
    )


def _create_sqlite_engine(parsed, create: bool) -> Engine:
    database = parsed.database
    if create and database and database != ":memory:":
        try:
            Path(database).parent.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise BadInput(
                f"cannot create the history database {database}: {error.strerror} "
                f"({error.filename}); pass --db a writable path or a database URL."
            ) from None
    engine = create_engine(parsed, connect_args={"timeout": SQLITE_BUSY_TIMEOUT_S}, **JSON_CODEC)

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection, _record):
        # Let SQLAlchemy's begin event, not the sqlite3 module, start transactions, so a
        # writer can take the write lock up front (BEGIN IMMEDIATE) instead of failing to
        # upgrade a read lock later with "database is locked".
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute("PRAGMA journal_mode=WAL")  # readers never block the writer
        # WAL + NORMAL is durable across application crashes (only an OS crash can lose the
        # last commits) and spares an fsync per transaction; a 64 MB page cache keeps a
        # year of metric-value indexes in memory while recording.
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.execute("PRAGMA cache_size=-65536")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(connection):
        write = connection.get_execution_options().get("lpx_write")
        connection.exec_driver_sql("BEGIN IMMEDIATE" if write else "BEGIN")

    return engine


def _take_write_lock(session: Session) -> None:
    """Begin the transaction now (SQLite: BEGIN IMMEDIATE), so the lock is held before the
    first read and anything run on the connection (Alembic) joins this transaction."""
    session.connection()
    if session.get_bind().dialect.name == "postgresql":
        session.execute(text("SELECT pg_advisory_xact_lock(:id)"), {"id": WRITE_LOCK_ID})


def _current_revision(connection) -> str | None:
    from alembic.runtime.migration import MigrationContext

    return MigrationContext.configure(connection).get_current_revision()


def _alembic_config(connection=None):
    from alembic.config import Config

    from pipeline.db import MIGRATIONS

    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    config.attributes["connection"] = connection
    return config


@functools.cache
def _script_revisions() -> tuple[str, frozenset[str]]:
    from alembic.script import ScriptDirectory

    script = ScriptDirectory.from_config(_alembic_config())
    return script.get_current_head(), frozenset(rev.revision for rev in script.walk_revisions())


def _upgrade(engine: Engine, revision: str = "head") -> None:
    """Run the migrations inside one locked transaction; a concurrent first use waits for it
    and then finds the schema current."""
    from alembic import command

    with engine.connect() as connection:
        connection = connection.execution_options(lpx_write=True)
        with Session(bind=connection) as session, session.begin():
            _take_write_lock(session)
            before = _current_revision(connection)
            command.upgrade(_alembic_config(connection), revision)
            if before is not None and before < DETECTION_REVISION <= (
                _current_revision(connection) or ""
            ):
                from pipeline.history.evaluate import reevaluate_all

                reevaluate_all(session)
