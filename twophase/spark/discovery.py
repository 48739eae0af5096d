"""Driver hooks for the batch-path writers, found by watching the session's queries.

A ``foreach(TwoPhaseSink(...))`` query gets its driver hook when the TwoPhaseSink is built. A
query started with ``format("twophase-kafka")`` has no such moment in the driver: its writer is
built in Python workers. So :func:`twophase.spark.register` starts one :class:`WriterDiscovery`
per SparkContext. It polls the active queries (py4j calls into the JVM, never listener callbacks,
as the hook's own watcher: docs/spark-facts.md), reads the sink and the write options of each new
run from its first planned batch, and acquires the app's :class:`~twophase.spark.driver.DriverHook`
(publisher, embedded coordinator) for the formats it knows. :func:`twophase.spark.write_stream`
hands its hook over the same way.

The discovery holds each hook until no query of its app is active and every epoch they completed
is committed; then it releases it (the last release stops the hook). Until then the writer's
``commit`` on the driver finds the run published (twophase/spark/stream_sink.py).

Usage (``register`` does this)::

    discovery = WriterDiscovery.start(spark, {"twophase-kafka": kafka_hook_for})
    discovery.hold(hook)        # a hook acquired elsewhere, kept until its queries are committed
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from pyspark.sql import SparkSession

from coordinator.zk import read_json
from twophase.sink import TwoPhaseCommitSink
from twophase.spark.driver import POLL_INTERVAL, DriverHook, HookConfig
from twophase.spark.queries import QueryWatcher
from twophase.spark.sink_options import WriterOptionError, exactly_once, lowered
from twophase.spark.task_context import CONTINUOUS_REFUSED, ContinuousProcessingNotSupported
from twophase.supervisor import Supervisor

log = logging.getLogger("twophase.driver")

# For a format name: the hook config and sink its write options call for (acquired by the discovery),
# or None when the hook is acquired elsewhere (write_stream holds it here itself).
HookFactory = Callable[[Mapping[str, str]], "tuple[HookConfig, TwoPhaseCommitSink] | None"]


def write_options(jsq) -> tuple[str, dict[str, str]] | None:
    """(sink name, write options with lower-case names) of a query's run, None before its first batch
    is planned. Read from the last planned batch (a ``WriteToMicroBatchDataSource``): reading the
    query's lazy ``logicalPlan`` from this thread could plan it outside its own stream thread."""
    execution = jsq.streamingQuery()
    last = execution.lastExecution()
    if last is None:
        return None
    # Only a Python data source's table (PythonTable) can be ours; other sinks' name() may throw
    # (ForeachBatchSink's and FileStreamSink's do in Spark 4.3: "should not be called").
    if not str(execution.sink().getClass().getName()).endswith(".PythonTable"):
        return "", {}
    if str(execution.getClass().getSimpleName()) == "ContinuousExecution":
        raise ContinuousProcessingNotSupported(CONTINUOUS_REFUSED)  # its plan has no write options to read
    logical = last.logical()
    converted = {}
    iterator = logical.writeOptions().iterator()  # a Scala Map: (key, value) tuples
    while iterator.hasNext():
        pair = iterator.next()
        converted[str(pair._1())] = str(pair._2())
    return str(execution.sink().name()), lowered(converted)



def _stop(jsq, key: tuple[str, str]) -> None:
    """Stop a query twophase refuses; a stop that fails is logged (the query goes on writing nothing)."""
    try:
        jsq.stop()
    except Exception as e:  # noqa: BLE001 - a thread's last word: logged, not lost
        log.error("query %s run %s: twophase could not stop it: %r", *key, e)

@dataclass
class _Held:
    """A hook the discovery holds, and the runs of its app it has seen."""

    hook: DriverHook
    expected: int = 1  # holds made for queries not seen yet (write_stream before its start())
    runs: dict[tuple[str, str], object] = field(default_factory=dict)  # active (query, run) -> JVM handle
    finals: dict[str, int] = field(default_factory=dict)  # query -> last batch of its ended runs (-1: none)


