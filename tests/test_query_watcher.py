"""The query watcher against stand-ins for Spark's JVM objects: what it reads of a commit log, and when."""

from __future__ import annotations

from twophase.spark import queries
from twophase.spark.queries import QueryWatcher


class Option:
    """A Scala Option as py4j hands it over."""

    def __init__(self, value: int | None) -> None:
        self.value = value

    def isDefined(self) -> bool:  # noqa: N802 - Scala's name
        return self.value is not None

    def get(self) -> int:
        assert self.value is not None, "get() of None"
        return self.value


class CommitLog:
    """Spark's commit log: its batches, and how often it was listed or looked up."""

    def __init__(self, *batches: int) -> None:
        self.batches = set(batches)
        self.listings = 0
        self.lookups = 0

    def getLatestBatchId(self) -> Option:  # noqa: N802
        self.listings += 1
        return Option(max(self.batches, default=None))

    def get(self, batch: int) -> Option:
        self.lookups += 1
        return Option(batch if batch in self.batches else None)


class Execution:
    """A StreamExecution of the given class."""

    def __init__(self, kind: str, commit_log: CommitLog) -> None:
        self.kind, self.log = kind, commit_log

    def getClass(self):  # noqa: N802
        kind = self.kind
        return type("JavaClass", (), {"getSimpleName": staticmethod(lambda: kind)})

    def commitLog(self) -> CommitLog:  # noqa: N802
        return self.log

    def resolvedCheckpointRoot(self) -> str:  # noqa: N802
        return "file:/ck"


class Query:
    """A StreamingQueryWrapper: ids and its execution."""

    def __init__(self, query_id: str, run_id: str, execution: Execution) -> None:
        self.ids, self.execution = (query_id, run_id), execution

    def id(self):
        return type("UUID", (), {"toString": staticmethod(lambda: self.ids[0])})

    def runId(self):  # noqa: N802
        return type("UUID", (), {"toString": staticmethod(lambda: self.ids[1])})

    def streamingQuery(self) -> Execution:  # noqa: N802
        return self.execution


class Spark:
    """A session whose active queries the test sets."""

    def __init__(self) -> None:
        self.active: list[Query] = []
        spark = self
        self.sparkContext = type("SparkContext", (), {"_jsc": object()})
        self._jsparkSession = type("JSparkSession", (), {"streams": staticmethod(lambda: type(
            "Manager", (), {"active": staticmethod(lambda: list(spark.active))}))})


def test_a_commit_log_is_listed_once_then_only_the_next_batches_are_looked_up():
    log = CommitLog(0, 1, 2, 3)
    spark = Spark()
    spark.active = [Query("q", "r1", Execution("MicroBatchExecution", log))]
    watcher = QueryWatcher(spark)
    assert watcher.poll().active["q"].last_batch == 3
    assert (log.listings, log.lookups) == (1, 0)
    assert watcher.poll().active["q"].last_batch == 3
    assert (log.listings, log.lookups) == (1, 1)  # batch 4: not yet
    log.batches |= {4, 5}  # two batches between polls
    assert watcher.poll().active["q"].last_batch == 5
    assert (log.listings, log.lookups) == (1, 4)  # 4, 5, and 6: not yet


def test_a_run_whose_next_batch_was_purged_between_polls_is_listed_again(monkeypatch):
    """Spark purges entries below minBatchesToRetain as batches start: after a long pause between polls the
    next batch's entry may be gone while later ones exist."""
    log = CommitLog(0, 1, 2, 3)
    spark = Spark()
    spark.active = [Query("q", "r1", Execution("MicroBatchExecution", log))]
    watcher = QueryWatcher(spark)
    assert watcher.poll().active["q"].last_batch == 3
    log.batches = set(range(200, 301))
    assert watcher.poll().active["q"].last_batch == 3  # the lookup of 4 misses: listed again a few seconds on
    monkeypatch.setattr(queries, "RELIST_AFTER", 0.0)
    assert watcher.poll().active["q"].last_batch == 300
    assert log.listings == 2


def test_a_run_without_batches_is_listed_until_its_first_one_and_an_ended_run_a_last_time():
    log = CommitLog()
    spark = Spark()
    spark.active = [Query("q", "r1", Execution("MicroBatchExecution", log))]
    watcher = QueryWatcher(spark)
    assert watcher.poll().active["q"].last_batch is None
    log.batches.add(7)  # a restarted run may begin past an emptied log: no lookup of batch 0 would find it
    assert watcher.poll().active["q"].last_batch == 7
    log.batches.add(8)
    spark.active = []
    seen = watcher.poll()
    assert seen.active == {} and [(s.run_id, s.last_batch) for s in seen.ended] == [("r1", 8)]
    assert log.listings == 3


def test_a_run_with_async_progress_tracking_is_refused_and_its_log_never_read():
    log = CommitLog(0, 1, 2)  # as Spark's in-memory copy reports it: the file holds fewer
    spark = Spark()
    spark.active = [Query("q", "r1", Execution("AsyncProgressTrackingMicroBatchExecution", log))]
    watcher = QueryWatcher(spark)
    snap = watcher.poll().active["q"]
    assert snap.last_batch is None
    assert "async progress tracking" in snap.refused and "asyncProgressTrackingEnabled" in snap.refused
    for other in ("SomeFutureExecution", "ContinuousExecution"):  # continuous epochs overlap: not in order either
        assert other in QueryWatcher.snapshot_of(Query("q2", "r1", Execution(other, log))).refused
    spark.active = []
    (final,) = watcher.poll().ended
    assert final.last_batch is None and final.refused == snap.refused
    assert QueryWatcher.snapshot_of(Query("q", "r1", Execution("AsyncProgressTrackingMicroBatchExecution", log))
                                    ).last_batch is None
    assert (log.listings, log.lookups) == (0, 0)
