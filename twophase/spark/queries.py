"""What Spark's streaming queries are doing, read by polling from the hook's own thread.

The driver hook does not use Python ``StreamingQueryListener`` callbacks: they run on
py4j's Python callback server, which watches its sockets with ``select()`` and dies for
good once the driver holds a descriptor numbered 1024 or more, after which Spark's
stream thread waits forever on the next callback (docs/spark-facts.md). Calls from
Python into the JVM do not go through that server, so the watcher asks instead.

The barrier comes from the query's commit log (``commits/N``, read by Spark itself, so any
checkpoint file system works), not from ``lastProgress``: an idle trigger reports the
*next* batch id there, which has not run. A run that left the active queries since the
last poll is read once more, so the batch it completed just before it stopped is not missed.

Usage::

    watcher = QueryWatcher(spark)
    seen = watcher.poll()
    for snap in seen.active.values():
        print(snap.query_id, snap.run_id, snap.last_batch)
    for snap in seen.ended:                  # runs gone since the last poll, final commit log
        ...
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

from pyspark.sql import SparkSession

log = logging.getLogger("twophase.driver")


@dataclass(frozen=True)
class QuerySnapshot:
    """One run of a query as Spark reports it."""

    query_id: str
    run_id: str
    checkpoint: str | None
    last_batch: int | None  # the last batch with commits/N in the checkpoint, None before the first


@dataclass(frozen=True)
class Poll:
    """What one look at Spark found."""

    active: dict[str, QuerySnapshot] = field(default_factory=dict)  # by query id
    ended: tuple[QuerySnapshot, ...] = ()  # runs that left the active queries since the last poll
    spark_stopped: bool = False  # the SparkContext is gone: nothing more to watch


class QueryWatcher:
    """Reads the session's streaming queries through py4j (Python-to-JVM calls only).

    ``poll`` belongs to one caller (the hook's publisher): it hands each ended run out once.
    """

    def __init__(self, spark: SparkSession) -> None:
        self.spark = spark
        self._lock = threading.Lock()
        self._executions: dict[tuple[str, str], object] = {}  # (query, run) -> its JVM StreamExecution

    def poll(self) -> Poll:
        """The active queries, and the final state of runs that ended since the last poll."""
        with self._lock:
            if self.spark_stopped:
                return Poll(ended=self._finals(list(self._executions)), spark_stopped=True)
            active = {}
            for jsq in self.spark._jsparkSession.streams().active():
                key = (str(jsq.id().toString()), str(jsq.runId().toString()))
                if key not in self._executions:
                    self._executions[key] = jsq.streamingQuery()
                active[key[0]] = self._snapshot(*key, self._executions[key])
            gone = [key for key in self._executions if key[0] not in active or active[key[0]].run_id != key[1]]
            return Poll(active, self._finals(gone))

    @staticmethod
    def snapshot_of(jsq) -> QuerySnapshot:
        """A query's run as its JVM handle reports it, active or ended (any thread)."""
        return QueryWatcher._snapshot(str(jsq.id().toString()), str(jsq.runId().toString()), jsq.streamingQuery())

    @property
    def spark_stopped(self) -> bool:
        """The session's SparkContext is stopped (PySpark drops its JVM handle on stop)."""
        return self.spark.sparkContext._jsc is None

    @staticmethod
    def _snapshot(qid: str, run_id: str, execution) -> QuerySnapshot:
        latest = execution.commitLog().getLatestBatchId()
        return QuerySnapshot(qid, run_id, str(execution.resolvedCheckpointRoot()),
                             int(latest.get()) if latest.isDefined() else None)

    def _finals(self, keys: list[tuple[str, str]]) -> tuple[QuerySnapshot, ...]:
        """Forget these runs, reading each one's commit log a last time where the JVM still answers."""
        finals = []
        for key in keys:
            execution = self._executions.pop(key)
            try:
                finals.append(self._snapshot(*key, execution))
            except Exception as e:  # noqa: BLE001 - the JVM may be gone with the SparkContext
                log.warning("query %s run %s: cannot read its commit log after it ended: %r", *key, e)
        return tuple(finals)