class WriterDiscovery:
    """Watches one session's queries and holds a driver hook per app written through a known format."""

    _running: dict[int, WriterDiscovery] = {}  # by id of the JVM SparkContext
    _lock = threading.Lock()

    @classmethod
    def start(cls, spark: SparkSession, factories: Mapping[str, HookFactory]) -> WriterDiscovery:
        """The session's running discovery (factories added), or a new one."""
        key = id(spark.sparkContext._jsc)
        with cls._lock:
            found = cls._running.get(key)
            # A stopped context's id may be reused by a new one: that discovery is ending.
            if found is None or found._job.finished or found.spark.sparkContext._jsc is not spark.sparkContext._jsc:
                found = cls._running[key] = WriterDiscovery(spark)
                found._job.start()
            found._factories.update(factories)
            return found

    @classmethod
    def stop_all(cls) -> None:
        """Stop every discovery and release the hooks they hold (tests; the hooks' atexit does the rest)."""
        with cls._lock:
            running, cls._running = list(cls._running.values()), {}
        for discovery in running:
            discovery._job.stop()
            discovery._release_all()

    def __init__(self, spark: SparkSession) -> None:
        self.spark = spark
        self._factories: dict[str, HookFactory] = {}
        self._held: dict[tuple[str, str, str], _Held] = {}
        self._seen: set[tuple[str, str]] = set()
        self._lock = threading.Lock()
        self._job = Supervisor("twophase-writer-discovery", self._loop,
                               on_give_up=lambda e: log.error("twophase writer discovery stopped: %r", e))

    def hold(self, hook: DriverHook) -> None:
        """Keep an acquired hook (this discovery now owns that acquire) until its queries are committed."""
        with self._lock:
            held = self._held.get(hook.config.key)
            if held is None or held.hook is not hook:  # none, or a closed one's (failed, close_all)
                self._held[hook.config.key] = _Held(hook)
                return
            held.expected += 1  # not released before that query is seen, ran and is committed
        hook.release()  # held already: one acquire is enough

    def _loop(self, stop: threading.Event) -> None:
        while not stop.is_set():
            if self.spark.sparkContext._jsc is None:
                # Spark stopped: its queries' last epochs may still await their commit, so the hooks
                # stay (their coordinators finish; DriverHook.close_all at exit stops them), as foreach's.
                return
            self._poll()
            stop.wait(POLL_INTERVAL)

    def _poll(self) -> None:
        active = {}
        for jsq in self.spark._jsparkSession.streams().active():
            key = (str(jsq.id().toString()), str(jsq.runId().toString()))
            active[key] = jsq
            if key not in self._seen:
                try:
                    self._discover(key, jsq)
                except Exception as e:  # noqa: BLE001 - one query's trouble must not stop the others'
                    log.warning("query %s run %s: no driver hook yet, retrying: %r", *key, e)
        self._settle(active)

    def _discover(self, key: tuple[str, str], jsq) -> None:
        try:
            found = write_options(jsq)
        except ContinuousProcessingNotSupported as e:
            if str(jsq.streamingQuery().sink().name()) in self._factories:
                # Spark's Python writer drops a continuous query's rows without a call to Python, and the writer's
                # commit refusing each epoch does not fail the query (Spark logs and ignores it): stop it, from a
                # thread of its own, as a stop waits for the query's thread and other queries wait for their hooks.
                log.error("query %s run %s: %s; twophase stops the query. Its checkpoint records the continuous "
                          "epochs' offsets as planned: run it with a micro-batch trigger on a new checkpoint, from "
                          "where the continuous run started", *key, e)
                threading.Thread(target=_stop, args=(jsq, key), name="twophase-stop-continuous", daemon=True).start()
            self._seen.add(key)
            return
        if found is None:
            return  # not planned yet: look again at the next poll
        name, options = found
        if name not in self._factories:
            self._seen.add(key)
            return
        try:
            where = exactly_once(options, also=options)  # unknown names are the writer's to refuse
            made = self._factories[name](options)
        except WriterOptionError as e:
            self._seen.add(key)
            log.debug("query %s: not hooked, its writer refuses its options: %s", key[0], e)
            return  # the writer fails the batch with the same message
        if made is not None:
            try:
                hook = DriverHook.acquire(*made, self.spark)
            except ValueError as e:  # the app runs in this driver with other settings
                self._seen.add(key)
                log.error("query %s: not hooked: %s", key[0], e)
                return
            self.hold(hook)
        self._seen.add(key)  # only now: a failed acquire (ZooKeeper away) is tried again at the next poll
        hook_key = (where.zk, where.root, where.app)
        with self._lock:
            held = self._held.get(hook_key)
            if held is not None:
                held.runs[key] = jsq
                held.expected = max(0, held.expected - 1)

    def _settle(self, active: Mapping[tuple[str, str], object]) -> None:
        """Release each hook whose app has no active query left and whose queries are all committed."""
        with self._lock:
            items = list(self._held.items())
        for hook_key, held in items:
            if DriverHook.current(hook_key) is not held.hook:  # closed under us (DriverHook.close_all)
                with self._lock:
                    self._held.pop(hook_key, None)
                continue
            for run_key, jsq in list(held.runs.items()):
                if run_key not in active:
                    last = QueryWatcher.snapshot_of(jsq).last_batch
                    held.finals[run_key[0]] = max(-1 if last is None else last, held.finals.get(run_key[0], -1))
                    del held.runs[run_key]
            if held.runs or held.expected:
                continue  # a query still runs, or one is yet to be seen (write_stream before start())
            if held.hook.failure is None and not self._committed(held):
                continue
            with self._lock:
                if held.expected:  # a write_stream took it up meanwhile
                    continue
                del self._held[hook_key]
            held.hook.release()

    @staticmethod
    def _committed(held: _Held) -> bool:
        client = held.hook.client
        return all(read_json(client, held.hook.paths.query(query).watermark, {"epoch": -1})["epoch"] >= last
                   for query, last in held.finals.items())

    def _release_all(self) -> None:
        with self._lock:
            held, self._held = list(self._held.values()), {}
        for h in held:
            h.hook.release()
