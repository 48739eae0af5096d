"""Arrow batches into PostgreSQL through ``COPY ... FROM STDIN (FORMAT csv)``.

Arrow's CSV writer (C++) encodes a whole batch at once, with no Python object per value, in the
text PostgreSQL's CSV input reads back: NULL is an unquoted empty field, an empty string is
``""``, timestamps are ISO 8601 (``Z`` for those with a time zone), booleans ``true``/``false``.
Binary columns become bytea's hex text (``\\x00ff``). PostgresSink loads its batches this way, and
so should any writer compared with it (the bench's at-least-once COPY writer), so that both pay for
the same encoding::

    with psycopg.connect(dsn, autocommit=True) as conn, conn.transaction():
        copy_batch(conn.cursor(), sql.Identifier("orders"), batch)
"""

from __future__ import annotations

from collections.abc import Sequence

import psycopg
import pyarrow as pa
import pyarrow.csv as pa_csv
from psycopg import sql

_OPTIONS = pa_csv.WriteOptions(include_header=False, quoting_style="needed")


def copy_statement(table: sql.Composable, columns: Sequence[str], csv: bool) -> sql.Composed:
    """``COPY table (columns) FROM STDIN``, in CSV format if ``csv`` else in text format (psycopg's
    ``Copy.write_row``)."""
    names = sql.SQL(", ").join(map(sql.Identifier, columns))
    form = sql.SQL(" (FORMAT csv)") if csv else sql.SQL("")
    return sql.SQL("COPY {} ({}) FROM STDIN{}").format(table, names, form)


def csv_rows(batch: pa.RecordBatch) -> pa.Buffer:
    """The batch's rows as PostgreSQL CSV (no header), in the batch's column order."""
    columns = [_bytea_hex(c) if _is_binary(c.type) else c for c in batch.columns]
    sink = pa.BufferOutputStream()
    pa_csv.write_csv(pa.RecordBatch.from_arrays(columns, names=batch.schema.names), sink, _OPTIONS)
    return sink.getvalue()


def copy_batch(cursor: psycopg.Cursor, table: sql.Composable, batch: pa.RecordBatch) -> None:
    """Load every row of ``batch`` into ``table`` (the columns named as the batch's fields)."""
    if batch.num_rows == 0:
        return
    with cursor.copy(copy_statement(table, batch.schema.names, csv=True)) as copy:
        copy.write(memoryview(csv_rows(batch)))


def _is_binary(kind: pa.DataType) -> bool:
    return pa.types.is_binary(kind) or pa.types.is_large_binary(kind) or pa.types.is_fixed_size_binary(kind)


def _bytea_hex(column: pa.Array) -> pa.Array:
    # Arrow has no hex kernel; binary columns are rare in streams, so one Python call per value.
    return pa.array([None if v is None else "\\x" + v.hex() for v in column.to_pylist()], pa.string())
