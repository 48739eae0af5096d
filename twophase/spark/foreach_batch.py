"""Exactly-once targets for ``foreachBatch``: one micro-batch written to several sinks, each exactly once.

A ``foreachBatch`` function runs on the driver with the micro-batch as a DataFrame; the jobs it starts
carry the query's id, run id and batch id (Spark sets them on the stream thread, and tasks read them
from their TaskContext), so each :class:`TwoPhaseBatchSink` writes its share as epoch ``batch_id`` of
its own app, through the batch writer of the ``twophase`` format (an Arrow batch at a time). A sink
that takes whole DataFrames (``SparkFileSink``: Spark's own file writer) gets the micro-batch instead,
in one transaction the driver runs as partition 0 of the epoch (docs/spark-file-sink.md). Each app
has its own coordinator and state; each commits its epoch once Spark has durably completed the
micro-batch (``commits/N``), whatever happened to the others. A driver crash in the middle of the
function re-runs the micro-batch in a new run, whose pre-commits replace the old run's in every app.

Each app takes one DataFrame per micro-batch: within a run the first attempt of a partition wins, so
a second write of the same batch would find its partitions taken; it is refused. Write every
micro-batch (an empty DataFrame is fine): ``await_committed`` waits for the query's last one.

Let a failed write fail the function. A failed write (its Spark job failed: some partitions have no
pre-commit) records itself under its epoch (``epochs/<N>/failed_writes/<run>``) and halts the run
before it raises. If the function swallows the error anyway, Spark records micro-batch N, but the
coordinator finds the record and marks epoch N FAILED instead of committing it: none of its rows
become visible, ``twophase status`` shows the failed write, the next micro-batch fails naming it, and
``twophase replay`` runs the micro-batch again once the query is stopped.
"""

from __future__ import annotations

import logging
import threading

from kazoo.exceptions import NodeExistsError
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.streaming import StreamingQuery

from coordinator.app import CommitPolicy
from coordinator.layout import DEFAULT_ROOT
from coordinator.precommits import PrecommitRegistry
from twophase.signing import load_secret
from twophase.sink import TwoPhaseCommitSink, TxnContext
from twophase.spark.driver import DriverHook, HookConfig
from twophase.spark.sink_options import check_app_settings, check_sink
from twophase.spark.stream_sink import SINK_DIGEST, SINK_FORMAT, check_target_once, stored_sink
from twophase.spark.task_context import NotInStream
from twophase.spark.streams import register, stored_digest
from twophase.supervisor import Supervision
from twophase.task import TaskAttempt


log = logging.getLogger("twophase.driver")

# (zk, root, app, query, run) -> the micro-batch last written: one write per app and micro-batch, whichever
# target of the app writes it (a second would find every partition of the run taken, and write nothing).
_last: dict[tuple[str, str, str, str, str], int] = {}
_lock = threading.Lock()


