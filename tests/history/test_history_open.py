"""Opening the history: only commands that record may create a database, and a database lpx
cannot use (newer schema, not SQLite at all) is refused with every byte left as it was."""

import sqlite3
from datetime import datetime
from pathlib import Path

import pytest
from sqlalchemy import create_engine, inspect, text

from support.helpers import run_lpx
from support.synthetic_runs import pair_report, write_run

# The commands that only read or annotate the history, with what each needs besides --db.
READ_ONLY = {
    "gate": ["gate"],
    "history": ["history"],
    "report": ["report", "--out", "site"],
    "ack": ["ack", "1", "--note", "known"],
    "annotate": ["annotate", "1", "--exclude", "1", "--reason", "flaky runner"],
}


def beside(path: Path) -> set[str]:
    """What lies in ``path``'s directory with its name as a prefix: the file and any
    -wal/-shm/-journal SQLite would leave next to it."""
    return {p.name for p in path.parent.iterdir() if p.name.startswith(path.name)}


def one_error_line(result) -> str:
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1 and lines[0].startswith("Error: "), (
        result.output
    )
    return lines[0]


@pytest.mark.parametrize("command", READ_ONLY)
def test_a_read_only_command_on_a_typod_path_creates_nothing(command, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    db = tmp_path / "runs" / "typo" / "lpx.db"
    line = one_error_line(run_lpx(*READ_ONLY[command], "--db", db))
    assert f"no lpx history at {db}" in line and f"lpx record RUN_DIR --db {db}" in line
    assert not (tmp_path / "runs").exists()  # neither the file nor its parent directories


@pytest.mark.parametrize("command", ["gate", "history"])
def test_a_read_only_command_leaves_an_empty_file_as_it_was(command, tmp_path):
    db = tmp_path / "empty.db"
    db.touch()
    line = one_error_line(run_lpx(*READ_ONLY[command], "--db", db))
    assert f"no lpx history at {db}" in line
    assert db.read_bytes() == b"" and beside(db) == {"empty.db"}


def test_record_creates_the_database_and_its_directories(tmp_path):
    run = write_run(tmp_path / "night", {"c": pair_report()}, started_at=datetime(2026, 1, 1))
    db = tmp_path / "new" / "dir" / "lpx.db"
    assert run_lpx("record", run, "--db", db).exit_code == 0
    gate = run_lpx("gate", "--db", db)
    assert gate.exit_code == 0 and "gate: PASS" in gate.output


def newer_database(path: Path, wal: bool) -> Path:
    """A SQLite history written by a later lpx: its schema revision is unknown here."""
    connection = sqlite3.connect(path)
    if wal:
        connection.execute("PRAGMA journal_mode=WAL")
    connection.execute("CREATE TABLE alembic_version (version_num VARCHAR(32) PRIMARY KEY)")
    connection.execute("INSERT INTO alembic_version VALUES ('0099')")
    connection.execute("CREATE TABLE runs (id INTEGER PRIMARY KEY)")
    connection.commit()
    connection.close()
    assert beside(path) == {path.name}
    return path


def unusable_databases(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    text_file = tmp_path / "notes.txt"
    text_file.write_text("this is not a database\n" * 20)
    return {
        "newer (rollback journal)": (
            newer_database(tmp_path / "newer.db", wal=False),
            "revision 0099, newer than this lpx",
        ),
        "newer (WAL)": (
            newer_database(tmp_path / "newer-wal.db", wal=True),
            "revision 0099, newer than this lpx",
        ),
        "a text file": (text_file, "is not a SQLite database"),
    }


def test_a_database_lpx_cannot_use_keeps_every_byte(tmp_path):
    run = write_run(tmp_path / "night", {"c": pair_report()}, started_at=datetime(2026, 1, 1))
    for name, (db, says) in unusable_databases(tmp_path).items():
        before = db.read_bytes()
        for args in (*READ_ONLY.values(), ["record", run]):
            line = one_error_line(run_lpx(*args, "--db", db))
            assert says in line and str(db) in line, (name, args, line)
            assert db.read_bytes() == before, (name, args)  # the header's journal mode too
            assert beside(db) == {db.name}, (name, args)


def test_a_newer_database_is_refused_before_anything_is_written(history_url, tmp_path):
    """On PostgreSQL too: no migration and no lpx table change happen on refusal."""
    run = write_run(tmp_path / "night", {"c": pair_report()}, started_at=datetime(2026, 1, 1))
    engine = create_engine(history_url)
    with engine.begin() as connection:
        connection.execute(text("CREATE TABLE alembic_version (version_num VARCHAR(32))"))
        connection.execute(text("INSERT INTO alembic_version VALUES ('0099')"))
    line = one_error_line(run_lpx("record", run, "--db", history_url))
    assert "revision 0099, newer than this lpx" in line and "upgrade lpx" in line
    assert inspect(engine).get_table_names() == ["alembic_version"]
    engine.dispose()


def test_a_postgresql_database_without_a_history_is_not_migrated_by_reading(
    postgres_server, tmp_path
):
    base, query = postgres_server.get_uri().split("?", 1)
    server = base.rsplit("/", 1)[0].replace("postgresql://", "postgresql+psycopg://")
    postgres_server.psql("DROP DATABASE IF EXISTS lpx_open_empty;")
    postgres_server.psql("CREATE DATABASE lpx_open_empty;")
    empty = f"{server}/lpx_open_empty?{query}"
    line = one_error_line(run_lpx("gate", "--db", empty))
    assert "no lpx history at postgresql+psycopg://" in line and "lpx_open_empty" in line
    engine = create_engine(empty)
    assert inspect(engine).get_table_names() == []
    engine.dispose()
    missing = one_error_line(run_lpx("history", "--db", f"{server}/lpx_no_such_db?{query}"))
    assert "cannot open the history database" in missing and "lpx_no_such_db" in missing
