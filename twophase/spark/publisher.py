"""The driver hook's ZooKeeper side: what Spark did, published where every coordinator reads it.

For each run of a query of the app that has written through it (its query node exists
after the first pre-commit) the publisher records the checkpoint location, the run (whether it
runs in order, :class:`~coordinator.runs.RunRecord`) with an ephemeral ``alive`` child while it
lasts, and the barrier: the last epoch Spark completed.
It talks to ZooKeeper only; what Spark did comes in as
:class:`~twophase.spark.queries.QuerySnapshot` values from the query watcher.

Usage::

    publisher = ProgressPublisher(client, AppPaths(root, app), owner="driver host:123")
    seen = watcher.poll()
    publisher.update(seen.active, seen.ended)   # in the hook's thread, every poll
    publisher.publish()                         # raises KazooException while ZooKeeper is away
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from kazoo.client import KazooClient, KazooState
from kazoo.exceptions import NodeExistsError, NoNodeError

from coordinator.layout import AppPaths
from coordinator.runs import RunRecord
from coordinator.zk import dump, put_data
from twophase.spark.queries import QuerySnapshot

log = logging.getLogger("twophase.driver")

# A run is kept until its query node exists (its first pre-commit through this app), or
# forgotten this long after it ended: it never wrote through this app.
FORGET_AFTER = 60.0


@dataclass
class PublishedRun:
    """What the publisher knows of one run of one query, and how much of it is in ZooKeeper."""

    query_id: str
    run_id: str
    checkpoint: str | None = None
    published: bool = False
    barrier: int = -1
    ended: float | None = None
    halted: bool = False  # its halted node is written
    refused: str | None = None  # why twophase cannot run it (QuerySnapshot.refused): halted once published


class ProgressPublisher:
    """Publishes runs, liveness and barriers of the app's queries; halts runs on request.

    ``update`` and ``publish`` run in the hook's publisher thread; ``halt`` may come from
    another job's supervisor, so the run table is guarded by a lock.
    """

    def __init__(self, client: KazooClient, paths: AppPaths, owner: str) -> None:
        self.client = client
        self.paths = paths
        self.owner = owner
        self.runs: dict[tuple[str, str], PublishedRun] = {}
        self.halted: str | None = None  # once set, every run published from then on is halted too
        self._barriers: dict[str, int] = {}  # per query: the barrier in ZooKeeper (never moves back)
        # Per query with no node yet, whether its exists watch fired since the publisher last asked: a query of
        # the session that never writes through the app costs one watched exists, not one per poll.
        self._unwritten: dict[str, bool] = {}
        # Set when such a node appears (a run's first task opened): the publisher's loop publishes at once, so that
        # a run to halt is halted before its first micro-batch ends, not up to a poll later.
        self.woken = threading.Event()
        self._lock = threading.RLock()
        self._session_lost = False
        client.add_listener(self._on_state)

    def close(self) -> None:
        self.client.remove_listener(self._on_state)

    def _on_state(self, state: str) -> None:
        if state == KazooState.LOST:
            self._session_lost = True  # the runs' ephemeral liveness nodes went with the session

    def update(self, active: Mapping[str, QuerySnapshot], ended: Iterable[QuerySnapshot] = ()) -> None:
        """Take in the runs Spark has now and those that ended (with their final commit log)."""
        with self._lock:
            for snap in active.values():
                self._take(snap, ended=False)
            for snap in ended:
                self._take(snap, ended=True)
            live = {(s.query_id, s.run_id) for s in active.values()}
            for key, run in self.runs.items():
                if key not in live and run.ended is None:
                    run.ended = time.time()

    def update_ended(self, snap: QuerySnapshot) -> None:
        """Take in one run that has ended, whether or not a poll ever saw it active."""
        with self._lock:
            self._take(snap, ended=True)

    def _take(self, snap: QuerySnapshot, ended: bool) -> None:
        run = self.runs.setdefault((snap.query_id, snap.run_id),
                                   PublishedRun(snap.query_id, snap.run_id, snap.checkpoint, refused=snap.refused))
        if snap.last_batch is not None:
            run.barrier = max(run.barrier, snap.last_batch)
        if ended and run.ended is None:
            run.ended = time.time()

    def publish(self) -> None:
        """Bring ZooKeeper up to date; raises KazooException when it cannot (retried by the caller)."""
        with self._lock:
            if self._session_lost:
                self._session_lost = False
                self._unwritten.clear()  # their watches went with the session
                for run in self.runs.values():
                    run.published = False
            for key, run in list(self.runs.items()):
                qp = self.paths.query(run.query_id)
                if not run.published:
                    if not self._written(run.query_id):  # no pre-commit through this app yet
                        if run.ended and time.time() - run.ended > FORGET_AFTER:
                            del self.runs[key]
                            if all(r.query_id != run.query_id for r in self.runs.values()):
                                self._unwritten.pop(run.query_id, None)
                        continue
                    self._publish_run(run)
                if (self.halted is not None or run.refused is not None) and run.ended is None and not run.halted:
                    self._halt_run(run)
                if run.barrier > self._barriers.get(run.query_id, -1):
                    put_data(self.client, qp.barrier, dump({"epoch": run.barrier, "run": run.run_id}), retry=False)
                    self._barriers[run.query_id] = run.barrier
                if run.ended:
                    self._end_run(qp.run(run.run_id))
                    del self.runs[key]

    def _written(self, query_id: str) -> bool:
        """Whether the query's node exists; asked again only once the watch the last answer set fired."""
        if self._unwritten.get(query_id) is False:
            return False  # still absent: its creation would have fired the watch

        def fired(_event: object) -> None:
            if query_id in self._unwritten:  # not once found (a data watch on the node then)
                self._unwritten[query_id] = True
                self.woken.set()

        self._unwritten[query_id] = False  # before asking, so that a creation right after the answer counts
        try:
            found = self.client.exists(self.paths.query(query_id).base, watch=fired) is not None
        except BaseException:
            self._unwritten.pop(query_id, None)  # no watch is set: ask again next time
            raise
        if found:
            self._unwritten.pop(query_id, None)
        return found

    def _publish_run(self, run: PublishedRun) -> None:
        qp = self.paths.query(run.query_id)
        if run.checkpoint:
            self.client.set(qp.base, dump({"checkpoint": run.checkpoint}))
        self.client.ensure_path(qp.run(run.run_id))
        # in_order: Spark writes this run's commits/N before batch N + 1 starts, so the coordinator may take the
        # run's next epoch as proof that N is complete; a refused run's may prove nothing (coordinator/runs.py).
        record = RunRecord(time.time(), self.owner, in_order=run.refused is None)
        self.client.set(qp.run(run.run_id), record.encode())
        if run.ended is None:
            try:
                self.client.create(f"{qp.run(run.run_id)}/alive", ephemeral=True)
            except NodeExistsError:
                pass
        run.published = True

    def halt(self, reason: str) -> None:
        """Stop every live run of the app: their next task fails with ``reason`` (TaskAttempt.open).

        Runs published later are halted as they are published, and a write ZooKeeper refused
        is made again by the next ``publish``. Only runs of queries that wrote through this
        app: the watcher sees every query of the session. Raises KazooException if
        ZooKeeper is away (the halt stays recorded).
        """
        log.error("app %s: phase two stopped in this driver: %s", self.paths.app, reason)
        with self._lock:
            self.halted = reason
            for run in list(self.runs.values()):
                if run.published and run.ended is None and not run.halted:
                    self._halt_run(run)

    def live_runs(self) -> list[PublishedRun]:
        """Runs that wrote through the app and have not ended, as of the last update."""
        with self._lock:
            return [run for run in self.runs.values() if run.published and run.ended is None]

    def _halt_run(self, run: PublishedRun) -> None:
        path = self.paths.query(run.query_id).halted(run.run_id)
        reason = run.refused or self.halted or ""
        try:
            self.client.create(path, reason.encode(), makepath=True)
        except NodeExistsError:
            pass
        run.halted = True
        log.error("app %s query %s: run %s halted: %s", self.paths.app, run.query_id, run.run_id, reason)

    def _end_run(self, run_path: str) -> None:
        try:
            self.client.delete(f"{run_path}/alive")
        except NoNodeError:
            pass
