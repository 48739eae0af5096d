"""The driver-side hook that TwoPhaseSink installs: Spark progress into ZooKeeper.

It stores the sink (signed) where any coordinator can load it, listens to
Spark's streaming events, and publishes for each query of the app its
checkpoint location, its runs (with an ephemeral liveness node) and the barrier
(the last epoch Spark reported complete). In the default mode it also runs the
app's coordinator in a thread of this driver.

Listener callbacks only enqueue; a worker thread talks to ZooKeeper and the
JVM, so Spark's listener bus is never blocked by a slow ZooKeeper.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import socket
import threading
import time
from dataclasses import dataclass

from kazoo.client import KazooClient, KazooState
from kazoo.exceptions import KazooException, NodeExistsError, NoNodeError
from kazoo.recipe.watchers import DataWatch
from pyspark.sql import SparkSession
from pyspark.sql.streaming import StreamingQuery, StreamingQueryListener

from coordinator.app import AppCoordinator, CommitPolicy, publish_app
from coordinator.fence import Fenced
from coordinator.layout import AppPaths
from coordinator.zk import connect, dump, read_json
from twophase.checkpoint import last_completed_epoch
from twophase.signing import Signer

log = logging.getLogger("twophase.driver")

# A query event is kept until its query registers in ZooKeeper (its first
# pre-commit), or dropped this long after the query terminated.
_FORGET_AFTER = 60.0


@dataclass
class _QueryInfo:
    run_id: str
    checkpoint: str | None = None
    published_run: bool = False
    barrier: int = -1
    published_barrier: int = -1
    terminated: float | None = None


class DriverHook(StreamingQueryListener):
    _hooks: dict[str, "DriverHook"] = {}
    _lock = threading.Lock()

    @classmethod
    def install(cls, writer, mode: str, policy: CommitPolicy, spark: SparkSession | None) -> str:
        """Install (or refresh) the hook of writer.app in this driver; return its key."""
        spark = spark or SparkSession.getActiveSession()
        if spark is None:
            raise RuntimeError("TwoPhaseSink must be created on the driver with an active SparkSession")
        key = f"{writer.zk}|{writer.root}|{writer.app}"
        with cls._lock:
            hook = cls._hooks.get(key)
            if hook is None:
                hook = cls._hooks[key] = DriverHook(spark, writer, mode, policy)
            else:
                hook.store_sink(writer, mode)
        return key

    @classmethod
    def get(cls, key: str) -> "DriverHook":
        return cls._hooks[key]

    @classmethod
    def close_all(cls) -> None:
        """Stop every hook of this driver (their coordinators finish the current step first)."""
        with cls._lock:
            hooks, cls._hooks = list(cls._hooks.values()), {}
        for hook in hooks:
            hook.close()

    def close(self) -> None:
        self._stop.set()
        if self.coordinator is not None:
            self.coordinator.wake.set()
        self.spark.streams.removeListener(self)
        for thread in self._threads:
            thread.join(10)  # finish the current ZooKeeper step before the client goes
        self.client.stop()
        self.client.close()

    def __init__(self, spark: SparkSession, writer, mode: str, policy: CommitPolicy) -> None:
        self.spark = spark
        self.paths = AppPaths(writer.root, writer.app)
        self.signer = Signer(writer._secret)
        self.client: KazooClient = connect(writer.zk)
        self.owner = f"driver {socket.gethostname()}:{os.getpid()}"
        self.store_sink(writer, mode)
        self._events: queue.Queue = queue.Queue()
        self._queries: dict[str, _QueryInfo] = {}
        self._stop = threading.Event()
        self._session_lost = threading.Event()
        self.client.add_listener(self._on_state)
        self._threads = [threading.Thread(target=self._publish_loop, name=f"twophase-hook-{writer.app}",
                                          daemon=True)]
        self.coordinator: AppCoordinator | None = None
        if mode == "embedded":
            self.coordinator = AppCoordinator(self.client, writer.root, writer.app, self.signer, self.owner, policy)
            self._threads.append(threading.Thread(target=self._coordinate, daemon=True,
                                                  name=f"twophase-coordinator-{writer.app}"))
        for thread in self._threads:
            thread.start()
        spark.streams.addListener(self)

    def store_sink(self, writer, mode: str) -> None:
        publish_app(self.client, self.paths, self.signer, writer.sink, mode)

    def _coordinate(self) -> None:
        try:
            self.coordinator.run(self._stop)
        except Fenced:
            pass  # a newer driver or a daemon owns the app now; it finishes our epochs

    # -- StreamingQueryListener (called on Spark's listener thread) -------

    def onQueryStarted(self, event) -> None:
        self._events.put(("started", str(event.id), str(event.runId), None))

    def onQueryProgress(self, event) -> None:
        progress = event.progress
        self._events.put(("progress", str(progress.id), str(progress.runId), progress.batchId))

    def onQueryIdle(self, event) -> None:
        pass

    def onQueryTerminated(self, event) -> None:
        self._events.put(("terminated", str(event.id), str(event.runId), None))

    # -- publishing ---------------------------------------------------------

    def _on_state(self, state: str) -> None:
        if state == KazooState.LOST:
            self._session_lost.set()  # the runs' ephemeral liveness nodes went with the session

    def _publish_loop(self) -> None:
        while not self._stop.is_set():
            try:
                kind, qid, run_id, batch = self._events.get(timeout=0.5)
                self._apply(kind, qid, run_id, batch)
            except queue.Empty:
                pass
            try:
                self._publish()
            except KazooException as e:
                log.warning("app %s: cannot publish progress yet: %r", self.paths.app, e)

    def _apply(self, kind: str, qid: str, run_id: str, batch: int | None) -> None:
        info = self._queries.get(qid)
        if info is None or info.run_id != run_id:
            info = self._queries[qid] = _QueryInfo(run_id)
            info.checkpoint = self._checkpoint_of(qid)
        if kind == "progress" and batch is not None:
            info.barrier = max(info.barrier, batch)
        elif kind == "terminated":
            info.terminated = time.time()

    def _checkpoint_of(self, qid: str) -> str | None:
        try:
            query = self.spark.streams.get(qid)
            return query._jsq.streamingQuery().resolvedCheckpointRoot() if query else None
        except Exception as e:  # private JVM API: degrade to the other barrier sources
            log.warning("query %s: cannot resolve its checkpoint location: %r", qid, e)
            return None

    def _publish(self) -> None:
        if self._session_lost.is_set():
            self._session_lost.clear()
            for info in self._queries.values():
                info.published_run = False
        for qid, info in list(self._queries.items()):
            qp = self.paths.query(qid)
            if not info.published_run:
                if not self.client.exists(qp.base):  # no pre-commit through this app yet
                    if info.terminated and time.time() - info.terminated > _FORGET_AFTER:
                        del self._queries[qid]  # never wrote through this app: not our query
                    continue
                if info.checkpoint:
                    self.client.set(qp.base, dump({"checkpoint": info.checkpoint}))
                self.client.ensure_path(qp.run(info.run_id))
                self.client.set(qp.run(info.run_id), dump({"started": time.time(), "driver": self.owner}))
                try:
                    self.client.create(f"{qp.run(info.run_id)}/alive", ephemeral=True)
                except NodeExistsError:
                    pass
                info.published_run = True
            if info.barrier > info.published_barrier:
                self.client.ensure_path(qp.barrier)
                self.client.set(qp.barrier, dump({"epoch": info.barrier, "run": info.run_id}))
                info.published_barrier = info.barrier
            if info.terminated:
                try:
                    self.client.delete(f"{qp.run(info.run_id)}/alive")
                except NoNodeError:
                    pass
                del self._queries[qid]

    # -- waiting ----------------------------------------------------------

    def await_committed(self, query: StreamingQuery, timeout: float) -> int | None:
        """Wait until the watermark reaches the last epoch Spark completed for `query`."""
        qid = str(query.id)
        info = self._queries.get(qid)
        checkpoint = ((info and info.checkpoint) or self._checkpoint_of(qid)
                      or read_json(self.client, self.paths.query(qid).base, {}).get("checkpoint"))
        target = last_completed_epoch(checkpoint) if checkpoint else None
        if target is None:
            return None
        reached = threading.Event()
        watermark = self.paths.query(qid).watermark

        def on_change(data, _stat):
            if data and json.loads(data)["epoch"] >= target:
                reached.set()
                return False
            return True

        DataWatch(self.client, watermark, on_change)
        if self.coordinator is not None:
            self.coordinator.wake.set()
        if not reached.wait(timeout):
            current = read_json(self.client, watermark, {"epoch": -1})["epoch"]
            raise TimeoutError(f"app {self.paths.app}: epoch {target} not committed after {timeout}s "
                               f"(watermark {current}); see `twophase status`")
        return target

