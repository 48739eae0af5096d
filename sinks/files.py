"""Exactly-once files, JSON lines or Parquet: a TwoPhaseCommitSink over a POSIX directory.

Each task attempt streams its rows into ``<path>/_staging/<ctx.name>.<ext>``;
pre_commit fsyncs it and renames it to ``<path>/_pending/``; commit renames it
to a ``part-*.<ext>`` file in ``<path>`` itself. Names starting with ``_`` or
``.`` are invisible to readers by convention (Spark's file sources skip them), so
a reader of ``<path>`` (:func:`read_committed_rows`, ``spark.read.parquet``) sees
committed data only. Renames within one file system are atomic, which is the whole
trick. See docs/file-sink.md.

Usage::

    from sinks.files import FileSink, read_committed_rows
    from twophase.spark import TwoPhaseSink

    sink = FileSink("/data/orders", format="parquet")
    (df.writeStream
       .foreach(TwoPhaseSink(sink, app="orders", zk="127.0.0.1:2181"))
       .option("checkpointLocation", "/data/orders-checkpoint")
       .start())

    rows = read_committed_rows("/data/orders")   # list of dicts
    spark.read.parquet("/data/orders")           # the same rows, in Spark
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from itertools import repeat
from json.encoder import encode_basestring_ascii
from pathlib import Path
from typing import IO, Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from twophase.durable import fsync_dir
from twophase.sink import CommitFailed, TwoPhaseCommitSink, TxnContext

# The file name suffix of each format.
SUFFIXES = {"jsonl": ".jsonl", "parquet": ".parquet"}

# A JSON line is json.dumps(row, default=str, separators=(",", ":")); one encoder object spares
# json.dumps building a new one per row.
_encode = json.JSONEncoder(default=str, separators=(",", ":")).encode

ROW_GROUP_SIZE = 64 * 1024  # rows; Spark's Arrow batches are 10,000


@dataclass(frozen=True)
class FileHandle:
    """A pre-committed file: everything commit/abort need, in any process.

    The format is in the names (``.jsonl``/``.parquet``), so a handle pickled before Parquet
    existed still commits::

        FileHandle("/data/_pending/r1.7.3.0.parquet", "/data/part-00000007-00003-r1-0.parquet", 10)
    """

    pending: str
    final: str
    rows: int


@dataclass
class FileTxn:
    """One attempt's open transaction: its staging file (text for JSON lines, binary for Parquet)."""

    ctx: TxnContext
    file: IO[Any]
    rows: int = 0
    parquet: _ParquetStaging | None = None


def directory_path(path: str, sink: str) -> str:
    """``path`` made absolute (commit runs in another process, with another cwd); ValueError for a URL,
    which ``os`` would take for a relative local path (``s3a://b/out`` as ``./s3a:/b/out``)."""
    if re.match(r"^[A-Za-z][A-Za-z0-9+.-]*:", path):
        raise ValueError(f"{sink} path={path!r}: a POSIX directory (local, or mounted on every executor and "
                         "coordinator host), not a URL: commit renames files with the os module")
    return os.path.abspath(path)


def _default_serializer(row: Any) -> dict:
    if hasattr(row, "asDict"):
        return row.asDict(recursive=True)
    if isinstance(row, dict):
        return row
    raise TypeError(f"cannot serialize {type(row).__name__}; pass serializer=")


