"""The batch path: Spark hands each task's rows to a TwoPhaseCommitSink as Arrow record batches.

:class:`TwoPhaseStreamWriter` is a PySpark ``DataSourceStreamArrowWriter``. In each task it runs the
same :class:`~twophase.task.TaskAttempt` as the ``foreach`` writer (``open``: halted? winner? intent
and slot, ``begin_transaction``; then ``write_batch`` per Arrow batch instead of ``write`` per row;
``close``: pre-commit and register), so the coordinator, the ZooKeeper layout, the recovery CLI and
the failure cases are those of :class:`~twophase.spark.TwoPhaseSink`.

Spark calls ``commit(messages, batchId)`` on the driver host *before* it writes ``commits/<batchId>``,
and again for the same batch id if the driver dies in between (docs/spark-facts.md). So it commits
nothing: the coordinator still commits an epoch only once Spark has durably completed it. It checks
that a driver hook watches the run (else nothing would ever commit the pre-commits: the batch fails
with the reason instead), raises the run's halt reason if twophase halted it, and hints the
coordinator that ``commits/N`` is coming (QueryPaths.ready), so it looks at the checkpoint at once.

Two data sources use it: ``twophase-kafka`` (twophase/spark/source.py, Spark's Kafka sink contract
over :class:`~sinks.log.LogSink`) and ``twophase`` (:class:`SinkFormat`: any sink, stored in
ZooKeeper by :func:`twophase.spark.write_stream`)::

    from twophase.spark import write_stream
    query = (write_stream(df, FileSink("/data/out", format="parquet"), app="orders", zk="127.0.0.1:2181")
             .option("checkpointLocation", "/data/ck/orders").start())
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pyarrow as pa
from kazoo.client import KazooClient
from kazoo.exceptions import KazooException, NoNodeError
from pyspark.sql.datasource import (
    DataSource,
    DataSourceArrowWriter,
    DataSourceStreamArrowWriter,
    WriterCommitMessage,
)
from pyspark.sql.pandas.types import to_arrow_schema
from pyspark.sql.types import StructType

from coordinator.app import verify_stored_sink
from coordinator.layout import AppPaths, QueryPaths
from coordinator.precommits import PrecommitRegistry
from coordinator.zk import dump, put_data, shared_client, watched_data
from twophase.signing import SignatureError, Signer, load_secret
from twophase.sink import TwoPhaseCommitSink
from twophase.spark.sink_options import (EXACTLY_ONCE, SPARK_OWN, ExactlyOnce, WriterOptionError, exactly_once,
                                         lowered)
from twophase.spark.task_context import CONTINUOUS_REFUSED, ContinuousProcessingNotSupported, task_context
from twophase.task import PhaseTwoHalted, TaskAttempt

SINK_FORMAT = "twophase"
SINK_DIGEST = "twophase.sinkDigest"  # the stored sink the query was started with (see sink_digest)
_OWN = {name.lower() for name in (*SPARK_OWN, *EXACTLY_ONCE, SINK_DIGEST)}  # every option the format takes
_CHECKED: set[tuple[str | None, str]] = set()  # (sink digest, schema) check_target passed (check_target_once)
# How long commit() waits for the driver hook to publish a run it has not seen yet: the hook sees a
# query within a poll (0.25 s) and publishes its run once the first task recorded it.
HOOK_WAIT = 60.0
# How long a task waits for a published sink its secret does not verify to be replaced (a restart's hook,
# its secret rotated, stores its sink within a poll of the query's start) before it takes it as a mismatch:
# each of Spark's task attempts waits again, so a mismatch fails the query in about maxFailures times this.
REPLACE_WAIT = 10.0


class DriverHookMissing(RuntimeError):
    """No twophase driver hook watches the run, so nothing would ever commit its pre-commits."""


class SecretMismatch(RuntimeError):
    """The writer's signing secret is not the one the app's driver hook signs with: the coordinator could
    verify none of its pre-commits, so nothing it writes would ever be committed, or aborted."""


@dataclass
class AttemptReport(WriterCommitMessage):
    """What one task attempt did, sent to the driver's ``commit``."""

    query_id: str
    run_id: str
    epoch: int
    partition: int
    attempt: int
    rows: int
    won: bool | None  # None: skipped, an attempt of this run had won the partition already


