"""What Spark's streaming queries are doing, read by polling from the hook's own thread.

The driver hook does not use Python ``StreamingQueryListener`` callbacks: they run on
py4j's Python callback server, which watches its sockets with ``select()`` and dies for
good once the driver holds a descriptor numbered 1024 or more, after which Spark's
stream thread waits forever on the next callback (docs/spark-facts.md). Calls from
Python into the JVM do not go through that server, so the watcher asks instead.

The barrier comes from the query's commit log (``commits/N``, read by Spark itself, so any
checkpoint file system works), not from ``lastProgress``: an idle trigger reports the
*next* batch id there, which has not run. A run's log is listed once; after that each poll
looks for the next batch's entry only (Spark writes them in order), and lists again only when
none came for a few seconds: a listing costs the JVM 3 ms of CPU at 10 entries and 7 ms at the
100 Spark keeps, four times a second. A run that left the active queries since the last poll
is read once more, so the batch it completed just before it stopped is not missed.

A run with async progress tracking (``asyncProgressTrackingEnabled``, which Spark allows with
``foreach`` sinks) is marked refused. It records batches in its log's memory first and writes
the log out once an interval, so its batches count as done before the checkpoint keeps a restart
from running them again. Its snapshots carry no batch, and the driver hook halts the run
(docs/spark-facts.md).

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
import math
import threading
import time
from dataclasses import dataclass, field

from pyspark.sql import SparkSession

log = logging.getLogger("twophase.driver")


# Executions whose commit log gets each batch's commits/N in order, written before Spark moves on. Any other
# (AsyncProgressTrackingMicroBatchExecution, or one Spark adds later) is refused rather than trusted; continuous
# processing's epochs overlap, and its tasks refuse to open anyway (twophase/spark/task_context.py).
IN_ORDER_EXECUTIONS = ("MicroBatchExecution",)
ASYNC_EXECUTION = "AsyncProgressTrackingMicroBatchExecution"
ASYNC_REFUSED = ("Spark runs this query with async progress tracking: it records micro-batches as done before its "
                 "checkpoint holds them, so a restart could run them again differently after twophase committed "
                 "them. twophase refuses it: drop the asyncProgressTrackingEnabled option")
UNKNOWN_REFUSED = ("Spark runs this query with a {execution}, which twophase does not know to record each micro-batch "
                   "in its checkpoint before the next one starts: twophase refuses it")
# A lookup that finds no next batch lists the log again after this many seconds: Spark purges entries older than
# minBatchesToRetain, so after a long enough pause between polls the next one may be gone while later ones exist.
RELIST_AFTER = 5.0


@dataclass(frozen=True)
class QuerySnapshot:
    """One run of a query as Spark reports it."""

    query_id: str
    run_id: str
    checkpoint: str | None
    last_batch: int | None  # the last batch with commits/N in the checkpoint, None before the first
    refused: str | None = None  # why twophase cannot run it (last_batch is then None)

    def accepted(self) -> QuerySnapshot:
        """This snapshot; ValueError with the reason if twophase refuses the run (for ``await_committed``)."""
        if self.refused is not None:
            raise ValueError(self.refused)
        return self


@dataclass
class _Run:
    """A run the watcher follows: its commit log's JVM handle, and the last batch found in it."""

    commit_log: object
    checkpoint: str
    refused: str | None
    last_batch: int | None = None
    listed_at: float = -math.inf  # monotonic time of the last listing

    @classmethod
    def of(cls, execution) -> _Run:
        kind = str(execution.getClass().getSimpleName())
        refused = (None if kind in IN_ORDER_EXECUTIONS else
                   ASYNC_REFUSED if kind == ASYNC_EXECUTION else UNKNOWN_REFUSED.format(execution=kind))
        return cls(execution.commitLog(), str(execution.resolvedCheckpointRoot()), refused)

    def advance(self) -> int | None:
        """The last batch in the commit log: listed at first and every :data:`RELIST_AFTER` seconds while no
        batch follows, else found by looking up the next batch's entry (``get`` reads Spark's in-memory copy
        of an entry it wrote, else the file)."""
        if self.refused is not None:
            return None
        if self.last_batch is not None:
            found = False
            while self.commit_log.get(self.last_batch + 1).isDefined():
                self.last_batch, found = self.last_batch + 1, True
            if found or time.monotonic() - self.listed_at < RELIST_AFTER:
                return self.last_batch
        # The first look, none yet (a run may begin past an emptied log), or a purge may have skipped entries.
        latest, self.listed_at = _latest_batch(self.commit_log), time.monotonic()
        if latest is not None and (self.last_batch is None or latest > self.last_batch):
            self.last_batch = latest
        return self.last_batch


def _latest_batch(commit_log) -> int | None:
    """The highest batch id in a commit log (a listing), None if it is empty."""
    latest = commit_log.getLatestBatchId()
    return int(latest.get()) if latest.isDefined() else None


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
        self._runs: dict[tuple[str, str], _Run] = {}  # by (query, run)

    def poll(self) -> Poll:
        """The active queries, and the final state of runs that ended since the last poll."""
        with self._lock:
            if self.spark_stopped:
                return Poll(ended=self._finals(list(self._runs)), spark_stopped=True)
            active = {}
            for jsq in self.spark._jsparkSession.streams().active():
                key = (str(jsq.id().toString()), str(jsq.runId().toString()))
                run = self._runs.get(key)
                if run is None:
                    run = self._runs[key] = _Run.of(jsq.streamingQuery())
                active[key[0]] = QuerySnapshot(*key, run.checkpoint, run.advance(), run.refused)
            gone = [key for key in self._runs if key[0] not in active or active[key[0]].run_id != key[1]]
            return Poll(active, self._finals(gone))

    @staticmethod
    def snapshot_of(jsq) -> QuerySnapshot:
        """A query's run as its JVM handle reports it, active or ended (any thread): its log listed."""
        return _final(str(jsq.id().toString()), str(jsq.runId().toString()), _Run.of(jsq.streamingQuery()))

    @property
    def spark_stopped(self) -> bool:
        """The session's SparkContext is stopped (PySpark drops its JVM handle on stop)."""
        return self.spark.sparkContext._jsc is None

    def _finals(self, keys: list[tuple[str, str]]) -> tuple[QuerySnapshot, ...]:
        """Forget these runs, listing each one's commit log a last time where the JVM still answers."""
        finals = []
        for key in keys:
            run = self._runs.pop(key)
            try:
                finals.append(_final(*key, run))
            except Exception as e:  # noqa: BLE001 - the JVM may be gone with the SparkContext
                log.warning("query %s run %s: cannot read its commit log after it ended: %r", *key, e)
        return tuple(finals)


def _final(query_id: str, run_id: str, run: _Run) -> QuerySnapshot:
    last = None if run.refused is not None else _latest_batch(run.commit_log)
    return QuerySnapshot(query_id, run_id, run.checkpoint, last, run.refused)