class FileSink(TwoPhaseCommitSink):
    """Writes rows as JSON lines or Parquet, one ``part-*`` file per committed task attempt.

    ``format`` is ``"jsonl"`` (the default, what earlier versions wrote) or ``"parquet"``.
    For Parquet, ``schema`` (a ``pyarrow.Schema``) fixes the files' schema; without it, the first
    batch's schema is used, or the one pyarrow infers from the first rows written with ``write``.
    Rows and batches are buffered into row groups of ``row_group_size`` rows::

        FileSink("/data/orders", format="parquet", schema=pa.schema([("id", pa.int64())]))
    """

    commit_concurrency = 8  # each commit renames its own file: independent and thread-safe
    uses_slots = False  # files are named by attempt
    # Class defaults: a FileSink pickled (and stored in ZooKeeper) by an earlier version lacks these.
    format = "jsonl"
    schema: pa.Schema | None = None
    row_group_size = ROW_GROUP_SIZE

    def __init__(
        self,
        path: str,
        fsync: bool = True,
        serializer: Callable[[Any], dict] | None = None,
        format: str = "jsonl",
        schema: pa.Schema | None = None,
        row_group_size: int = ROW_GROUP_SIZE,
    ) -> None:
        if format not in SUFFIXES:
            raise ValueError(f"FileSink format={format!r}: expected one of {', '.join(map(repr, SUFFIXES))}")
        if schema is not None and (format != "parquet" or not isinstance(schema, pa.Schema)):
            raise ValueError(f"FileSink schema= is a pyarrow.Schema for format='parquet'; got {type(schema).__name__} "
                             f"with format={format!r}")
        if not isinstance(row_group_size, int) or row_group_size < 1:
            raise ValueError(f"FileSink row_group_size={row_group_size!r}: expected a positive number of rows")
        self.path = directory_path(path, "FileSink")
        self.fsync = fsync
        self.serializer = serializer or _default_serializer
        self.format = format
        self.schema = schema
        self.row_group_size = row_group_size

    def begin_transaction(self, ctx: TxnContext) -> FileTxn:
        """Open ``_staging/<ctx.name>.<ext>`` for writing."""
        staging = os.path.join(self.path, "_staging")
        os.makedirs(staging, exist_ok=True)
        name = os.path.join(staging, ctx.name + SUFFIXES[self.format])
        if self.format == "parquet":
            file = open(name, "wb")
            return FileTxn(ctx, file, parquet=_ParquetStaging(file, self.schema, self.row_group_size))
        return FileTxn(ctx, open(name, "w", encoding="utf-8"))

    def write(self, txn: FileTxn, row: Any) -> None:
        """Add one row (a Spark ``Row``, a dict, or what ``serializer`` takes).

        JSON lines write it at once. Parquet buffers the serialized dict until its row group is
        written, so a caller must not change a dict after handing it over.
        """
        record = self.serializer(row)
        if txn.parquet is None:
            txn.file.write(_encode(record) + "\n")
        else:
            txn.parquet.add_row(record)
        txn.rows += 1

    def write_batch(self, txn: FileTxn, batch: pa.RecordBatch) -> None:
        """Add an Arrow batch: Parquet writes it as it is, JSON lines column by column.

        Each JSON line is what :meth:`write` writes for the batch's row as a dict. With a custom
        ``serializer``, every row goes through :meth:`write`, as on the row path.
        """
        if self.serializer is not _default_serializer:
            super().write_batch(txn, batch)  # the serializer sees every row, as it does on the row path
            return
        if txn.parquet is not None:
            txn.parquet.add_batch(batch)
        elif batch.num_rows:
            txn.file.write(_json_lines(batch))
        txn.rows += batch.num_rows

    def pre_commit(self, txn: FileTxn) -> FileHandle:
        """Finish, flush (and fsync) the staging file and rename it into ``_pending/``; return its handle.

        An empty transaction leaves no file: its handle has ``rows == 0``, and
        commit and abort do nothing with it.
        """
        ctx = txn.ctx
        suffix = SUFFIXES[self.format]
        pending_dir = os.path.join(self.path, "_pending")
        handle = FileHandle(
            pending=os.path.join(pending_dir, ctx.name + suffix),
            final=os.path.join(
                self.path,
                f"part-{ctx.epoch:08d}-{ctx.partition:05d}-{ctx.run_id}-{ctx.attempt}{suffix}",
            ),
            rows=txn.rows,
        )
        if txn.rows == 0:
            self._discard(txn)
            return handle
        if txn.parquet is not None:
            txn.parquet.close()  # the last row group and the footer
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
        """Rename the pending file to its final ``part-*`` name. Idempotent.

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
        # What a task killed before registering can have left: its staging or pending file, in
        # either format (the sink's format may have changed since the attempt ran).
        for folder in ("_staging", "_pending"):
            for suffix in SUFFIXES.values():
                Path(self.path, folder, ctx.name + suffix).unlink(missing_ok=True)

    @staticmethod
    def _discard(txn: FileTxn) -> None:
        try:
            if txn.parquet is not None:
                txn.parquet.abandon()
        finally:
            txn.file.close()
            Path(txn.file.name).unlink(missing_ok=True)


class _ParquetStaging:
    """The Parquet writer of one staging file: rows (from ``write``) and batches are buffered and
    written as row groups of ``row_group_size`` rows, in the order they came. The file's schema is
    ``schema``, else the first batch's, else the one inferred from the first rows."""

    def __init__(self, file: IO[bytes], schema: pa.Schema | None, row_group_size: int) -> None:
        self.file = file
        self.schema = schema
        self.row_group_size = row_group_size
        self.rows: list[dict] = []
        self.batches: list[pa.RecordBatch] = []
        self.buffered = 0
        self.writer: pq.ParquetWriter | None = None  # opened with the first row group

    def add_row(self, row: dict) -> None:
        self.rows.append(row)
        self._added(1)

    def add_batch(self, batch: pa.RecordBatch) -> None:
        self._rows_to_batch()  # rows written before this batch go before it
        self._take(batch, "a batch")
        self._added(batch.num_rows)

    def close(self) -> None:
        """Write what is buffered and the file's footer."""
        self._flush()
        if self.writer is not None:
            self.writer.close()

    def abandon(self) -> None:
        """Drop what is buffered and close the writer (the file is being deleted). Idempotent."""
        self.rows.clear()
        self.batches.clear()
        if self.writer is not None:
            self.writer.close()

    def _added(self, rows: int) -> None:
        self.buffered += rows
        if self.buffered >= self.row_group_size:
            self._flush()

    def _flush(self) -> None:
        self._rows_to_batch()
        if not self.batches:
            return
        if self.writer is None:
            # Microseconds: Spark reads no nanosecond timestamps; a value that would lose digits raises.
            self.writer = pq.ParquetWriter(self.file, self.schema, coerce_timestamps="us")
        self.writer.write_table(pa.Table.from_batches(self.batches), row_group_size=self.row_group_size)
        self.batches.clear()
        self.buffered = 0

    def _rows_to_batch(self) -> None:
        if not self.rows:
            return
        rows, self.rows = self.rows, []
        if self.schema is not None:
            # from_pylist drops keys the schema has not: refuse them instead of losing their values.
            unknown = set().union(*rows).difference(self.schema.names)
            if unknown:
                raise ValueError(f"{self.file.name}: rows have columns {sorted(unknown)} that the file's schema "
                                 f"has not (the schema= given or the first rows'):\n{self.schema}")
        try:
            # Without a schema, a struct array infers the columns of every row (from_pylist: the first's).
            batch = (pa.RecordBatch.from_struct_array(pa.array(rows)) if self.schema is None
                     else pa.RecordBatch.from_pylist(rows, schema=self.schema))
        except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
            raise ValueError(f"{self.file.name}: rows do not fit one Parquet schema (the schema= given or the "
                             f"first rows'; pass FileSink(schema=...) to fix it): {e}") from e
        self._take(batch, "rows")

    def _take(self, batch: pa.RecordBatch, what: str) -> None:
        if self.schema is None:
            self.schema = batch.schema
        elif not batch.schema.equals(self.schema, check_metadata=False):
            raise ValueError(f"{self.file.name}: {what} with another schema than the file's; one file has one "
                             f"schema.\n{what}:\n{batch.schema}\nfile:\n{self.schema}")
        self.batches.append(batch)