class _AttemptWriter:
    """What the stream and the batch writer share: one TaskAttempt per task, Arrow batch by batch."""

    def __init__(self, sink: TwoPhaseCommitSink, where: ExactlyOnce, secret: bytes) -> None:
        self.sink = sink
        self.where = where
        self._secret = secret

    def __repr__(self) -> str:  # the secret stays out of logs and plans
        return f"{type(self).__name__}({type(self.sink).__name__}, app={self.where.app!r})"

    def _query(self, query_id: str) -> QueryPaths:
        return AppPaths(self.where.root, self.where.app).query(query_id)

    def write(self, iterator: Iterator) -> AttemptReport:
        """In a task: open the attempt, write every batch, pre-commit and register (or abort on error)."""
        ctx = task_context(self.where.app)
        client = shared_client(self.where.zk)
        check_secret(client, self.where, self._secret, HOOK_WAIT)
        registry = PrecommitRegistry(client, self._query(ctx.query_id), Signer(self._secret))
        attempt = TaskAttempt(self.sink, registry, ctx)
        rows = 0
        if not attempt.open():
            for _ in iterator:  # an attempt of this run won the partition: its rows are written already
                pass
            return AttemptReport(ctx.query_id, ctx.run_id, ctx.epoch, ctx.partition, ctx.attempt, 0, None)
        try:
            for batch in iterator:
                attempt.write_batch(batch)
                rows += batch.num_rows
        except BaseException as e:
            attempt.close(e)
            raise
        attempt.close(None)
        return AttemptReport(ctx.query_id, ctx.run_id, ctx.epoch, ctx.partition, ctx.attempt, rows, attempt.won)

    def _check_published_secret(self, client: KazooClient) -> None:
        """SecretMismatch unless the writer's secret verifies the sink the app's driver hook published."""
        try:
            verify_stored_sink(client, AppPaths(self.where.root, self.where.app), Signer(self._secret))
        except SignatureError:
            raise SecretMismatch(_secret_mismatch(self.where.app)) from None

    def _check_watched(self, messages: list[AttemptReport | None], batch_id: int | None) -> None:
        """Check a driver hook publishes the run, then hint the coordinator that ``commits/<batch_id>``
        is about to be written (QueryPaths.ready): it looks at the checkpoint at once instead of
        waiting for the hook's next barrier. Still only commits/N, never this call, completes the epoch.

        Raises ContinuousProcessingNotSupported for a message that is missing: every task of a micro-batch
        reports, an empty partition's too, while under trigger(continuous=...) Spark's Python writer drops
        its rows without calling :meth:`write` and commits each epoch with a None message per task. Raises
        SecretMismatch, at a run's first batch, if the writer's secret does not verify the hook's sink."""
        if any(m is None for m in messages):
            raise ContinuousProcessingNotSupported(CONTINUOUS_REFUSED)
        if not messages:
            return  # a batch without partitions pre-committed nothing
        first = messages[0]
        client = shared_client(self.where.zk)
        query = self._query(first.query_id)
        hint = dump({"epoch": batch_id, "run": first.run_id})
        # Sent first, answered while await_watched's read is in flight: one round trip for both. A hint for
        # a batch that then fails here costs the coordinator a few looks at the checkpoint, nothing more.
        hinting = None if batch_id is None else client.set_async(query.ready, hint)
        first_look = (query.base, first.run_id) not in _watched
        await_watched(client, query, first.run_id, self.where.app, HOOK_WAIT)
        if first_look:
            # The run's hook stored its sink before it published the run: the tasks' secret must verify that one
            # (they may have checked a sink the hook was about to replace).
            self._check_published_secret(client)
        if hinting is None:
            return  # foreachBatch: commits/N comes only after the whole function returned
        try:
            hinting.get()
        except KazooException:  # the query's first hint (no znode yet), or the connection dropped
            put_data(client, query.ready, hint)


class TwoPhaseStreamWriter(_AttemptWriter, DataSourceStreamArrowWriter):
    """Writes each task's Arrow batches through ``sink.write_batch`` in one two-phase transaction.

    Built on the driver host by a data source's ``streamWriter`` and pickled to every task::

        TwoPhaseStreamWriter(sink, ExactlyOnce("127.0.0.1:2181", "orders"), load_secret())
    """

    def commit(self, messages: list[AttemptReport | None], batchId: int) -> None:  # noqa: N803 - Spark's name
        """On the driver host, before Spark records the batch: check a driver hook will commit it.

        Commits nothing (see the module doc). Raises DriverHookMissing if no hook published the run
        within HOOK_WAIT, PhaseTwoHalted if twophase halted it (the batch fails with the reason), and
        ContinuousProcessingNotSupported under a continuous trigger.
        """
        self._check_watched(messages, batchId)

    def abort(self, messages: list[AttemptReport | None], batchId: int) -> None:  # noqa: N803 - Spark's name
        """A task failed past its retries: nothing to do here. Failed attempts aborted their own
        transactions; the coordinator aborts the registered ones once a later run redoes the epoch."""


