"""Exactly-once into a PostgreSQL table: a TwoPhaseCommitSink over PostgreSQL's own two-phase commit.

Each task attempt loads its rows into one database transaction with ``COPY`` (Arrow batches as CSV,
rows from ``write`` in buffered text COPYs), adds a marker row naming its global id to the marker
table, and runs ``PREPARE TRANSACTION <gid>``: the rows are durable (they survive a crash of the
server) and invisible. The coordinator's ``commit`` is ``COMMIT PREPARED <gid>``; the marker row
tells a commit that already happened (no prepared transaction, a marker) from one that never can
(neither). ``upsert`` mode stages the rows in an unlogged table inside the same transaction and
merges them with ``INSERT ... ON CONFLICT (key) DO UPDATE``. See docs/postgres-sink.md.

Usage::

    from sinks.postgres import PostgresSink
    from twophase.spark import write_stream

    # The password comes from PGPASSWORD or a passfile in every process, never from the dsn.
    sink = PostgresSink("host=db.internal dbname=shop user=spark", "public.orders")
    write_stream(df, sink, app="orders", zk="127.0.0.1:2181") \\
        .option("checkpointLocation", "/data/orders-checkpoint").start()

    PostgresSink(dsn, "stock", mode="upsert", key="sku")   # the last row of a key wins
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import psycopg
import pyarrow as pa
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from sinks.postgres_copy import copy_batch, copy_statement
from sinks.postgres_idle import IdleConnections
from sinks.postgres_target import Table, check_columns, describe_table, identifier, unique_keys
from twophase.sink import (
    AbortFailed,
    CommitFailed,
    CommitOutcomeUnknown,
    PreparedTransaction,
    TwoPhaseCommitSink,
    TxnContext,
)

MODES = ("append", "upsert")
GID_PREFIX = "tp1"             # the version of the gid format (docs/postgres-sink.md)
MAX_GID_BYTES = 200            # PostgreSQL's limit for a prepared transaction's global id
ROW_BUFFER = 10_000            # rows from write() loaded per COPY
CONNECT_TIMEOUT = 10           # seconds, unless the dsn sets connect_timeout
_SECRETS = ("password", "sslpassword")
_SEQ = "_twophase_seq"         # the arrival order of staged rows, in upsert mode


@dataclass(frozen=True)
class PostgresHandle:
    """A prepared transaction: all commit and abort need, in any process. No password is in it::

        PostgresHandle("host=db dbname=shop user=spark", "tp1:5d41402a:7c211433:r1.7.3.0", "orders", "q-1", 7, 1000)

    ``gid`` is None when the attempt wrote no row (nothing was prepared; commit and abort do nothing).
    """

    dsn: str
    gid: str | None
    app: str
    query_id: str
    epoch: int
    rows: int


@dataclass
class PostgresTxn:
    """One attempt's open transaction: its connection (opened with its first rows) and what it wrote."""

    ctx: TxnContext
    gid: str
    conn: psycopg.Connection | None = None
    columns: list[str] | None = None        # fixed by the first rows
    rows: int = 0
    buffered: list[Sequence[Any]] = field(default_factory=list)
    stage: sql.Identifier | None = None      # upsert's staging table


class LockTimeout(RuntimeError):
    """An attempt waited longer than ``lock_timeout`` for a row another transaction holds.

    Usually that transaction is prepared by another partition of the same epoch writing the same
    key: it commits only once this epoch completes, so waiting longer would never end.
    """


