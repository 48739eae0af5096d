"""What PostgresSink checks about its target table before a query writes a row.

:func:`describe_table` reads a table's columns from the catalog; :func:`check_columns` says whether
each column the query writes exists, can be written (not generated) and takes the query's Arrow
type; :func:`unique_keys` lists the column sets ON CONFLICT can name. Every refusal is a
ValueError naming the table, the column and both types::

    with psycopg.connect(dsn) as conn:
        table = describe_table(conn, ("public", "orders"))
        check_columns(table, pa.schema([("id", pa.int64()), ("name", pa.string())]), None)
        ("id",) in unique_keys(conn, table)      # True with a primary key on id

Arrow types are matched against base types (a domain counts as its base type); a write that can
still fail on a value (a too long ``varchar(n)``, an integer out of a column's range is refused
up front instead) fails the task loudly, never silently.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import psycopg
import pyarrow as pa
from psycopg import sql

_INT_BITS = {"int2": 16, "int4": 32, "int8": 64}
_TEXT = {"text", "varchar", "bpchar", "json", "jsonb", "uuid"}


@dataclass(frozen=True)
class Column:
    """One column of the target table, as the catalog describes it."""

    name: str
    type: str              # format_type: "integer", "numeric(10,2)", "timestamp with time zone"
    base: str              # the base type's typname: "int4", "numeric", "timestamptz" (a domain's base type)
    typmod: int            # -1 when unconstrained
    not_null: bool
    has_default: bool      # a default or an identity, so it may be left out
    generated: bool        # GENERATED ALWAYS AS (...) STORED, or an identity GENERATED ALWAYS: never written


@dataclass(frozen=True)
class Table:
    """A target table: its quoted name for messages, its oid and its columns in table order."""

    name: str
    oid: int
    columns: dict[str, Column]


def identifier(parts: tuple[str, ...]) -> sql.Identifier:
    """``("public", "orders")`` as the SQL identifier ``"public"."orders"``."""
    return sql.Identifier(*parts)


def describe_table(conn: psycopg.Connection, table: tuple[str, ...]) -> Table:
    """The table ``table`` (``(schema, name)`` or ``(name,)``, found on the search path); ValueError
    if there is no such table (a view or another kind of relation is refused too)."""
    name = identifier(table).as_string(conn)
    row = conn.execute("SELECT c.oid, c.relkind FROM pg_class c WHERE c.oid = to_regclass(%s)", (name,)).fetchone()
    if row is None:
        raise ValueError(f"PostgresSink table={name}: no such table in database {conn.info.dbname!r} "
                         "(create it first; names are used exactly as given, case included)")
    oid, kind = row
    if kind not in ("r", "p"):
        raise ValueError(f"PostgresSink table={name}: is not a table (relkind {kind!r}); COPY needs a table")
    rows = conn.execute(
        """SELECT a.attname, format_type(a.atttypid, a.atttypmod),
                  CASE WHEN t.typtype = 'd' THEN b.typname ELSE t.typname END,
                  CASE WHEN t.typtype = 'd' THEN t.typtypmod ELSE a.atttypmod END,
                  a.attnotnull, a.atthasdef OR a.attidentity <> '', a.attgenerated <> '' OR a.attidentity = 'a'
           FROM pg_attribute a JOIN pg_type t ON t.oid = a.atttypid LEFT JOIN pg_type b ON b.oid = t.typbasetype
           WHERE a.attrelid = %s AND a.attnum > 0 AND NOT a.attisdropped ORDER BY a.attnum""", (oid,)).fetchall()
    return Table(name, oid, {r[0]: Column(*r) for r in rows})


def check_columns(table: Table, schema: pa.Schema | None, columns: Sequence[str] | None) -> list[str]:
    """The columns the query writes, checked; ValueError naming the first problem.

    ``columns`` (the sink's ``columns=``) are written if given, else the schema's fields. With a
    schema, each written column must be one of its fields, and every field must be written (a field
    left out would be dropped silently). Columns the query does not write must have a default or
    allow NULL.
    """
    if columns is None and schema is None:
        return []  # the foreach path without columns=: the rows name their columns
    written = list(columns) if columns is not None else schema.names
    if len(set(written)) < len(written):
        raise ValueError(f"PostgresSink: column names written twice: {written}")
    if schema is not None:
        fields = schema.names
        missing = [c for c in written if c not in fields]
        if missing:
            raise ValueError(f"PostgresSink columns={list(columns or [])}: the query has no field {missing[0]!r} "
                             f"(its fields: {fields})")
        dropped = [f for f in fields if f not in written]
        if dropped:
            raise ValueError(f"PostgresSink columns={list(columns or [])}: the query's fields {dropped} would not be "
                             "written; select them away in the query or add them to columns=")
    for name in written:
        column = table.columns.get(name)
        if column is None:
            raise ValueError(f"PostgresSink: table {table.name} has no column {name!r} "
                             f"(its columns: {list(table.columns)})")
        if column.generated:
            raise ValueError(f"PostgresSink: column {name!r} of {table.name} is generated ({column.type}); "
                             "it cannot be written: leave it out")
        if schema is not None:
            kind = schema.field(name).type
            if not writable(kind, column):
                raise ValueError(f"PostgresSink: column {name!r} of {table.name} is {column.type}; the query's "
                                 f"{kind} cannot be written to it. {_hint(kind)}")
    for column in table.columns.values():
        if column.name not in written and column.not_null and not column.has_default:
            raise ValueError(f"PostgresSink: column {column.name!r} of {table.name} is NOT NULL without a default, "
                             f"and the query does not write it (it writes {written})")
    return written


def writable(kind: pa.DataType, column: Column) -> bool:
    """Whether every value of Arrow type ``kind`` can be written to ``column`` without being changed."""
    base = column.base
    if pa.types.is_null(kind):
        return True  # all NULL
    if pa.types.is_dictionary(kind):
        return writable(kind.value_type, column)
    if pa.types.is_integer(kind):
        bits = kind.bit_width + (1 if pa.types.is_unsigned_integer(kind) else 0)
        return (base in _INT_BITS and bits <= _INT_BITS[base] or base == "numeric" and column.typmod == -1
                or base == "float8" and bits <= 53 or base == "float4" and bits <= 24)
    if pa.types.is_floating(kind):
        return base == "float8" or base == "float4" and kind.bit_width <= 32
    if pa.types.is_decimal(kind):
        if base != "numeric":
            return False
        if column.typmod == -1:
            return True
        precision, scale = (column.typmod - 4) >> 16, (column.typmod - 4) & 0xFFFF
        return kind.scale <= scale and kind.precision - kind.scale <= precision - scale
    if pa.types.is_string(kind) or pa.types.is_large_string(kind):
        return base in _TEXT
    if pa.types.is_boolean(kind):
        return base == "bool"
    if pa.types.is_binary(kind) or pa.types.is_large_binary(kind) or pa.types.is_fixed_size_binary(kind):
        return base == "bytea"
    if pa.types.is_date(kind):
        return base == "date"
    if pa.types.is_timestamp(kind):
        return base in ("timestamp", "timestamptz")
    if pa.types.is_time(kind):
        return base == "time"
    return False


def _hint(kind: pa.DataType) -> str:
    if pa.types.is_integer(kind):
        return "Use an integer column at least as wide, or cast the column in the query (col.cast('int'))."
    if pa.types.is_floating(kind):
        return "Use a double precision (or, for 32-bit floats, real) column."
    if pa.types.is_decimal(kind):
        return "Use a numeric column with at least as many digits before and after the point."
    if pa.types.is_nested(kind):
        return "Nested types are not written; serialize them to a JSON string (to_json) for a json/jsonb column."
    return ("Writable: integers, floats, decimals to numeric, strings to text/varchar/char/json/jsonb/uuid, "
            "booleans, binary to bytea, dates, timestamps to timestamp/timestamptz, times.")


def unique_keys(conn: psycopg.Connection, table: Table) -> set[frozenset[str]]:
    """The column sets of the table's valid, non-partial unique indexes on plain columns (what
    ``ON CONFLICT (columns)`` can infer), primary key included."""
    rows = conn.execute(
        """SELECT ARRAY(SELECT a.attname FROM unnest(i.indkey[0:i.indnkeyatts - 1]) k
                        JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k)::text[]
           FROM pg_index i
           WHERE i.indrelid = %s AND i.indisunique AND i.indisvalid AND i.indpred IS NULL AND i.indexprs IS NULL""",
        (table.oid,)).fetchall()
    return {frozenset(r[0]) for r in rows}
