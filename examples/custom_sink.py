"""A user-written exactly-once sink: SQLite with the "staging table" pattern.

pre_commit commits a transaction's rows into ``staging``, where they are
durable but invisible to readers of ``rows``. commit moves them into ``rows``
and records the transaction id in ``committed``, all in one SQLite
transaction, so a repeated commit finds the id already recorded and does
nothing. abort deletes the staged rows.

Usage::

    from examples.custom_sink import SqliteSink
    from twophase.spark import TwoPhaseSink

    (df.writeStream
       .foreach(TwoPhaseSink(SqliteSink("/tmp/out.db"), app="orders", zk="127.0.0.1:2181"))
       .option("checkpointLocation", "/tmp/orders-checkpoint")
       .start())

    # readers only ever see committed rows:
    sqlite3.connect("/tmp/out.db").execute("SELECT data FROM rows")
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from twophase.sink import TwoPhaseCommitSink, TxnContext

SCHEMA = """
CREATE TABLE IF NOT EXISTS staging(txn TEXT, row TEXT);
CREATE INDEX IF NOT EXISTS staging_txn ON staging(txn);
CREATE TABLE IF NOT EXISTS rows(data TEXT);
CREATE TABLE IF NOT EXISTS committed(txn TEXT PRIMARY KEY);
"""


@dataclass
class SqliteTxn:
    """One attempt's rows, buffered in memory until pre_commit stages them."""

    ctx: TxnContext
    rows: list[str] = field(default_factory=list)


class SqliteSink(TwoPhaseCommitSink):
    """Stores each row as JSON text in ``rows(data)`` of a SQLite database file."""

    def __init__(self, path: str) -> None:
        self.path = os.path.abspath(path)

    @contextlib.contextmanager
    def _db(self) -> Iterator[sqlite3.Connection]:
        """One short SQLite transaction on a connection of its own, closed after (any thread may call)."""
        with contextlib.closing(sqlite3.connect(self.path, timeout=30)) as conn:
            conn.executescript(SCHEMA)
            with conn:  # commits, or rolls back on an exception
                yield conn

    def begin_transaction(self, ctx: TxnContext) -> SqliteTxn:
        """Start an in-memory buffer for one task attempt."""
        return SqliteTxn(ctx)

    def write(self, txn: SqliteTxn, row: Any) -> None:
        """Buffer one row, as JSON, in memory."""
        data = row.asDict(recursive=True) if hasattr(row, "asDict") else row
        txn.rows.append(json.dumps(data, default=str))

    def pre_commit(self, txn: SqliteTxn) -> str:
        """Stage the buffered rows under the attempt's name in one SQLite transaction; return that name."""
        # Rows are buffered and staged in one short transaction because SQLite
        # has a single writer: holding it for a whole task would block the others.
        with self._db() as db:
            db.executemany(
                "INSERT INTO staging(txn, row) VALUES (?, ?)",
                ((txn.ctx.name, row) for row in txn.rows),
            )
        return txn.ctx.name

    def commit(self, handle: str) -> None:
        """Move the staged rows of ``handle`` into ``rows``, once.

        The ``committed`` table records the handle in the same SQLite transaction,
        so a second call finds it there and does nothing.
        """
        with self._db() as db:
            if db.execute("INSERT OR IGNORE INTO committed(txn) VALUES (?)", (handle,)).rowcount:
                db.execute("INSERT INTO rows(data) SELECT row FROM staging WHERE txn = ?", (handle,))
                db.execute("DELETE FROM staging WHERE txn = ?", (handle,))

    def abort(self, handle: str) -> None:
        """Delete the staged rows of ``handle``; a second call is a no-op."""
        with self._db() as db:
            db.execute("DELETE FROM staging WHERE txn = ?", (handle,))

    def abort_transaction(self, txn: SqliteTxn) -> None:
        """Drop the rows buffered in memory: nothing was staged yet."""
        txn.rows.clear()  # buffered in memory until pre_commit: nothing staged yet
