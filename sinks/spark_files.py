"""Files written by Spark's own writer (Parquet, JSON, CSV, ORC, text), exactly once, into one directory.

A ``foreachBatch`` target (:class:`twophase.spark.TwoPhaseBatchSink`): the micro-batch's DataFrame is
written by Spark's JVM file writer, the code behind Spark's own file sink, so no row crosses into a
Python worker. Each micro-batch is one transaction, begun on the driver:

- ``write_dataframe``: Spark writes the DataFrame into ``<path>/_staging/<ctx.name>/`` (its commit
  protocol keeps only the files of its committed tasks: retried and speculative tasks leave nothing);
- ``pre_commit``: fsync every file, rename the directory into ``<path>/_pending/``;
- ``commit``: rename each file to a ``part-*`` name in ``<path>`` (in its ``k=v/`` directory with
  ``partition_by``), then drop the rest of the pending directory.

Names starting with ``_`` or ``.`` are invisible to readers (Spark's file sources skip them), so any
reader of ``<path>`` sees complete files of committed micro-batches only, each once: Spark's own file
sink promises that only to readers of its ``_spark_metadata`` log. See docs/spark-file-sink.md.

Usage::

    from sinks.spark_files import SparkFileSink
    from twophase.spark import TwoPhaseBatchSink

    with TwoPhaseBatchSink(SparkFileSink("/data/orders", format="parquet", partition_by=["day"]),
                           app="orders", zk="127.0.0.1:2181") as orders:
        query = (df.writeStream.foreachBatch(orders.write)
                 .option("checkpointLocation", "/data/ck/orders").start())
        ...
    spark.read.parquet("/data/orders")
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sinks.files import directory_path
from twophase.durable import fsync_dir, fsync_file
from twophase.sink import AbortFailed, CommitFailed, TwoPhaseCommitSink, TxnContext

# Spark's built-in file formats (spark.read.format(...) reads each back).
FORMATS = ("parquet", "json", "csv", "orc", "text")
# Hadoop's FileOutputCommitter setting. Version 2 moves a task's files into the output one by one as the task
# commits: a task that dies halfway leaves some next to its retry's. Version 1 (Spark's default) moves them
# at the job's commit, which pre_commit comes after.
COMMITTER_VERSION = "mapreduce.fileoutputcommitter.algorithm.version"


@dataclass(frozen=True)
class FileSetHandle:
    """A pre-committed micro-batch: its pending directory, and each file's name in it and once committed::

        FileSetHandle("/data/_pending/r1.7.0.0", "/data", (("day=1/part-00000-c000.snappy.parquet",
                                                            "day=1/part-00000007-00000-r1-0.snappy.parquet"),))
    """

    pending: str
    path: str
    files: tuple[tuple[str, str], ...]  # (relative to pending, relative to path)


@dataclass
class SparkFilesTxn:
    """One micro-batch's open transaction: the staging directory Spark writes into::

        SparkFilesTxn(TxnContext("orders", "q-1", "r1", 7, 0, 0), "/data/_staging/r1.7.0.0")
    """

    ctx: TxnContext
    staging: str
    written: bool = False


class SparkFileSink(TwoPhaseCommitSink):
    """Has Spark write each micro-batch with its own file writer, and makes it visible exactly once.

    ``format`` is a Spark file format (parquet, json, csv, orc, text), ``options`` its writer options
    (``{"compression": "zstd"}``), ``partition_by`` the columns of Hive-style ``k=v/`` directories::

        SparkFileSink("/data/orders", format="parquet", options={"compression": "zstd"}, partition_by=["day"])

    It takes whole DataFrames, on the driver: use it with ``TwoPhaseBatchSink`` in ``foreachBatch``
    (``foreach``, ``write_stream`` and ``write`` per row refuse it).
    """

    takes_dataframe = True
    uses_slots = False  # directories are named by attempt

    def __init__(self, path: str, format: str = "parquet", options: Mapping[str, str] | None = None,
                 partition_by: Sequence[str] = (), fsync: bool = True) -> None:
        if format not in FORMATS:
            raise ValueError(f"SparkFileSink format={format!r}: expected one of {', '.join(map(repr, FORMATS))}")
        options = dict(options or {})
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in options.items()):
            raise ValueError(f"SparkFileSink options={options!r}: names and values are strings, as Spark takes them")
        if "path" in {k.lower() for k in options}:
            raise ValueError("SparkFileSink options: 'path' is the sink's own (the first argument)")
        if options.get(COMMITTER_VERSION, "1") != "1":
            raise ValueError(f"SparkFileSink options: {COMMITTER_VERSION}={options[COMMITTER_VERSION]!r}; only "
                             "version 1 keeps a failed task's files out of the output")
        if isinstance(partition_by, str) or not all(isinstance(c, str) and c for c in partition_by):
            raise ValueError(f"SparkFileSink partition_by={partition_by!r}: expected a list of column names")
        hidden = [c for c in partition_by if c.startswith(("_", "."))]
        if hidden:
            raise ValueError(f"SparkFileSink partition_by: {hidden} would name directories readers skip "
                             "('_' or '.' first), and so would this sink: rename the column(s)")
        self.path = directory_path(path, "SparkFileSink")
        self.format = format
        self.options = options
        self.partition_by = tuple(partition_by)
        self.fsync = fsync

    def begin_transaction(self, ctx: TxnContext) -> SparkFilesTxn:
        """Name the staging directory; Spark makes it."""
        return SparkFilesTxn(ctx, os.path.join(self.path, "_staging", ctx.name))

    def write(self, txn: SparkFilesTxn, row: Any) -> None:
        """Refused: Spark writes this sink's rows (:meth:`write_dataframe`)."""
        raise TypeError("SparkFileSink is written a DataFrame at a time by Spark's own file writer: use it with "
                        "TwoPhaseBatchSink in foreachBatch (docs/spark-file-sink.md)")

    def write_dataframe(self, txn: SparkFilesTxn, df: Any) -> None:
        """Have Spark write ``df`` into the staging directory: one Spark job, on the driver's thread."""
        if txn.written:
            raise ValueError(f"transaction {txn.ctx.name} holds a DataFrame already: one per micro-batch")
        version = df.sparkSession.conf.get(f"spark.hadoop.{COMMITTER_VERSION}", None)
        if version not in (None, "1") and COMMITTER_VERSION not in self.options:
            raise ValueError(f"the session sets spark.hadoop.{COMMITTER_VERSION}={version}; SparkFileSink needs "
                             f"version 1 (pass options={{{COMMITTER_VERSION!r}: '1'}} to override it for its writes)")
        txn.written = True
        (df.write.format(self.format).options(**self.options).partitionBy(*self.partition_by)
         .mode("errorifexists").save(txn.staging))

    def check_target(self, schema: Any | None) -> None:
        """ValueError naming the ``partition_by`` columns the micro-batch has not (before Spark writes)."""
        missing = [c for c in self.partition_by if schema is not None and c not in schema.names]
        if missing:
            raise ValueError(f"SparkFileSink partition_by: the micro-batch has no column(s) {missing}; "
                             f"its columns: {schema.names}")

    def pre_commit(self, txn: SparkFilesTxn) -> FileSetHandle:
        """fsync what Spark wrote and rename its directory into ``_pending/``; return the handle."""
        ctx = txn.ctx
        pending_dir = os.path.join(self.path, "_pending")
        files = _data_files(txn.staging)
        handle = FileSetHandle(os.path.join(pending_dir, ctx.name), self.path, tuple(
            (name, os.path.join(os.path.dirname(name),
                                f"part-{ctx.epoch:08d}-{i:05d}-{ctx.run_id}-{ctx.attempt}{_suffix(name)}"))
            for i, name in enumerate(files)))
        if not files:
            self.abort_transaction(txn)
            return handle
        if self.fsync:
            for name in files:
                fsync_file(os.path.join(txn.staging, name))  # Spark's writer fsyncs nothing
            for directory in _directories(txn.staging, [os.path.dirname(name) for name in files]):
                fsync_dir(directory)
        if not os.path.isdir(pending_dir):
            os.makedirs(pending_dir, exist_ok=True)
            if self.fsync:
                fsync_dir(self.path)
        os.rename(txn.staging, handle.pending)
        if self.fsync:
            fsync_dir(pending_dir)
        return handle

    def commit(self, handle: FileSetHandle) -> None:
        """Rename each pending file to its ``part-*`` name, then drop the pending directory. Idempotent.

        Raises CommitFailed if a file is in neither place (its rows are lost).
        """
        for pending, final in handle.files:
            source, target = os.path.join(handle.pending, pending), os.path.join(handle.path, final)
            if os.path.exists(source):
                os.makedirs(os.path.dirname(target), exist_ok=True)  # a new k=v/ directory
                os.rename(source, target)
            elif not os.path.exists(target):
                raise CommitFailed(f"neither {source} nor {target} exists: the pre-committed rows in it are lost")
        if self.fsync:  # each file's directory, and those above it, whose new k=v/ entries must last too
            for directory in _directories(handle.path, [os.path.dirname(final) for _, final in handle.files]):
                fsync_dir(directory)
        shutil.rmtree(handle.pending, ignore_errors=True)  # what is left: _SUCCESS, checksums

    def abort(self, handle: FileSetHandle) -> None:
        """Delete the pending directory. Idempotent; AbortFailed if a file of it is committed already."""
        committed = [final for pending, final in handle.files
                     if not os.path.exists(os.path.join(handle.pending, pending))
                     and os.path.exists(os.path.join(handle.path, final))]
        if committed:
            raise AbortFailed(f"{len(committed)} file(s) of {handle.pending} are committed already, "
                              f"{committed[0]} first")
        shutil.rmtree(handle.pending, ignore_errors=True)

    def abort_transaction(self, txn: SparkFilesTxn) -> None:
        """Delete the staging directory (a failed job's, or an empty one's)."""
        shutil.rmtree(txn.staging, ignore_errors=True)

    def abort_unregistered(self, ctx: TxnContext) -> None:
        """Delete the staging or pending directory an attempt left (a driver killed mid-write)."""
        for folder in ("_staging", "_pending"):
            shutil.rmtree(Path(self.path, folder, ctx.name), ignore_errors=True)


def _data_files(directory: str) -> list[str]:
    """The data files Spark left in ``directory`` (relative, sorted); not ``_SUCCESS``, checksums, or
    anything else whose name, or whose directory's, starts with ``_`` or ``.``."""
    found = []
    for folder, subfolders, names in os.walk(directory):
        subfolders[:] = [d for d in subfolders if not d.startswith(("_", "."))]
        found.extend(os.path.relpath(os.path.join(folder, n), directory)
                     for n in names if not n.startswith(("_", ".")))
    return sorted(found)


def _directories(top: str, relative: list[str]) -> list[str]:
    """``top`` and every directory below it on the way to each of ``relative``, deepest first."""
    found = {top}
    for folder in relative:
        while folder:
            found.add(os.path.join(top, folder))
            folder = os.path.dirname(folder)
    return sorted(found, key=lambda d: (-d.count(os.sep), d))


def _suffix(name: str) -> str:
    """The extensions of a file Spark named ``part-<task>-<uuid>.c000.snappy.parquet``: ``.snappy.parquet``
    (readers go by them). The ``c000`` (a task's file count) goes: the part name numbers every file."""
    base = os.path.basename(name)
    return re.sub(r"^\.c\d+(?=\.)", "", base[base.find("."):]) if "." in base else ""
