"""Exactly-once targets for ``foreachBatch``: one micro-batch written to several sinks, each exactly once.

A ``foreachBatch`` function runs on the driver with the micro-batch as a DataFrame; the jobs it starts
carry the query's id, run id and batch id (Spark sets them on the stream thread, and tasks read them
from their TaskContext), so each :class:`TwoPhaseBatchSink` writes its share as epoch ``batch_id`` of
its own app, through the batch writer of the ``twophase`` format (an Arrow batch at a time). Each app
has its own coordinator and state; each commits its epoch once Spark has durably completed the
micro-batch (``commits/N``), whatever happened to the others. A driver crash in the middle of the
function re-runs the micro-batch in a new run, whose pre-commits replace the old run's in every app.

Each app takes one DataFrame per micro-batch: within a run the first attempt of a partition wins, so
a second write of the same batch would find its partitions taken; it is refused. Write every
micro-batch (an empty DataFrame is fine): ``await_committed`` waits for the query's last one. Let a
failed write fail the function: if it were swallowed, Spark would record the micro-batch and its
epoch would commit without the failed partitions; the target halts the run, so the next micro-batch
fails naming the write that failed.
"""

from __future__ import annotations

import logging
import threading

from kazoo.exceptions import NodeExistsError
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.streaming import StreamingQuery

from coordinator.app import CommitPolicy
from coordinator.layout import DEFAULT_ROOT
from twophase.signing import load_secret
from twophase.sink import TwoPhaseCommitSink
from twophase.spark.driver import DriverHook, HookConfig
from twophase.spark.sink_options import check_app_settings
from twophase.spark.stream_sink import SINK_DIGEST, SINK_FORMAT
from twophase.spark.task_context import NotInStream
from twophase.spark.streams import register, stored_digest
from twophase.supervisor import Supervision


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
        if not isinstance(sink, TwoPhaseCommitSink):
            raise TypeError(f"sink must be a TwoPhaseCommitSink, got {type(sink).__name__}")
        check_app_settings(app, root, coordinator)
        self.app, self.zk, self.root, self.coordinator = app, zk, root, coordinator
        config = HookConfig(zk, root, app, load_secret(), coordinator, policy or CommitPolicy(),
                            supervision or Supervision())
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
            (batch_df.write.format(SINK_FORMAT).mode("append")
             .option("twophase.zk", self.zk).option("twophase.app", self.app).option("twophase.root", self.root)
             .option("twophase.coordinator", self.coordinator).option(SINK_DIGEST, self._digest).save())
        except BaseException as e:
            # Spark records the micro-batch once the function returns: a caller that swallowed this would
            # let epoch N commit without this write's failed partitions. Halting the run makes its next
            # micro-batch fail, naming why, instead of carrying on quietly.
            reason = (f"the write of micro-batch {batch_id} to app {self.app} failed ({e!r}); let the error fail "
                      "the foreachBatch function")
            halted = self._hook.paths.query(query).halted(run)
            try:
                self._hook.client.create(halted, reason.encode(), makepath=True)
            except NodeExistsError:
                pass
            except Exception as halt_error:  # noqa: BLE001 - the write's own error is the one to raise
                log.error("app %s: cannot halt run %s after its write failed: %r", self.app, run, halt_error)
            raise

    def await_committed(self, query: StreamingQuery, timeout: float = 60.0) -> int | None:
        """Block until every micro-batch Spark completed for ``query`` is committed in this app."""
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
