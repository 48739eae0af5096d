"""Test harness: plays Spark's tasks and driver hook against a real ZooKeeper, without Spark."""

from __future__ import annotations

import time

from coordinator.app import AppCoordinator, CommitPolicy, publish_app
from coordinator.layout import AppPaths
from coordinator.precommits import PrecommitRegistry
from coordinator.state import EpochRecord
from coordinator.zk import dump, read_json
from sinks.files import read_committed_rows
from twophase.signing import Signer
from twophase.sink import TxnContext

SIGNER = Signer(b"twophase-test-secret-0123456789")
QUERY = "q-1"


class Pipeline:
    """Plays the part of Spark tasks and the driver hook for one app."""

    def __init__(self, zk, root, sink, mode="embedded"):
        self.zk = zk
        self.sink = sink
        self.paths = AppPaths(root, "app")
        self.qp = self.paths.query(QUERY)
        self.registry = PrecommitRegistry(zk, self.qp, SIGNER)
        publish_app(zk, self.paths, SIGNER, sink, mode)

    def task(self, run, epoch, partition, ids, attempt=0):
        """One task attempt as TwoPhaseSink runs it; None if it skipped its rows (a winner exists)."""
        ctx = TxnContext("app", QUERY, run, epoch, partition, attempt)
        if self.registry.winner(ctx) is not None:
            return None
        return self.precommit(ctx, ids)

    def precommit(self, ctx, ids):
        """Begin, write, pre-commit, register; the loser aborts itself. True if it won."""
        self.registry.intend(ctx)
        handle = self.sink.pre_commit(stage(self.sink, ctx, ({"id": i} for i in ids)))
        won = self.registry.register(ctx, handle)
        if not won:
            self.sink.abort(handle)
            self.registry.forget(ctx)
        return won

    def barrier(self, epoch, run):
        self.zk.ensure_path(self.qp.barrier)
        self.zk.set(self.qp.barrier, dump({"epoch": epoch, "run": run}))

    def coordinator(self, owner="c1", **policy):
        app = AppCoordinator(self.zk, self.paths.root, "app", SIGNER, owner, CommitPolicy(**policy))
        app.acquire()
        return app

    def watermark(self):
        return read_json(self.zk, self.qp.watermark, {"epoch": -1})["epoch"]

    def record(self, epoch):
        return EpochRecord.decode(self.zk.get(self.qp.epoch(epoch))[0])


def stage(sink, ctx, rows):
    """Begin a transaction and write rows into it."""
    txn = sink.begin_transaction(ctx)
    for row in rows:
        sink.write(txn, row)
    return txn


def ids_out(pipe: Pipeline) -> list:
    return [r["id"] for r in read_committed_rows(pipe.sink.path)]


def wait_until(predicate, timeout=60.0, interval=0.05, what="condition"):
    """Poll a cheap predicate with a deadline (the state lives in other processes or threads)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval)
    raise AssertionError(f"timed out waiting for {what}")
