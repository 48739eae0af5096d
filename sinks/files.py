"""Exactly-once JSON-lines files: a TwoPhaseCommitSink over a POSIX directory.

Each task attempt streams its rows into ``<path>/_staging/<ctx.name>.jsonl``;
pre_commit fsyncs it and renames it to ``<path>/_pending/``; commit renames it
to a ``part-*.jsonl`` file in ``<path>`` itself. Names starting with ``_`` or
``.`` are invisible to readers by convention, so a reader that lists ``<path>``
and reads only ``*.jsonl`` (as :func:`read_committed_rows` does) sees committed
data only. Renames within one file system are atomic, which is the whole trick.

Usage::

    from sinks.files import FileSink, read_committed_rows
    from twophase.spark import TwoPhaseSink

    sink = FileSink("/data/orders")
    (df.writeStream
       .foreach(TwoPhaseSink(sink, app="orders", zk="127.0.0.1:2181"))
       .option("checkpointLocation", "/data/orders-checkpoint")
       .start())

    rows = read_committed_rows("/data/orders")   # list of dicts
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Callable

from twophase.durable import fsync_dir
from twophase.sink import CommitFailed, TwoPhaseCommitSink, TxnContext


@dataclass(frozen=True)
class FileHandle:
    """A pre-committed file: everything commit/abort need, in any process."""

    pending: str
    final: str
    rows: int


@dataclass
class FileTxn:
    """One attempt's open transaction: its staging file, written row by row."""

    ctx: TxnContext
    file: IO[str]
    rows: int = 0


def _default_serializer(row: Any) -> dict:
    if hasattr(row, "asDict"):
        return row.asDict(recursive=True)
    if isinstance(row, dict):
        return row
    raise TypeError(f"cannot serialize {type(row).__name__}; pass serializer=")


class FileSink(TwoPhaseCommitSink):
    """Writes rows as JSON lines, one ``part-*.jsonl`` file per committed task."""

    commit_concurrency = 8  # each commit renames its own file: independent and thread-safe

    def __init__(
        self,
        path: str,
        fsync: bool = True,
        serializer: Callable[[Any], dict] | None = None,
    ) -> None:
        # Absolute, because commit may run in another process with another cwd.
        self.path = os.path.abspath(path)
        self.fsync = fsync
        self.serializer = serializer or _default_serializer

    def begin_transaction(self, ctx: TxnContext) -> FileTxn:
        """Open ``_staging/<ctx.name>.jsonl`` for writing."""
        staging = os.path.join(self.path, "_staging")
        os.makedirs(staging, exist_ok=True)
        file = open(os.path.join(staging, f"{ctx.name}.jsonl"), "w", encoding="utf-8")
        return FileTxn(ctx, file)

    def write(self, txn: FileTxn, row: Any) -> None:
        """Append one row to the staging file as a JSON line."""
        txn.file.write(json.dumps(self.serializer(row), default=str, separators=(",", ":")))
        txn.file.write("\n")
        txn.rows += 1

    def pre_commit(self, txn: FileTxn) -> FileHandle:
        """Flush (and fsync) the staging file and rename it into ``_pending/``; return its handle.

        An empty transaction leaves no file: its handle has ``rows == 0``, and
        commit and abort do nothing with it.
        """
        ctx = txn.ctx
        pending_dir = os.path.join(self.path, "_pending")
        handle = FileHandle(
            pending=os.path.join(pending_dir, f"{ctx.name}.jsonl"),
            final=os.path.join(
                self.path,
                f"part-{ctx.epoch:08d}-{ctx.partition:05d}-{ctx.run_id}-{ctx.attempt}.jsonl",
            ),
            rows=txn.rows,
        )
        if txn.rows == 0:
            self._discard(txn)
            return handle
        txn.file.flush()
        if self.fsync:
            os.fsync(txn.file.fileno())
        txn.file.close()
        os.makedirs(pending_dir, exist_ok=True)
        os.rename(txn.file.name, handle.pending)
        if self.fsync:
            fsync_dir(pending_dir)
        return handle

    def commit(self, handle: FileHandle) -> None:
        """Rename the pending file to its final ``part-*.jsonl`` name. Idempotent.

        Raises CommitFailed if neither the pending nor the final file exists.
        """
        if handle.rows == 0:
            return
        try:
            os.rename(handle.pending, handle.final)
        except FileNotFoundError:
            if os.path.exists(handle.final):
                return  # committed before
            raise CommitFailed(
                f"neither {handle.pending} nor {handle.final} exists: "
                f"the {handle.rows} pre-committed rows are lost"
            ) from None
        if self.fsync:
            fsync_dir(self.path)

    def abort(self, handle: FileHandle) -> None:
        """Delete the pending file, if there is one. Idempotent."""
        if handle.rows:
            Path(handle.pending).unlink(missing_ok=True)

    def abort_transaction(self, txn: FileTxn) -> None:
        """Close and delete the staging file of a transaction that never reached pre_commit."""
        self._discard(txn)

    def abort_unregistered(self, ctx: TxnContext) -> None:
        """Delete whatever staging or pending file the attempt ``ctx`` left behind."""
        # What a task killed before registering can have left: its staging or pending file.
        for folder in ("_staging", "_pending"):
            Path(self.path, folder, f"{ctx.name}.jsonl").unlink(missing_ok=True)

    @staticmethod
    def _discard(txn: FileTxn) -> None:
        txn.file.close()
        Path(txn.file.name).unlink(missing_ok=True)


def read_committed_rows(path: str) -> list[dict]:
    """All committed rows under ``path``, skipping invisible (``_``/``.``) names."""
    if not os.path.isdir(path):
        return []
    rows = []
    for name in sorted(os.listdir(path)):
        if name.startswith(("_", ".")) or not name.endswith(".jsonl"):
            continue
        with open(os.path.join(path, name), encoding="utf-8") as f:
            rows.extend(json.loads(line) for line in f if line.strip())
    return rows
