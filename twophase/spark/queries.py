"""What Spark's streaming queries are doing, read by polling from the hook's own thread.

The driver hook does not use Python ``StreamingQueryListener`` callbacks: they run on
py4j's Python callback server, which watches its sockets with ``select()`` and dies for
good once the driver holds a descriptor numbered 1024 or more, after which Spark's
stream thread waits forever on the next callback (docs/spark-facts.md). Calls from
Python into the JVM do not go through that server, so the watcher asks instead.

The barrier comes from the query's commit log (``commits/N``, read by Spark itself, so any
checkpoint file system works), not from ``lastProgress``: an idle trigger reports the
*next* batch id there, which has not run.

Usage::

    watcher = QueryWatcher(spark)
    for qid, snap in (watcher.active() or {}).items():
        print(qid, snap.run_id, snap.last_batch)     # None: the SparkContext is stopped
"""

from __future__ import annotations

from dataclasses import dataclass

from pyspark import SparkContext
from pyspark.sql import SparkSession


@dataclass(frozen=True)
class QuerySnapshot:
    """One active query as Spark reports it now."""

    query_id: str
    run_id: str
    checkpoint: str | None
    last_batch: int | None  # the last batch with commits/N in the checkpoint, None before the first


class QueryWatcher:
    """Reads the session's active streaming queries through py4j (Python-to-JVM calls only)."""

    def __init__(self, spark: SparkSession) -> None:
        self.spark = spark
        self._executions: dict[tuple[str, str], object] = {}  # (query, run) -> its JVM StreamExecution

    def active(self) -> dict[str, QuerySnapshot] | None:
        """Every active query by id; None once the SparkContext has stopped (nothing to watch)."""
        if SparkContext._active_spark_context is None:
            return None
        snapshots = {}
        for jsq in self.spark._jsparkSession.streams().active():
            qid, run_id = str(jsq.id().toString()), str(jsq.runId().toString())
            execution = self._executions.get((qid, run_id))
            if execution is None:
                execution = self._executions[(qid, run_id)] = jsq.streamingQuery()
            latest = execution.commitLog().getLatestBatchId()
            snapshots[qid] = QuerySnapshot(qid, run_id, str(execution.resolvedCheckpointRoot()),
                                           int(latest.get()) if latest.isDefined() else None)
        for key in [k for k in self._executions if k[0] not in snapshots or snapshots[k[0]].run_id != k[1]]:
            del self._executions[key]
        return snapshots

    def checkpoint_of(self, query_id: str) -> str | None:
        """The resolved checkpoint root of an active query, None if it is not active."""
        snap = (self.active() or {}).get(query_id)
        return snap.checkpoint if snap else None
