"""The driver hook's ZooKeeper side: what Spark did, published where every coordinator reads it.

For each query of the app that has written through it (its query node exists after the
first pre-commit) the publisher records the checkpoint location, the current run with an
ephemeral ``alive`` child, and the barrier: the last epoch Spark completed. It talks to
ZooKeeper only; what Spark did comes in as :class:`~twophase.spark.queries.QuerySnapshot`
values from the query watcher.

Usage::

    publisher = ProgressPublisher(client, AppPaths(root, app), owner="driver host:123")
    publisher.update(watcher.active())   # in the hook's thread, every poll
    publisher.publish()                  # raises KazooException while ZooKeeper is away
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from kazoo.client import KazooClient, KazooState
from kazoo.exceptions import NodeExistsError, NoNodeError

from coordinator.layout import AppPaths
from coordinator.zk import dump
from twophase.spark.queries import QuerySnapshot

log = logging.getLogger("twophase.driver")

# A query is kept until its query node exists (its first pre-commit through this app), or
# forgotten this long after it terminated: it never wrote through this app.
FORGET_AFTER = 60.0


@dataclass
class PublishedQuery:
    """What the publisher knows of one run of one query, and how much of it is in ZooKeeper."""

    run_id: str
    checkpoint: str | None = None
    published_run: bool = False
    barrier: int = -1
    published_barrier: int = -1
    terminated: float | None = None


class ProgressPublisher:
    """Publishes runs, liveness and barriers of the app's queries; halts runs on request."""

    def __init__(self, client: KazooClient, paths: AppPaths, owner: str) -> None:
        self.client = client
        self.paths = paths
        self.owner = owner
        self.queries: dict[str, PublishedQuery] = {}
        self._session_lost = False
        client.add_listener(self._on_state)

    def close(self) -> None:
        """Stop listening to the ZooKeeper session's state."""
        self.client.remove_listener(self._on_state)

    def _on_state(self, state: str) -> None:
        if state == KazooState.LOST:
            self._session_lost = True  # the runs' ephemeral liveness nodes went with the session

    def update(self, active: dict[str, QuerySnapshot]) -> None:
        """Take in the queries Spark runs now; those gone since the last call have terminated."""
        for qid, snap in active.items():
            query = self.queries.get(qid)
            if query is None or query.run_id != snap.run_id:
                query = self.queries[qid] = PublishedQuery(snap.run_id, snap.checkpoint)
            if snap.last_batch is not None:
                query.barrier = max(query.barrier, snap.last_batch)
        now = time.time()
        for qid, query in self.queries.items():
            if qid not in active and query.terminated is None:
                query.terminated = now

    def publish(self) -> None:
        """Bring ZooKeeper up to date; raises KazooException when it cannot (retried by the caller)."""
        if self._session_lost:
            self._session_lost = False
            for query in self.queries.values():
                query.published_run = False
        for qid, query in list(self.queries.items()):
            qp = self.paths.query(qid)
            if not query.published_run:
                if not self.client.exists(qp.base):  # no pre-commit through this app yet
                    if query.terminated and time.time() - query.terminated > FORGET_AFTER:
                        del self.queries[qid]
                    continue
                if query.checkpoint:
                    self.client.set(qp.base, dump({"checkpoint": query.checkpoint}))
                self.client.ensure_path(qp.run(query.run_id))
                self.client.set(qp.run(query.run_id), dump({"started": time.time(), "driver": self.owner}))
                try:
                    self.client.create(f"{qp.run(query.run_id)}/alive", ephemeral=True)
                except NodeExistsError:
                    pass
                query.published_run = True
            if query.barrier > query.published_barrier:
                self.client.ensure_path(qp.barrier)
                self.client.set(qp.barrier, dump({"epoch": query.barrier, "run": query.run_id}))
                query.published_barrier = query.barrier
            if query.terminated:
                self._end_run(qp.run(query.run_id))
                del self.queries[qid]

    def halt(self, reason: str) -> None:
        """Stop every live run of the app: their next task fails with ``reason`` (TaskAttempt.open).

        Only runs of queries that wrote through this app: the watcher sees every query of the
        session, and a query that has not pre-committed yet has nothing waiting for phase two.
        """
        log.error("app %s: phase two stopped in this driver: %s", self.paths.app, reason)
        for qid, query in list(self.queries.items()):
            if query.terminated or not query.published_run:
                continue
            path = self.paths.query(qid).halted(query.run_id)
            try:
                self.client.retry(self.client.create, path, reason.encode(), makepath=True)
            except NodeExistsError:
                pass
            log.error("app %s query %s: run %s halted", self.paths.app, qid, query.run_id)

    def end_runs(self) -> None:
        """Mark every run this publisher made alive as ended (the driver is going away)."""
        for qid, query in self.queries.items():
            if query.published_run:
                self._end_run(self.paths.query(qid).run(query.run_id))

    def _end_run(self, run_path: str) -> None:
        try:
            self.client.delete(f"{run_path}/alive")
        except NoNodeError:
            pass