class PostgresSink(TwoPhaseCommitSink):
    """Writes a query's rows into ``table`` exactly once, one prepared transaction per task attempt.

    ``dsn`` is a libpq connection string or URI with ``dbname``, and no password: libpq reads it from
    ``PGPASSWORD`` or a passfile (``PGPASSFILE``, ``~/.pgpass``, ``passfile=``) in each process.
    ``table`` is ``"name"`` or ``"schema.name"``, used exactly as given (quoted). ``columns`` are the
    columns written, taken from each row by name (default: the query's fields). ``mode="upsert"``
    needs ``key``, the columns of a unique index: the last row of a key wins, within an attempt and
    across epochs. ``lock_timeout`` (seconds) bounds a wait on another transaction's rows::

        sink = PostgresSink("host=db dbname=shop user=spark", "public.orders", columns=["id", "total"])
        sink.check_target(pa.schema([("id", pa.int64()), ("total", pa.float64())]))  # before any row
    """

    commit_concurrency = 8  # every commit/abort runs on a connection of its own (kept open: close())
    uses_slots = False  # the gid names the attempt

    def __init__(self, dsn: str, table: str, *, columns: Sequence[str] | None = None, mode: str = "append",
                 key: str | Sequence[str] | None = None, marker_table: str = "twophase_commits",
                 lock_timeout: float = 60.0) -> None:
        self.dsn = _checked_dsn(dsn)
        self.database = conninfo_to_dict(self.dsn)["dbname"]
        self.table = _name("table", table)
        self.marker_table = _name("marker_table", marker_table)
        if mode not in MODES:
            raise ValueError(f"PostgresSink mode={mode!r}: expected one of {', '.join(map(repr, MODES))}")
        self.mode = mode
        self.columns = None if columns is None else _names("columns", columns)
        self.key = None if key is None else _names("key", [key] if isinstance(key, str) else key)
        if (mode == "upsert") != (self.key is not None):
            raise ValueError(f"PostgresSink key={key!r} with mode={mode!r}: key= is required by upsert and "
                             "only by upsert")
        if self.key is not None and self.columns is not None and not set(self.key) <= set(self.columns):
            raise ValueError(f"PostgresSink key={list(self.key)}: every key column must be in columns={self.columns}")
        if not isinstance(lock_timeout, int | float) or lock_timeout <= 0:
            raise ValueError(f"PostgresSink lock_timeout={lock_timeout!r}: expected a positive number of seconds")
        self.lock_timeout = float(lock_timeout)
        # Recognises this sink's gids among all of a server's: same database and table.
        self._tag = _digest(self.database, *self.table)
        self._phase_two = IdleConnections(_connect, keep=self.commit_concurrency)

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "_phase_two"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        # Each copy (a task's, a coordinator's) keeps its own connections; a sink pickled before phase two
        # kept any (stored in ZooKeeper by an earlier version) loads the same way.
        self.__dict__.update(state)
        self._phase_two = IdleConnections(_connect, keep=self.commit_concurrency)

    def __repr__(self) -> str:
        return (f"PostgresSink(dsn={self.dsn!r}, table={'.'.join(self.table)!r}, mode={self.mode!r}"
                + (f", key={list(self.key)!r}" if self.key else "") + ")")

    # -- phase one, in the task -------------------------------------------------
    def begin_transaction(self, ctx: TxnContext) -> PostgresTxn:
        """Name the attempt's transaction; the connection opens with its first rows."""
        return PostgresTxn(ctx, self.gid(ctx))

    def write(self, txn: PostgresTxn, row: Any) -> None:
        """Add one row (a Spark ``Row``, a dict, a :class:`~twophase.sink.Record`), buffered and loaded
        ``ROW_BUFFER`` rows per COPY."""
        txn.buffered.append(self._values(txn, row))
        if len(txn.buffered) >= ROW_BUFFER:
            self._flush_rows(txn)

    def write_batch(self, txn: PostgresTxn, batch: pa.RecordBatch) -> None:
        """Load an Arrow batch with one CSV COPY (after the rows ``write`` buffered before it)."""
        if batch.num_rows == 0:
            return
        names = batch.schema.names
        if self.columns is not None:
            if sorted(names) != sorted(self.columns):
                raise ValueError(f"PostgresSink columns={self.columns}: a batch has the fields {names}")
            batch = batch.select(self.columns)
        self._fix_columns(txn, batch.schema.names)
        self._flush_rows(txn)
        conn = self._connection(txn)
        with self._waits(txn):
            copy_batch(conn.cursor(), self._target(txn), batch)
        txn.rows += batch.num_rows

    def pre_commit(self, txn: PostgresTxn) -> PostgresHandle:
        """Merge (upsert), add the marker row and ``PREPARE TRANSACTION``; close the connection.

        An attempt without rows prepares nothing: its handle's ``gid`` is None.
        """
        ctx = txn.ctx
        self._flush_rows(txn)
        if txn.conn is None:
            return PostgresHandle(self.dsn, None, ctx.app, ctx.query_id, ctx.epoch, 0)
        conn, txn.conn = txn.conn, None
        with conn:
            if txn.stage is not None:
                with self._waits(txn):
                    self._merge(conn, txn)
            try:
                with conn.pipeline():  # one round trip for both: a failed INSERT leaves the PREPARE unrun
                    conn.execute(sql.SQL("INSERT INTO {} (gid, app, query_id, epoch, partition, attempt) "
                                         "VALUES (%s, %s, %s, %s, %s, %s)").format(identifier(self.marker_table)),
                                 (txn.gid, ctx.app, ctx.query_id, ctx.epoch, ctx.partition, ctx.attempt))
                    conn.execute(sql.SQL("PREPARE TRANSACTION {}").format(sql.Literal(txn.gid)))
            except psycopg.errors.UndefinedTable:
                raise RuntimeError(f"PostgresSink marker_table={'.'.join(self.marker_table)!r} does not exist in "
                                   f"database {self.database!r}: check_target creates it before the query writes "
                                   "(write_stream, foreachBatch and TwoPhaseSink call it)") from None
        return PostgresHandle(self.dsn, txn.gid, ctx.app, ctx.query_id, ctx.epoch, txn.rows)

    def abort_transaction(self, txn: PostgresTxn) -> None:
        """Close the attempt's connection: the server rolls its open transaction back. Idempotent."""
        txn.buffered.clear()
        conn, txn.conn = txn.conn, None
        if conn is not None:
            conn.close()

    # -- phase two, in the coordinator -------------------------------------------
    def commit(self, handle: PostgresHandle) -> None:
        """``COMMIT PREPARED``. No such prepared transaction: a no-op if its marker row exists (committed
        before), else CommitFailed (rolled back or lost). Other errors (the server restarting) propagate
        and are retried."""
        outcome = self._finish(handle, "COMMIT")
        if outcome is _Outcome.UNKNOWN:
            raise CommitOutcomeUnknown(self._unknown(handle))
        if outcome is _Outcome.LOST:
            raise CommitFailed(f"prepared transaction {handle.gid!r} ({handle.rows} rows) is gone without a "
                               "marker row: it was rolled back (by hand?) or lost")

    def abort(self, handle: PostgresHandle) -> None:
        """``ROLLBACK PREPARED``; AbortFailed if it was committed (its marker row exists). Idempotent."""
        outcome = self._finish(handle, "ROLLBACK")
        if outcome is _Outcome.UNKNOWN:
            raise RuntimeError(self._unknown(handle))
        if outcome is _Outcome.COMMITTED:
            raise AbortFailed(f"prepared transaction {handle.gid!r} ({handle.rows} rows) was committed already")

    def close(self) -> None:
        """Close the connections phase two kept open."""
        self._phase_two.close()

    def abort_unregistered(self, ctx: TxnContext) -> None:
        """Roll back the dead attempt's prepared transaction, if it prepared one (and nothing else)."""
        gid = self.gid(ctx)
        with self._phase_two.connection(self.dsn) as conn:
            found = conn.execute("SELECT 1 FROM pg_prepared_xacts WHERE gid = %s AND database = current_database()",
                                 (gid,)).fetchone()
            if found:
                try:
                    conn.execute(sql.SQL("ROLLBACK PREPARED {}").format(sql.Literal(gid)))
                except psycopg.errors.UndefinedObject:
                    pass  # finished meanwhile (by another coordinator's cleanup)

    def retire_epoch(self, app: str, query_id: str, epoch: int) -> None:
        """Delete the marker rows of ``query_id``'s epochs up to ``epoch``: never committed again."""
        with self._phase_two.connection(self.dsn) as conn:
            conn.execute(sql.SQL("DELETE FROM {} WHERE app = %s AND query_id = %s AND epoch <= %s")
                         .format(identifier(self.marker_table)), (app, query_id, epoch))

    def prepared_transactions(self, older_than: float) -> list[PreparedTransaction]:
        """The server's prepared transactions (every database) older than ``older_than`` seconds;
        ``attempt`` is set on this sink's (same database and table)."""
        with _connect(self.dsn, "status") as conn:
            rows = conn.execute("SELECT gid, database, extract(epoch FROM now() - prepared)::float8 "
                                "FROM pg_prepared_xacts WHERE prepared < now() - make_interval(secs => %s)",
                                (older_than,)).fetchall()
        ours = f"{GID_PREFIX}:{self._tag}:"
        return [PreparedTransaction(gid, age, gid.split(":", 3)[3] if gid.startswith(ours) else None,
                                    f"database {database}") for gid, database, age in rows]

    # -- on the driver ------------------------------------------------------------
    def check_target(self, schema: pa.Schema | None) -> None:
        """Check the server (max_prepared_transactions), the table, its columns' types and upsert's
        unique index; create the marker table if it is missing. ValueError naming what is wrong."""
        with _connect(self.dsn, "check_target") as conn:
            conn.execute(f"SET lock_timeout = {int(self.lock_timeout * 1000)}")  # never hang the query's start
            prepared = int(conn.execute("SHOW max_prepared_transactions").fetchone()[0])
            if prepared <= 0:
                raise ValueError(f"PostgreSQL at {self.dsn!r} has max_prepared_transactions = 0, so PREPARE "
                                 "TRANSACTION is refused: set it in postgresql.conf (at least the number of task "
                                 "attempts that can hold a prepared transaction at once, e.g. 64) and restart it")
            table = describe_table(conn, self.table)
            written = check_columns(table, schema, self.columns)
            if self.key is not None:
                self._check_key(conn, table, written)
            self._create_markers(conn)

    def gid(self, ctx: TxnContext) -> str:
        """The global id of ``ctx``'s prepared transaction: ``tp1:<sink>:<query>:<ctx.name>``."""
        gid = f"{GID_PREFIX}:{self._tag}:{_digest(ctx.app, ctx.query_id)}:{ctx.name}"
        if len(gid.encode()) > MAX_GID_BYTES:
            raise ValueError(f"the global id {gid!r} is over PostgreSQL's {MAX_GID_BYTES} bytes: run id "
                             f"{ctx.run_id!r} is too long")
        return gid

    # -- internals ----------------------------------------------------------------
    def _connection(self, txn: PostgresTxn) -> psycopg.Connection:
        """The attempt's connection, in its open transaction (upsert: with its staging table)."""
        if txn.conn is None:
            conn = _connect(self.dsn, txn.ctx.name)
            try:
                # UTC: timestamps without a zone are UTC wall time, whatever the server's TimeZone.
                conn.execute(f"SET TimeZone = 'UTC'; SET lock_timeout = {int(self.lock_timeout * 1000)}; BEGIN")
                if self.mode == "upsert":
                    txn.stage = self._create_stage(conn, txn)
            except BaseException:
                conn.close()
                raise
            txn.conn = conn
        return txn.conn

    def _create_stage(self, conn: psycopg.Connection, txn: PostgresTxn) -> sql.Identifier:
        # Not TEMPORARY: PostgreSQL refuses to PREPARE a transaction that touched a temporary table.
        # Created and dropped in the attempt's transaction, so nobody else ever sees it.
        stage = sql.Identifier(*self.table[:-1], f"_twophase_stage_{_digest(txn.gid)}")
        names = sql.SQL(", ").join(map(sql.Identifier, txn.columns))
        conn.execute(sql.SQL("CREATE UNLOGGED TABLE {} AS SELECT {} FROM {} WITH NO DATA")
                     .format(stage, names, identifier(self.table)))
        conn.execute(sql.SQL("ALTER TABLE {} ADD COLUMN {} bigint GENERATED ALWAYS AS IDENTITY")
                     .format(stage, sql.Identifier(_SEQ)))
        return stage

    def _merge(self, conn: psycopg.Connection, txn: PostgresTxn) -> None:
        """Move the staged rows into the table, the last of each key winning, and drop the stage."""
        names = sql.SQL(", ").join(map(sql.Identifier, txn.columns))
        key = sql.SQL(", ").join(map(sql.Identifier, self.key))
        others = [c for c in txn.columns if c not in self.key]
        action = (sql.SQL("DO UPDATE SET ") + sql.SQL(", ").join(
            sql.SQL("{0} = EXCLUDED.{0}").format(sql.Identifier(c)) for c in others)) if others \
            else sql.SQL("DO NOTHING")
        conn.execute(sql.SQL("INSERT INTO {table} ({names}) SELECT DISTINCT ON ({key}) {names} FROM {stage} "
                             "ORDER BY {key}, {seq} DESC ON CONFLICT ({key}) {action}").format(
            table=identifier(self.table), names=names, key=key, stage=txn.stage, seq=sql.Identifier(_SEQ),
            action=action))
        conn.execute(sql.SQL("DROP TABLE {}").format(txn.stage))

    def _target(self, txn: PostgresTxn) -> sql.Identifier:
        return txn.stage if txn.stage is not None else identifier(self.table)

    def _fix_columns(self, txn: PostgresTxn, names: Sequence[str]) -> None:
        if txn.columns is None:
            if self.key is not None and not set(self.key) <= set(names):
                raise ValueError(f"PostgresSink key={self.key}: rows with the columns {list(names)} lack a key column")
            txn.columns = list(names)
        elif txn.columns != list(names):
            raise ValueError(f"PostgresSink: rows with the columns {list(names)} after rows with {txn.columns}; "
                             "one attempt writes one set of columns")

    def _values(self, txn: PostgresTxn, row: Any) -> Sequence[Any]:
        """The row's values in the attempt's column order."""
        if txn.columns is None:
            self._fix_columns(txn, self.columns or list(_as_dict(row)))
        if getattr(row, "__fields__", None) == txn.columns:
            return row  # a Spark Row (a tuple) with exactly these fields, in this order
        record = _as_dict(row)
        if len(record) != len(txn.columns) or not all(c in record for c in txn.columns):
            raise ValueError(f"PostgresSink: a row with the fields {list(record)} among rows written to the columns "
                             f"{txn.columns}; every row must have exactly these")
        return [record[c] for c in txn.columns]

    def _flush_rows(self, txn: PostgresTxn) -> None:
        if not txn.buffered:
            return
        rows, txn.buffered = txn.buffered, []
        conn = self._connection(txn)
        with self._waits(txn), conn.cursor().copy(copy_statement(self._target(txn), txn.columns, csv=False)) as copy:
            for row in rows:
                copy.write_row(row)
        txn.rows += len(rows)

    @contextmanager
    def _waits(self, txn: PostgresTxn) -> Iterator[None]:
        """Turn a lock wait past ``lock_timeout`` into a LockTimeout that says what to do."""
        try:
            yield
        except psycopg.errors.LockNotAvailable as e:
            why = ("rows of one key in two partitions of an epoch wait for each other's prepared transaction, "
                   f"which commits only after the epoch: partition the rows by key ({self.key and list(self.key)}) "
                   "before the sink, e.g. df.repartition(*key)") if self.key else (
                   "another transaction holds a row this attempt writes (a unique index: the same key in two "
                   "partitions of an epoch waits for the other's prepared transaction); partition the rows by "
                   "that key, or raise lock_timeout if the holder is just slow")
            raise LockTimeout(f"attempt {txn.ctx.name} waited over lock_timeout={self.lock_timeout}s on "
                              f"{'.'.join(self.table)}: {why} ({e})") from e

    def _check_key(self, conn: psycopg.Connection, table: Table, written: list[str]) -> None:
        key = list(self.key)
        missing = [k for k in key if k not in table.columns or written and k not in written]
        if missing:
            raise ValueError(f"PostgresSink key={key}: column {missing[0]!r} is not written to {table.name}"
                             f" (written: {written or list(table.columns)})")
        if frozenset(key) not in unique_keys(conn, table):
            raise ValueError(f"PostgresSink key={key}: {table.name} has no unique index or constraint on exactly "
                             f"these columns, which upsert's ON CONFLICT needs: ALTER TABLE {table.name} ADD "
                             f"UNIQUE ({', '.join(key)})")

    def _create_markers(self, conn: psycopg.Connection) -> None:
        """Create the marker table and its index unless they exist.

        CREATE TABLE IF NOT EXISTS is not safe against a concurrent creator (two queries starting at
        once): an advisory lock makes the second wait and find the table. Existing ones are looked up
        first, because CREATE INDEX IF NOT EXISTS locks the table before it finds the index, and would
        wait for every prepared transaction holding a marker row (a restarted query's)."""
        table = identifier(self.marker_table)
        index = f"{self.marker_table[-1][:50]}_epochs"  # created in the table's schema
        exists = "SELECT to_regclass(%s) IS NOT NULL AND to_regclass(%s) IS NOT NULL"
        names = (table.as_string(conn), identifier((*self.marker_table[:-1], index)).as_string(conn))
        if conn.execute(exists, names).fetchone()[0]:
            return
        with conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", (f"twophase {'.'.join(self.marker_table)}",))
            if conn.execute(exists, names).fetchone()[0]:
                return  # a concurrent creator made them
            conn.execute(sql.SQL(
                "CREATE TABLE IF NOT EXISTS {} (gid text PRIMARY KEY, app text NOT NULL, query_id text NOT NULL, "
                "epoch bigint NOT NULL, partition integer NOT NULL, attempt integer NOT NULL, "
                "committed_at timestamptz NOT NULL DEFAULT now())").format(table))
            conn.execute(sql.SQL("CREATE INDEX IF NOT EXISTS {} ON {} (app, query_id, epoch)")
                         .format(sql.Identifier(index), table))

    def _finish(self, handle: PostgresHandle, verb: str) -> _Outcome:
        """``<verb> PREPARED`` the handle's transaction; if there is no such prepared transaction, its
        marker row tells what became of it."""
        if handle.gid is None:
            return _Outcome.DONE
        with self._phase_two.connection(handle.dsn) as conn:
            try:
                conn.execute(sql.SQL(verb + " PREPARED {}").format(sql.Literal(handle.gid)))
                return _Outcome.DONE
            except psycopg.errors.UndefinedObject:
                pass
            try:
                marked = conn.execute(sql.SQL("SELECT 1 FROM {} WHERE gid = %s").format(
                    identifier(self.marker_table)), (handle.gid,)).fetchone()
            except psycopg.errors.UndefinedTable:
                return _Outcome.UNKNOWN
        return _Outcome.LOST if marked is None else _Outcome.COMMITTED

    def _unknown(self, handle: PostgresHandle) -> str:
        return (f"prepared transaction {handle.gid!r} is gone and the marker table "
                f"{'.'.join(self.marker_table)!r} too: cannot tell whether it committed")