class TwoPhaseBatchWriter(_AttemptWriter, DataSourceArrowWriter):
    """The same, for a batch write inside ``foreachBatch`` (twophase/spark/foreach_batch.py): Spark runs
    the function's jobs with the micro-batch's query, run and batch id, so the epoch is the batch id."""

    def commit(self, messages: list[AttemptReport | None]) -> None:
        """On the driver host: check a driver hook will commit the pre-commits (see TwoPhaseStreamWriter)."""
        self._check_watched(messages, None)

    def abort(self, messages: list[AttemptReport | None]) -> None:
        """Nothing to do: see TwoPhaseStreamWriter.abort."""


_HOOK_HOWTO = ("Call twophase.spark.register(spark) in the driver before starting the query, or start it with "
               "twophase.spark.write_stream(...)")
_watched: set[tuple[str, str]] = set()  # (query znode, run) a hook was seen publishing, in this worker
_verified: set[tuple[str, str, str, bytes]] = set()  # (zk, root, app, secret): a published sink verified


def check_secret(client: KazooClient, where: ExactlyOnce, secret: bytes, timeout: float,
                 replace_wait: float = REPLACE_WAIT) -> None:
    """Wait until the app's published sink verifies with ``secret``; once per app and secret in a process.

    A ``twophase-kafka`` writer finds its secret in a Python worker, whose environment is the JVM's: a
    ``TWOPHASE_SECRET`` set in the driver after the session started reaches the hook but not the writer. The
    sink read may also be the one a driver hook is replacing (a restart's hook with a new secret), so a sink
    that does not verify is read again as it changes, for ``replace_wait`` seconds; then SecretMismatch,
    before anything is written. No sink yet (a first publication in progress) is waited for ``timeout``
    seconds; then DriverHookMissing.
    """
    key = (where.zk, where.root, where.app, secret)
    if key in _verified:
        return
    paths, signer = AppPaths(where.root, where.app), Signer(secret)
    unverified_since: float | None = None

    def settled(data: bytes | None) -> bool:
        nonlocal unverified_since
        if _verifies(signer, data, paths.sink):
            return True
        if not data:  # no sink yet, or its node made empty just before the hook sets it
            return False
        unverified_since = unverified_since or time.monotonic()
        return time.monotonic() - unverified_since >= replace_wait

    stored = _await_data(client, paths.sink, timeout, settled)
    if not _verifies(signer, stored, paths.sink):
        if not stored:
            raise DriverHookMissing(f"no twophase driver hook published app {where.app} within {timeout:.0f} s: "
                                    f"nothing would commit its pre-commits. {_HOOK_HOWTO}")
        raise SecretMismatch(_secret_mismatch(where.app))
    _verified.add(key)


def _secret_mismatch(app: str) -> str:
    return (f"the twophase secret of this Spark Python worker is not the one app {app}'s driver hook signs with. "
            "Spark's Python workers see the environment the JVM started with: set TWOPHASE_SECRET (or "
            "TWOPHASE_SECRET_FILE) before the SparkSession starts, not later in os.environ")


def _verifies(signer: Signer, data: bytes | None, path: str) -> bool:
    try:
        signer.verify(data or b"", path)
    except SignatureError:
        return False
    return True


def _await_data(client: KazooClient, path: str, timeout: float, accept: Callable[[bytes | None], bool]) -> bytes | None:
    """Read ``path`` (None: no such node) until ``accept`` takes its data or ``timeout`` seconds passed; the last
    read. Each read leaves a watch, so a change wakes the wait at once."""
    changed = threading.Event()

    def wake(_event: object) -> None:  # one watcher for every read: kazoo keeps each distinct one until it fires
        changed.set()

    deadline = time.monotonic() + timeout
    while True:
        try:
            data = client.retry(client.get, path, watch=wake)[0]
        except NoNodeError:
            # Made in between: an empty read, and the exists watch fires on its next change.
            data = None if client.retry(client.exists, path, watch=wake) is None else b""
        left = deadline - time.monotonic()
        if accept(data) or left <= 0:
            return data
        changed.wait(min(left, 1.0))
        changed.clear()


