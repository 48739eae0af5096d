"""The two-phase-commit sink contract, after Flink's TwoPhaseCommitSinkFunction.

A sink is a participant in a two-phase commit. Writers run in Spark tasks; the
second phase (commit or abort) runs later, in the coordinator's process, from
the handle alone.

Usage::

    class MySink(TwoPhaseCommitSink):
        def begin_transaction(self, ctx):
            return MyTxn(ctx)

        def write(self, txn, row):
            txn.rows.append(row)

        def pre_commit(self, txn):
            key = store.stage(txn.rows)        # durable, still invisible
            return {"key": key}                # small and picklable

        def commit(self, handle):
            store.publish(handle["key"])       # idempotent

        def abort(self, handle):
            store.discard(handle["key"])       # idempotent

        def abort_transaction(self, txn):
            txn.rows.clear()                   # never pre-committed: nothing staged yet
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class TxnContext:
    """Where a transaction comes from: one attempt of one partition of one epoch.

    ``slot`` is a small number the framework assigns each attempt, unique among the unsettled
    attempts of its (query, partition) and reused across attempts once the attempt that held it is
    finished (its transaction committed or aborted, and a margin of later epochs committed). Sinks
    that keep named resources per attempt (Kafka transactional ids) can name them by slot to keep
    their number bounded. None when no registry assigned one (a sink driven directly, or one whose
    ``uses_slots`` is False)::

        TxnContext("orders", "q-1", "r1", 7, 3, 0, slot=1)   # attempt 0 of partition 3, epoch 7, in slot 1
    """

    app: str
    query_id: str
    run_id: str
    epoch: int
    partition: int
    attempt: int
    slot: int | None = None

    @property
    def name(self) -> str:
        """A name unique to this attempt, safe in file names and ZooKeeper paths."""
        return f"{self.run_id}.{self.epoch}.{self.partition}.{self.attempt}"

    @classmethod
    def from_name(cls, app: str, query_id: str, name: str, slot: int | None = None) -> TxnContext:
        """The context whose :attr:`name` is ``name`` (in ``slot``); ValueError if it is not such a name.

        ::

            TxnContext.from_name("orders", "q-1", "r1.7.3.0")   # run r1, epoch 7, partition 3, attempt 0
        """
        run_id, epoch, partition, attempt = name.rsplit(".", 3)  # a run id may itself hold dots
        return cls(app, query_id, run_id, int(epoch), int(partition), int(attempt), slot)


class RecordBatchLike(Protocol):
    """What ``write_batch`` is given: a ``pyarrow.RecordBatch`` (the contract imports no pyarrow)."""

    num_rows: int

    def to_pylist(self) -> list[dict[str, Any]]: ...


class Record(dict):
    """One row of a batch handed to :meth:`TwoPhaseCommitSink.write`: a dict that also reads like
    Spark's ``Row`` by name (``row["id"]``, ``row.id``, ``row.asDict()``), so a ``write`` written
    for ``foreach`` keeps working on the batch path. Positional access (``row[0]``) is not offered::

        row = Record({"id": 1, "name": "a"})
        row.id, row["name"], row.asDict()     # 1, 'a', {'id': 1, 'name': 'a'}
    """

    __slots__ = ()

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None

    def asDict(self, recursive: bool = False) -> dict[str, Any]:  # noqa: N802 - Spark's Row spells it so
        """A plain dict of the row (nested structs are plain dicts already)."""
        return dict(self)


@dataclass(frozen=True)
class PreparedTransaction:
    """A transaction the sink's target holds prepared (say, in PostgreSQL's ``pg_prepared_xacts``).

    It holds locks and resources until committed or rolled back, so ``twophase status`` lists old ones::

        PreparedTransaction("tp1:9f2c...:r1.7.3.0", age=912.4, attempt="r1.7.3.0")
    """

    id: str                    # the target's own name for it (a PostgreSQL global id)
    age: float                 # seconds since it was prepared
    attempt: str | None        # TxnContext.name of the attempt that prepared it; None: not this app's
    where: str = ""            # the target it lives in (a database, a cluster), for the operator


class CommitFailed(Exception):
    """Raised by commit() when the handle can never be committed.

    For example the external system expired the prepared transaction. The
    coordinator stops retrying, records the failure and leaves the epoch
    uncommitted; every other exception from commit() is retried with backoff.
    """


class CommitOutcomeUnknown(CommitFailed):
    """A CommitFailed where the external system can no longer tell whether an earlier try committed
    the handle (say, it forgot the transaction). The epoch is FAILED like any CommitFailed, and
    ``twophase replay`` refuses it: running the epoch again might write its rows twice.
    """


class AbortFailed(Exception):
    """Raised by abort() when the handle can no longer be aborted: it was committed.

    Aborting a committed transaction is a broken promise (its rows are visible and
    should not be), never something to log and ignore. The coordinator records it
    as a failure of the epoch, where ``twophase status`` shows it.
    """


class TwoPhaseCommitSink(ABC):
    """Base class for exactly-once sinks.

    Instances are cloudpickled to Spark executors and to the coordinator, so
    keep connections out of ``__init__``; open them lazily.

    ``commit_concurrency`` is how many commit/abort calls (for different handles
    of one epoch) the coordinator may run at once in threads. The default 1 is
    safe for any sink; raise it when those calls are thread-safe, so an epoch of
    many partitions does not pay every round trip in sequence.

    ``uses_slots``: whether the sink names anything by ``ctx.slot``. Slots cost ZooKeeper work in
    every task and in every epoch's phase two (claiming, listing, releasing); a sink that names its
    resources by attempt (``ctx.name``) or not at all sets it False, and its attempts get no slot.

    ``takes_dataframe``: whether Spark writes the sink's rows itself, a whole DataFrame per transaction
    (:meth:`write_dataframe`, on the driver, in ``foreachBatch``), instead of handing them to ``write``.
    """

    commit_concurrency: int = 1
    uses_slots: bool = True
    takes_dataframe: bool = False

    @abstractmethod
    def begin_transaction(self, ctx: TxnContext) -> Any:
        """Start a transaction for one task attempt and return it."""

    @abstractmethod
    def write(self, txn: Any, row: Any) -> None:
        """Add one row to the transaction."""

    def write_batch(self, txn: Any, batch: RecordBatchLike) -> None:
        """Add a batch of rows (a ``pyarrow.RecordBatch``) to the transaction.

        The batch path (``twophase.spark.write_stream``, ``format("twophase-kafka")``) calls
        this once per Arrow batch instead of ``write`` per row. The default hands each row to
        ``write`` as a :class:`Record`; override it to store the batch without a Python object
        per row (FileSink writes Parquet from it, LogSink builds Kafka record batches).
        """
        for row in batch.to_pylist():
            self.write(txn, Record(row))

    def write_dataframe(self, txn: Any, df: Any) -> None:
        """Have Spark write a whole DataFrame (a ``pyspark.sql.DataFrame``) into the transaction.

        Only for a sink whose ``takes_dataframe`` is True: ``TwoPhaseBatchSink`` calls it on the driver
        with the micro-batch, in a transaction of its own (partition 0, attempt 0), and the row paths
        refuse such a sink. Spark's own writer then does the work (SparkFileSink: its file writer).
        """
        raise NotImplementedError(f"{type(self).__name__} takes rows, not DataFrames (takes_dataframe is False)")

    @abstractmethod
    def pre_commit(self, txn: Any) -> Any:
        """Make the written data durable but invisible; return a small picklable handle.

        The handle must be all that another process needs to commit or abort.
        """

    @abstractmethod
    def commit(self, handle: Any) -> None:
        """Make the pre-committed data visible. A second call is a no-op."""

    @abstractmethod
    def abort(self, handle: Any) -> None:
        """Discard a pre-committed transaction from its handle. A second call is a no-op.

        Raise AbortFailed if the handle was committed already.
        """

    @abstractmethod
    def abort_transaction(self, txn: Any) -> None:
        """Discard a transaction that never reached pre_commit (its task failed). Idempotent."""

    def abort_unregistered(self, ctx: TxnContext) -> None:
        """Clean up after an attempt that began a transaction but never registered a handle.

        The coordinator calls this, once the attempt's epoch is settled, for a task
        that died between begin_transaction and registration (for example killed
        after pre_commit), from ``ctx`` alone (``ctx.slot`` is the slot the attempt
        still holds: nobody else uses it until the call succeeded). Idempotent; it must
        not undo a committed transaction. The default does nothing, which suits sinks whose
        unregistered leftovers are invisible and harmless.
        """

    def check_target(self, schema: Any | None) -> None:
        """Check, on the driver before a query writes anything, that the target can take its rows.

        ``schema`` is the query's ``pyarrow.Schema`` where the writer knows it (the batch path,
        ``foreachBatch``), None on the ``foreach`` path. Raise ValueError naming what is wrong (a
        missing table, a column of the wrong type, a server setting), so the query fails before a
        row is written. The default checks nothing.
        """

    def retire_epoch(self, app: str, query_id: str, epoch: int) -> None:
        """Forget what the sink kept to make commit idempotent for this query's epochs up to ``epoch``.

        The coordinator calls this when it drops a committed epoch's record (past its retention): the
        current owner never commits those epochs' handles again. ``recover_and_abort`` may still come
        for a late zombie's pre-commit of such an epoch (never committed), and must then succeed when
        the target has nothing left of it. Idempotent; a failure is retried on the next pass, and the
        epoch's record stays until it succeeds. The default does nothing.
        """

    def prepared_transactions(self, older_than: float) -> list[PreparedTransaction]:
        """The target's prepared transactions older than ``older_than`` seconds, for ``twophase status``.

        The default lists none (the sink's target has no such notion, or cannot list them).
        """
        return []

    def close(self) -> None:
        """Release what phase-two calls keep open between calls (PostgresSink's idle connections).

        The coordinator calls this when it is done with this copy of the sink: it stopped serving the
        app, or the app's driver stored a newer sink. A call that comes later (a commit in flight) must
        still work, and release after itself. The default has nothing to release.
        """

    def recover_and_commit(self, handle: Any) -> None:
        """Commit a handle found after a crash; override if recovery needs more."""
        self.commit(handle)

    def recover_and_abort(self, handle: Any) -> None:
        """Abort a handle found after a crash; override if recovery needs more."""
        self.abort(handle)


def release(sink: TwoPhaseCommitSink) -> None:
    """``sink.close()``, a failure logged, not raised: the caller is finishing something else (an abort, a
    coordinator stopping, a newer sink loaded) whose own outcome a failed release must not hide."""
    try:
        sink.close()
    except Exception:
        logging.getLogger("twophase.sink").exception("closing the %s failed", type(sink).__name__)