class TwoPhaseBatchSink:
    """One exactly-once target of a ``foreachBatch`` function.

    Usage::

        files = TwoPhaseBatchSink(FileSink("/data/out", format="parquet"), app="files", zk="127.0.0.1:2181")
        log = TwoPhaseBatchSink(LogSink("127.0.0.1:9092", "audit"), app="audit", zk="127.0.0.1:2181")

        def process(batch_df, batch_id):
            files.write(batch_df, batch_id)
            log.write(batch_df.select("id"), batch_id)

        query = df.writeStream.foreachBatch(process).option("checkpointLocation", ck).start()
        ...
        files.await_committed(query); log.await_committed(query)
        files.close(); log.close()          # or use each as a context manager

    Built on the driver, it stores the sink (signed) for ``app`` and holds the app's driver hook
    (publisher, embedded coordinator) until ``close()``. The secret comes from
    :func:`twophase.signing.load_secret`'s usual places, in the driver and on the executors.
    """

    def __init__(self, sink: TwoPhaseCommitSink, app: str, zk: str, *, root: str = DEFAULT_ROOT,
                 coordinator: str = "embedded", policy: CommitPolicy | None = None,
                 supervision: Supervision | None = None, spark: SparkSession | None = None) -> None:
        check_sink(sink, takes_rows=False)
        check_app_settings(app, root, coordinator)
        self.app, self.zk, self.root, self.coordinator = app, zk, root, coordinator
        config = HookConfig(zk, root, app, load_secret(), coordinator, policy or CommitPolicy(),
                            supervision or Supervision())
        self._sink = sink
        self._hook: DriverHook | None = DriverHook.acquire(config, sink, spark)
        try:
            register(self._hook.watcher.spark)
            self._digest = stored_digest(self._hook)
        except BaseException:
            self.close()
            raise

    def write(self, batch_df: DataFrame, batch_id: int) -> None:
        """Write ``batch_df`` as epoch ``batch_id`` of this app; call it from the foreachBatch function.

        Raises NotInStream outside one, and ValueError for a second write of the same micro-batch.
        """
        if self._hook is None:
            raise RuntimeError("this TwoPhaseBatchSink is closed")
        sc = batch_df.sparkSession.sparkContext
        query, run, batch = (sc.getLocalProperty(name) for name in
                             ("sql.streaming.queryId", "spark.jobGroup.id", "streaming.sql.batchId"))
        if batch is None or int(batch) != batch_id:
            raise NotInStream(f"TwoPhaseBatchSink.write(df, {batch_id}) must be called from the foreachBatch "
                              "function of a streaming query, with the batch id it was given")
        written = (self.zk, self.root, self.app, query, run)
        with _lock:
            if _last.get(written) == batch_id:
                raise ValueError(f"app {self.app} already wrote micro-batch {batch_id}: one write per app and "
                                 "micro-batch (union the DataFrames, or give each target an app of its own)")
            _last[written] = batch_id
        try:
            if self._sink.takes_dataframe:
                self._write_on_driver(batch_df, query, run, batch_id)
            else:
                (batch_df.write.format(SINK_FORMAT).mode("append")
                 .option("twophase.zk", self.zk).option("twophase.app", self.app).option("twophase.root", self.root)
                 .option("twophase.coordinator", self.coordinator).option(SINK_DIGEST, self._digest).save())
        except BaseException as e:
            self._failed(query, run, batch_id, e)
            raise

    def _write_on_driver(self, batch_df: DataFrame, query: str, run: str, batch_id: int) -> None:
        """A sink that takes whole DataFrames: one transaction for the micro-batch, begun, written (by Spark)
        and pre-committed here, as partition 0 of epoch ``batch_id``. Unlike the batch writer's ``commit`` it
        need not wait for a hook to publish the run: the hook is this object's own, and ``open`` has just
        checked that it did not halt the run (a halt during the write fails the next micro-batch)."""
        stored_sink(self.zk, self._hook.paths, self.app, self._digest)  # still this app's sink: as the batch writer
        check_target_once(self._sink, self._digest, batch_df.schema)
        qp = self._hook.paths.query(query)
        attempt = TaskAttempt(self._sink, PrecommitRegistry(self._hook.client, qp, self._hook.signer),
                              TxnContext(self.app, query, run, batch_id, 0, 0))
        if not attempt.open():
            raise ValueError(f"app {self.app} already wrote micro-batch {batch_id} in run {run}")
        try:
            attempt.write_dataframe(batch_df)
        except BaseException as e:
            attempt.close(e)
            raise
        attempt.close(None)

    def _failed(self, query: str, run: str, batch_id: int, error: BaseException) -> None:
        """Record the failed write of micro-batch ``batch_id`` under its epoch, then halt the run.

        Spark records the micro-batch (``commits/N``) once the function returns: a caller that swallowed
        the error would have epoch N commit without this write's failed partitions. The record is in
        ZooKeeper before the write raises, so before the function returns and before ``commits/N`` (or the
        barrier, or epoch N + 1) can tell any coordinator that N is complete; once it knows, the coordinator
        reads the record and marks the epoch FAILED instead of committing it (coordinator/app.py,
        ``_failed_writes``). The halt makes the run's next micro-batch fail, naming this write.
        """
        qp = self._hook.paths.query(query)
        reason = f"the write of micro-batch {batch_id} to app {self.app} failed ({error!r:.2000})"
        try:
            PrecommitRegistry(self._hook.client, qp, self._hook.signer).record_failed_write(run, batch_id, reason)
        except Exception as record_error:  # noqa: BLE001 - the write's own error is the one to raise
            log.error("app %s: cannot record the failed write of micro-batch %d: %r", self.app, batch_id, record_error)
            error.add_note(f"twophase could not record this failed write ({record_error!r}): if the foreachBatch "
                           f"function swallows it, epoch {batch_id} of app {self.app} may commit without the failed "
                           "partitions")
        halt = (f"{reason}; if the foreachBatch function went on regardless, epoch {batch_id} is FAILED, not "
                f"committed: stop the query, run `twophase replay --app {self.app} --epoch {batch_id}`, and let a "
                "failed write fail the function")
        try:
            self._hook.client.create(qp.halted(run), halt.encode(), makepath=True)
        except NodeExistsError:
            pass
        except Exception as halt_error:  # noqa: BLE001 - the write's own error is the one to raise
            log.error("app %s: cannot halt run %s after its write failed: %r", self.app, run, halt_error)

    def await_committed(self, query: StreamingQuery, timeout: float = 60.0) -> int | None:
        """Block until every micro-batch Spark completed for ``query`` is committed in this app (ValueError for
        a query twophase refuses: Spark's async progress tracking)."""
        if self._hook is None:
            raise RuntimeError("this TwoPhaseBatchSink is closed")
        return self._hook.await_committed(query, timeout)

    def close(self) -> None:
        """Release the driver hook (the last release stops it); idempotent."""
        hook, self._hook = self._hook, None
        if hook is not None:
            hook.release()

    def __enter__(self) -> TwoPhaseBatchSink:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