class _Outcome(Enum):
    """What ``_finish`` found."""

    DONE = "done"            # COMMIT/ROLLBACK PREPARED did it now (or there was nothing to do)
    COMMITTED = "committed"  # no such prepared transaction; its marker row exists
    LOST = "lost"            # no such prepared transaction, no marker row: rolled back or lost
    UNKNOWN = "unknown"      # no such prepared transaction, and no marker table to ask


def _connect(dsn: str, purpose: str = "phase two") -> psycopg.Connection:
    given = conninfo_to_dict(dsn)
    extra = {} if "application_name" in given else {"application_name": f"twophase {purpose}"}
    if "connect_timeout" not in given:
        extra["connect_timeout"] = CONNECT_TIMEOUT  # a server that drops packets fails the call, not hangs it
    return psycopg.connect(dsn, autocommit=True, **extra)


def _as_dict(row: Any) -> dict[str, Any]:
    if hasattr(row, "asDict"):
        return row.asDict()
    if isinstance(row, dict):
        return row
    raise TypeError(f"PostgresSink cannot write a {type(row).__name__}: pass a Spark Row or a dict")


def _digest(*parts: str) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:8]


def _checked_dsn(dsn: str) -> str:
    """The dsn, refused if it holds a password (it would be stored in ZooKeeper) or no dbname."""
    try:
        params = conninfo_to_dict(dsn)
    except psycopg.ProgrammingError as e:
        detail = "" if "password" in dsn.lower() else f": {e}"  # libpq may quote part of the string
        raise ValueError(f"PostgresSink dsn is not a libpq connection string (key=value pairs or a "
                         f"postgresql:// URI){detail}") from None
    secret = [k for k in _SECRETS if k in params]
    if secret:
        raise ValueError(f"PostgresSink dsn holds a {secret[0]}: the sink is stored in ZooKeeper and sent to every "
                         "executor, so it keeps no secret. Leave it out and give it to libpq in each process: "
                         "PGPASSWORD, or a passfile (PGPASSFILE, ~/.pgpass, or passfile=... in the dsn)")
    if not params.get("dbname"):
        raise ValueError("PostgresSink dsn names no dbname=: every process (executors, the coordinator) must reach "
                         "the same database, whatever its PGDATABASE says")
    return make_conninfo(**params)


def _name(setting: str, name: str) -> tuple[str, ...]:
    parts = tuple(name.split(".")) if isinstance(name, str) else ()
    if not 1 <= len(parts) <= 2 or not all(parts) or any(len(p.encode()) > 63 for p in parts):
        raise ValueError(f"PostgresSink {setting}={name!r}: expected 'name' or 'schema.name' (at most 63 bytes each)")
    return parts


def _names(setting: str, names: Sequence[str]) -> list[str]:
    names = list(names)
    if not names or not all(isinstance(n, str) and n for n in names) or len(set(names)) < len(names):
        raise ValueError(f"PostgresSink {setting}={names!r}: expected distinct, non-empty column names")
    return names
