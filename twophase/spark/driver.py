"""The driver side of TwoPhaseSink: one hook per app in the driver, made of supervised jobs.

- the query watcher (queries.py) reads what Spark's queries are doing, by polling from
  the hook's own thread, never through Python listener callbacks;
- the progress publisher (publisher.py) writes it to ZooKeeper: checkpoint, runs with
  their liveness node, the barrier;
- in the default ``embedded`` mode, the coordinator host (host.py) runs the app's phase two;
- the waiter (waiter.py) blocks ``TwoPhaseSink.await_committed`` until the watermark moves.

Each background job runs under a :class:`~twophase.supervisor.Supervisor`: a failure is
logged with its cause and retried with backoff; one that persists halts the app's live
runs (their next task fails with the cause, so the query stops with an error naming it)
and ``await_committed`` raises it. Nothing stops silently with rows pre-committed.

Usage (TwoPhaseSink does this)::

    hook = DriverHook.acquire(HookConfig(zk, root, app, secret), sink, spark)
    ...
    hook.release()       # the last release stops the jobs and closes the ZooKeeper client
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from dataclasses import dataclass, field

from kazoo.exceptions import (
    ConnectionClosedError,
    ConnectionLoss,
    KazooException,
    OperationTimeoutError,
    SessionExpiredError,
)
from pyspark.sql import SparkSession
from pyspark.sql.streaming import StreamingQuery

from coordinator.app import AppCoordinator, CommitPolicy, publish_app
from coordinator.layout import AppPaths
from coordinator.zk import at_exit, connect
from twophase.signing import Signer
from twophase.sink import TwoPhaseCommitSink
from twophase.spark.host import CoordinatorHost
from twophase.spark.publisher import ProgressPublisher
from twophase.spark.queries import QueryWatcher
from twophase.spark.waiter import await_watermark
from twophase.supervisor import Supervision, Supervisor

log = logging.getLogger("twophase.driver")

POLL_INTERVAL = 0.25  # seconds between looks at Spark's queries: the barrier's latency

# ZooKeeper being away (or the session being renewed) is waited out; any other ZooKeeper error
# (NoAuth after an ACL change, say) is a failure of the job, retried and then escalated.
ZOOKEEPER_AWAY = (ConnectionLoss, SessionExpiredError, OperationTimeoutError, ConnectionClosedError)


class HookFailed(RuntimeError):
    """A job of the driver hook failed for good; phase two of the app stopped in this driver."""


@dataclass(frozen=True)
class HookConfig:
    """Everything the hook of one app needs; TwoPhaseSink builds it from its arguments."""

    zk: str
    root: str
    app: str
    secret: bytes = field(repr=False)
    mode: str = "embedded"
    policy: CommitPolicy = field(default_factory=CommitPolicy)
    supervision: Supervision = field(default_factory=Supervision)

    @property
    def key(self) -> tuple[str, str, str]:
        """(zk, root, app): what identifies the app whose hook this is."""
        return (self.zk, self.root, self.app)


class DriverHook:
    """The background side of every TwoPhaseSink of one app in this driver (see the module doc).

    Shared by all TwoPhaseSinks of the app: each ``acquire`` is matched by a ``release``,
    and the last release stops it. ``close_all`` stops every hook (also run at exit).
    """

    _hooks: dict[tuple[str, str, str], DriverHook] = {}
    _lock = threading.Lock()

    @classmethod
    def acquire(cls, config: HookConfig, sink: TwoPhaseCommitSink, spark: SparkSession | None) -> DriverHook:
        """The running hook of ``config.app`` (its stored sink and mode refreshed), or a new one."""
        spark = spark or SparkSession.getActiveSession()
        if spark is None:
            raise RuntimeError("TwoPhaseSink must be created on the driver with an active SparkSession")
        with cls._lock:
            hook = cls._hooks.get(config.key)
            if hook is not None and hook.config != config:
                raise ValueError(f"app {config.app} already runs in this driver with other settings "
                                 f"(coordinator mode, secret, policy or supervision); one app, one configuration")
            if hook is not None and not hook._serves():
                # Its SparkContext stopped (the watcher and publisher ended with it) or it failed
                # for good: a new sink gets a working hook.
                del cls._hooks[config.key]
                stale, hook = hook, None
                stale._close()
            if hook is None:
                hook = cls._hooks[config.key] = DriverHook(spark, config, sink)
            else:
                hook.store_sink(sink)
            hook._users += 1
            return hook

    @classmethod
    def current(cls, key: tuple[str, str, str]) -> DriverHook | None:
        """The running hook of (zk, root, app), None if there is none (never acquired, or closed)."""
        with cls._lock:
            return cls._hooks.get(key)

    @classmethod
    def holding(cls, query_id: str) -> list[DriverHook]:
        """The running hooks whose app has state for ``query_id`` in ZooKeeper."""
        with cls._lock:
            hooks = list(cls._hooks.values())
        return [hook for hook in hooks
                if hook.client.retry(hook.client.exists, hook.paths.query(query_id).base) is not None]

    @classmethod
    def close_all(cls) -> None:
        """Stop every hook of this driver (their coordinators finish the current step first)."""
        with cls._lock:
            hooks, cls._hooks = list(cls._hooks.values()), {}
        for hook in hooks:
            hook._close()

    def __init__(self, spark: SparkSession, config: HookConfig, sink: TwoPhaseCommitSink) -> None:
        self.config = config
        self.paths = AppPaths(config.root, config.app)
        self.signer = Signer(config.secret)
        self.owner = f"driver {socket.gethostname()}:{os.getpid()}"
        self.failure: HookFailed | None = None
        self._users = 0
        self.client = connect(config.zk)
        try:
            self.store_sink(sink)
        except BaseException:
            self._close_client()
            raise
        self.watcher = QueryWatcher(spark)
        self.publisher = ProgressPublisher(self.client, self.paths, self.owner)
        self._publisher_job = Supervisor(f"twophase-publisher-{config.app}", self._publish_loop,
                                         on_give_up=lambda e: self._give_up("the progress publisher", e),
                                         supervision=config.supervision)
        self.host: CoordinatorHost | None = None
        if config.mode == "embedded":
            coordinator = AppCoordinator(self.client, config.root, config.app, self.signer, self.owner,
                                         config.policy)
            self.host = CoordinatorHost(coordinator, config.supervision,
                                        on_give_up=lambda e: self._give_up("the embedded coordinator", e))
        self._publisher_job.start()
        if self.host is not None:
            self.host.start()

    def _serves(self) -> bool:
        return self.failure is None and not self._publisher_job.finished

    def store_sink(self, sink: TwoPhaseCommitSink) -> None:
        """Publish ``sink`` (signed) and the coordinator mode in ZooKeeper for every coordinator of the app."""
        publish_app(self.client, self.paths, self.signer, sink, self.config.mode)

    def release(self) -> None:
        """One TwoPhaseSink is done with the hook; the last one stops it."""
        with self._lock:
            self._users -= 1
            if self._users > 0 or self._hooks.get(self.config.key) is not self:
                return
            del self._hooks[self.config.key]
        self._close()

    def _close(self) -> None:
        jobs = [self._publisher_job] + ([self.host.supervisor] if self.host is not None else [])
        self._publisher_job.request_stop()
        self.publisher.woken.set()  # its loop waits on this, not on the stop
        if self.client.connected:
            self._publisher_job.join(10)
        if self.failure is None and self._still_running():
            # Its phase two stops with the hook: refuse further batches rather than pre-commit
            # rows that nothing would commit. Ending the query before closing avoids this.
            if not self.client.connected:  # the request would wait for ZooKeeper's return (an exit would hang)
                log.error("app %s: cannot halt the runs of a closing hook: ZooKeeper is away (their tasks "
                          "wait for it too)", self.config.app)
            else:
                try:
                    self.publisher.halt(f"the TwoPhaseSink of app {self.config.app} was closed in the driver "
                                        f"while its query was still running")
                except KazooException as e:
                    log.error("app %s: cannot halt the runs of a closing hook: %r", self.config.app, e)
        for job in jobs:
            job.request_stop()
        if self.client.connected:  # let a commit in flight finish its step; without ZooKeeper none can
            for job in jobs:
                job.join(10)
        self.publisher.close()
        self._close_client()  # a job blocked on ZooKeeper gets ConnectionClosedError and ends
        for job in jobs:
            job.join(10)
        if self.host is not None:
            self.host.coordinator.close()

    def _still_running(self) -> bool:
        """Whether a run of the app is still going, as Spark says now: the publisher's view is up to a poll
        old, and a query that just ended (its hook released once all was committed) must not be halted."""
        if not self.publisher.live_runs():
            return False
        try:
            seen = self.watcher.poll()
        except Exception as e:  # noqa: BLE001 - Spark going away: keep the publisher's view
            log.debug("app %s: cannot poll the queries a last time: %r", self.config.app, e)
        else:
            self.publisher.update(seen.active, seen.ended)
        return bool(self.publisher.live_runs())

    def _close_client(self) -> None:
        # stop() ends kazoo's connection thread even while ZooKeeper is unreachable, so the
        # interpreter can exit; the runs' ephemeral liveness nodes go with the session.
        self.client.stop()
        self.client.close()

    # -- jobs ---------------------------------------------------------------

    def _publish_loop(self, stop: threading.Event) -> None:
        zookeeper_away = False
        while not stop.is_set():
            self.publisher.woken.clear()  # what happens from here on wakes the next pass
            seen = self.watcher.poll()
            self.publisher.update(seen.active, seen.ended)
            try:
                self.publisher.publish()
            except ZOOKEEPER_AWAY as e:
                # Not a failure of the hook: tasks stall on it too, and the publisher catches up
                # once it is back (failure case 8). Said once, not per poll.
                if not zookeeper_away:
                    log.warning("app %s: cannot publish progress while ZooKeeper is away: %r",
                                self.config.app, e)
                zookeeper_away = True
            else:
                if zookeeper_away:
                    log.info("app %s: ZooKeeper is back; progress published", self.config.app)
                zookeeper_away = False
                if seen.spark_stopped:
                    return
            self.publisher.woken.wait(POLL_INTERVAL)

    def _give_up(self, job: str, error: BaseException) -> None:
        self.failure = HookFailed(f"app {self.config.app}: {job} failed for good, phase two stopped "
                                  f"in this driver: {error!r}")
        self.failure.__cause__ = error
        self.publisher.halt(str(self.failure))

    # -- waiting ------------------------------------------------------------

    def await_committed(self, query: StreamingQuery, timeout: float) -> int | None:
        """Wait until the watermark reaches the last epoch Spark completed for the query.

        None if the query has completed no epoch. Raises HookFailed at once if the hook
        stopped for good, ValueError for a query twophase refuses (async progress tracking).
        Reads the query's own commit log (any checkpoint file system); a query that ended
        before the publisher ever saw it (it ran between two polls) is handed to the publisher
        here, so its checkpoint and last barrier reach the coordinator.
        """
        if self.failure is not None:
            raise self.failure
        snapshot = QueryWatcher.snapshot_of(query._jsq).accepted()
        if not query.isActive:
            self.publisher.update_ended(snapshot)
        if snapshot.last_batch is None:
            return None
        if self.host is not None:
            self.host.wake()
        return await_watermark(self.client, self.paths.query(snapshot.query_id).watermark, snapshot.last_batch,
                               timeout, self.config.app, failure=lambda: self.failure)


at_exit(DriverHook.close_all)