def await_watched(client: KazooClient, query: QueryPaths, run_id: str, app: str, timeout: float) -> None:
    """Wait until a driver hook publishes ``run_id`` alive; raise PhaseTwoHalted if the run is halted.

    DriverHookMissing after ``timeout``: no hook runs for the app in the query's driver.
    """
    halted = query.halted(run_id)
    data = client.retry(client.exists, halted)
    if data is not None:
        reason, _ = client.retry(client.get, halted)
        raise PhaseTwoHalted(f"twophase stopped run {run_id} of app {app}: {reason.decode()}")
    if (query.base, run_id) in _watched:
        return
    if _await_data(client, f"{query.run(run_id)}/alive", timeout, lambda alive: alive is not None) is None:
        raise DriverHookMissing(f"no twophase driver hook watches run {run_id} of query "
                                f"{query.base.rsplit('/', 1)[-1]} (app {app}): nothing would commit its pre-commits. "
                                f"{_HOOK_HOWTO}")
    _watched.add((query.base, run_id))


class SinkFormat(DataSource):
    """The ``twophase`` data source: any TwoPhaseCommitSink on the batch path.

    The sink is the one :func:`twophase.spark.write_stream` stored (signed) for the app in ZooKeeper;
    use that helper rather than this format directly::

        write_stream(df, sink, app="orders", zk="127.0.0.1:2181")   # format("twophase") + its options
    """

    @classmethod
    def name(cls) -> str:
        return SINK_FORMAT

    def streamWriter(self, schema: StructType, overwrite: bool) -> TwoPhaseStreamWriter:  # noqa: N802
        return TwoPhaseStreamWriter(*self._stored())

    def writer(self, schema: StructType, overwrite: bool) -> TwoPhaseBatchWriter:
        sink, where, secret = self._stored()
        check_target_once(sink, lowered(self.options).get(SINK_DIGEST.lower()), schema)
        return TwoPhaseBatchWriter(sink, where, secret)

    def _stored(self) -> tuple[TwoPhaseCommitSink, ExactlyOnce, bytes]:
        """The app's stored sink (signature checked), where its state lives, and the secret."""
        where = exactly_once(self.options, also=(SINK_DIGEST,))
        unknown = sorted(set(lowered(self.options)) - _OWN)
        if unknown:
            raise WriterOptionError(f"unknown option(s) {unknown} for the twophase sink: its sink is configured in "
                                    "Python, write_stream(df, sink, ...) (docs/spark-writer.md)")
        secret = load_secret()
        paths = AppPaths(where.root, where.app)
        blob = stored_sink(where.zk, paths, where.app, lowered(self.options).get(SINK_DIGEST.lower()))
        return Signer(secret).loads(blob, paths.sink, what=f"sink of app {where.app!r}"), where, secret


def stored_sink(zk: str, paths: AppPaths, app: str, digest: str | None) -> bytes:
    """The sink stored for ``app`` (signed), checked to be the one the writer started with (``digest``).

    DriverHookMissing if none is stored; WriterOptionError once another writer of the app stored its own.
    Asked for twice a batch by Spark (its tasks' writer, then the commit's), so a watch, not a read each time.
    """
    blob = watched_data(zk, paths.sink)
    if not blob or sink_digest(blob) != digest:
        blob = watched_data(zk, paths.sink, fresh=True)  # refused only on what ZooKeeper says now
        if not blob:
            raise DriverHookMissing(f"app {app} has no sink stored in ZooKeeper: start the query with "
                                    "twophase.spark.write_stream(df, sink, app=..., zk=...)")
        if sink_digest(blob) != digest:
            raise WriterOptionError(
                f"the sink stored for app {app} is not the one this query was started with: another "
                "write_stream or TwoPhaseBatchSink of the app stored its own since. One sink per app: give "
                "each sink an app of its own")
    return blob


def check_target_once(sink: TwoPhaseCommitSink, digest: str | None, schema: StructType) -> None:
    """``sink.check_target`` for a foreachBatch DataFrame's own columns, once per (stored sink, schema) in
    this process, not every micro-batch."""
    checked = (digest, schema.json())
    if checked not in _CHECKED:
        sink.check_target(arrow_schema(schema))
        _CHECKED.add(checked)


def arrow_schema(schema: StructType) -> pa.Schema | None:
    """The query's columns as ``check_target`` takes them; None where PySpark has no Arrow type for one
    (a year-month interval): the sink then checks what it can without them."""
    try:
        return to_arrow_schema(schema, timezone="UTC")
    except TypeError:  # PySparkTypeError
        return None


def sink_digest(blob: bytes) -> str:
    """What names one stored sink (the signed blob's SHA-256), so a writer notices another replaced it."""
    return hashlib.sha256(blob).hexdigest()
