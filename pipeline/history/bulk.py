"""Bulk writes into the history: primary keys taken up front, rows sent straight to the driver (executemany on SQLite, binary COPY with declared types on PostgreSQL), values bound as the driver takes them."""

from __future__ import annotations

from operator import itemgetter

from sqlalchemy import insert
from sqlalchemy.orm import Session

# Binary COPY types by column type; a JSON column's binary form is its text.
PG_TYPES = {
    "Integer": "int4",
    "Float": "float8",
    "String": "varchar",
    "BigInteger": "int8",
    "Boolean": "bool",
    "DateTime": "timestamp",
    "JSON": "text",
}


def bind_value(session: Session, column, value):
    """``value`` as the driver takes it for ``column`` (SQLite stores datetimes as text)."""
    processor = column.type._cached_bind_processor(session.connection().dialect)
    return processor(value) if processor else value


def new_ids(session: Session, table, count: int) -> list[int]:
    """``count`` primary keys for ``table``: PostgreSQL takes them from the column's
    sequence; SQLite's next rowids are safe to take since this transaction holds the
    write lock (BEGIN IMMEDIATE) from its start."""
    connection = session.connection()
    if connection.dialect.name == "postgresql":
        return list(
            connection.exec_driver_sql(
                f"SELECT nextval(pg_get_serial_sequence('{table.name}', 'id')) "
                "FROM generate_series(1, %(count)s)",
                {"count": count},
            ).scalars()
        )
    (last,) = connection.exec_driver_sql(f"SELECT coalesce(max(id), 0) FROM {table.name}").one()
    return list(range(last + 1, last + 1 + count))


def insert_plain_rows(
    session: Session, statements: dict, table, columns: tuple[str, ...], rows: list[tuple]
) -> None:
    """executemany straight to the driver. Metric rows are plain numbers and strings
    (the one datetime is bound by the caller), and SQLAlchemy's per-row parameter
    processing cost several times SQLite's own insert (bench/history.py)."""
    connection = session.connection()
    if connection.dialect.name == "postgresql":
        # Binary COPY with the column types declared: PostgreSQL's bulk path, and psycopg
        # dumps each value without looking at it first.
        cursor = connection.connection.dbapi_connection.cursor()
        statement = f"COPY {table.name} ({', '.join(columns)}) FROM STDIN (FORMAT BINARY)"
        with cursor.copy(statement) as copy:
            copy.set_types([PG_TYPES[type(table.c[name].type).__name__] for name in columns])
            for row in rows:
                copy.write_row(row)
        return
    key = (table.name, columns, connection.dialect.name)
    if key not in statements:
        statements[key] = insert(table).compile(
            dialect=connection.dialect, column_keys=list(columns)
        )
    compiled = statements[key]
    if compiled.positional:
        reorder = itemgetter(*[columns.index(name) for name in compiled.positiontup])
        parameters = [reorder(row) for row in rows]
    else:
        parameters = [dict(zip(columns, row, strict=True)) for row in rows]
    connection.exec_driver_sql(compiled.string, parameters)