def _json_lines(batch: pa.RecordBatch) -> str:
    """The JSON lines :meth:`FileSink.write` writes for each row of ``batch``, built column by column."""
    names = batch.schema.names
    if len(set(names)) < len(names):
        # A row dict keeps one of the columns of a name; so does write: go row by row.
        return "".join(_encode(row) + "\n" for row in batch.to_pylist())
    line = "{" + ",".join(_encode(name).replace("%", "%%") + ":%s" for name in names) + "}\n"
    columns = [_json_values(column) for column in batch.columns]
    return "".join(map(line.__mod__, zip(*columns) if columns else repeat((), batch.num_rows)))


# Arrow spells these as json does (integers, true/false); a null is "null" either way.
_CAST = {pa.bool_(), pa.null()}
_FLOATS = {pa.float32(), pa.float64()}
_STRINGS = {pa.string(), pa.large_string()}
# Types whose to_pylist values (datetime, date, time, timedelta, Decimal, bytes) json cannot encode,
# so write's default=str quotes their str().
_STR_TYPES = (pa.types.is_timestamp, pa.types.is_date, pa.types.is_time, pa.types.is_duration, pa.types.is_decimal,
              pa.types.is_binary, pa.types.is_large_binary, pa.types.is_fixed_size_binary)


def _json_values(column: pa.Array) -> list[str]:
    """The JSON text of each value of ``column``, exactly as :func:`_encode` writes it inside a row."""
    kind = column.type
    if pa.types.is_integer(kind) or kind in _CAST:
        return pc.fill_null(column.cast(pa.string()), "null").to_pylist()
    if pa.types.is_timestamp(kind) and kind.unit == "us" and kind.tz in (None, "UTC"):
        # Spark's timestamps (UTC, or none for TIMESTAMP_NTZ), spelled by Arrow's casts as str(datetime)
        # spells them (a fraction only when it is not zero): ~0.3 us a value; datetime objects cost 4 us.
        wall = column.cast(pa.timestamp("us"))  # the same instants, UTC wall time without the zone
        text = pc.binary_join_element_wise(wall.cast(pa.date32()).cast(pa.string()),
                                           wall.cast(pa.time64("us")).cast(pa.string()), " ")
        text = pc.replace_substring_regex(text, r"\.000000$", "")
        quoted = pc.binary_join_element_wise('"', text, '+00:00"' if kind.tz else '"', "")
        return pc.fill_null(quoted, "null").to_pylist()
    values = column.to_pylist()
    if kind in _FLOATS:
        # One json call for the column (repr, NaN, Infinity, null); none of them holds a comma.
        return _encode(values)[1:-1].split(",") if values else []
    if kind in _STRINGS:
        return ["null" if v is None else encode_basestring_ascii(v) for v in values]
    if any(test(kind) for test in _STR_TYPES):
        return ["null" if v is None else encode_basestring_ascii(str(v)) for v in values]
    return list(map(_encode, values))  # nested and anything else: one value at a time


def read_committed_rows(path: str) -> list[dict]:
    """All committed rows under ``path`` (``*.jsonl`` and ``*.parquet``), skipping invisible (``_``/``.``) names."""
    if not os.path.isdir(path):
        return []
    rows = []
    for name in sorted(os.listdir(path)):
        if name.startswith(("_", ".")):
            continue
        file = os.path.join(path, name)
        if name.endswith(".jsonl"):
            with open(file, encoding="utf-8") as f:
                rows.extend(json.loads(line) for line in f if line.strip())
        elif name.endswith(".parquet"):
            rows.extend(pq.read_table(file).to_pylist())
    return rows
