"""Test harness: plays Spark's tasks and driver hook against a real ZooKeeper, without Spark.

Tasks run through twophase.task.TaskAttempt, the code TwoPhaseSink runs in Spark tasks.
"""

from __future__ import annotations

import threading

from coordinator.app import AppCoordinator, CommitPolicy, publish_app
from coordinator.layout import AppPaths
from coordinator.precommits import PrecommitRegistry
from coordinator.runs import RunRecord
from coordinator.state import EpochRecord
from coordinator.zk import dump, put_data, read_json
from sinks.files import FileSink, read_committed_rows
from twophase.signing import Signer
from twophase.sink import TxnContext
from twophase.task import TaskAttempt

SIGNER = Signer(b"twophase-test-secret-0123456789")
QUERY = "q-1"


class SlotFileSink(FileSink):
    """FileSink names its files by attempt and claims no slots; this one claims them, as a sink that
    names resources by slot (LogSink's transactional ids) does, for the slot tests."""

    uses_slots = True


class Pipeline:
    """Plays the part of Spark tasks and the driver hook for one app."""

    def __init__(self, zk, root, sink, mode="embedded", records_runs=True):
        self.zk = zk
        self.sink = sink
        self.paths = AppPaths(root, "app")
        self.qp = self.paths.query(QUERY)
        self.registry = PrecommitRegistry(zk, self.qp, SIGNER)
        self.coordinators: list[AppCoordinator] = []
        # Whether the hook records each run as in order once its first task opened (its next epoch then proves
        # the one before complete); False plays a run the hook has not recorded.
        self.records_runs = records_runs
        self._recorded: set[str] = set()
        publish_app(zk, self.paths, SIGNER, sink, mode)

    def task(self, run, epoch, partition, ids, attempt=0):
        """One task attempt as TwoPhaseSink runs it; None if it skipped its rows (a winner exists)."""
        task = self.begin(run, epoch, partition, attempt)
        return None if task is None else self.finish(task, ids)

    def begin(self, run, epoch, partition, attempt=0):
        """Open a task attempt (TwoPhaseSink.open); None if it finds a winner and skips its rows."""
        task = TaskAttempt(self.sink, self.registry, TxnContext("app", QUERY, run, epoch, partition, attempt))
        opened = task.open()
        if self.records_runs and run not in self._recorded:
            self.record_run(run)
        return task if opened else None

    def record_run(self, run, in_order=True):
        """What the driver hook writes of a run once it wrote through the app."""
        put_data(self.zk, self.qp.run(run), RunRecord(0.0, "driver", in_order).encode())
        self._recorded.add(run)

    def finish(self, task, ids):
        """Write rows into an open attempt, pre-commit and register it; True if it won."""
        for i in ids:
            task.write({"id": i})
        task.close(None)
        return task.won

    def precommit(self, ctx, ids):
        """A whole task attempt for ``ctx``; True if it won, False if it lost or found a winner."""
        return bool(self.task(ctx.run_id, ctx.epoch, ctx.partition, ids, ctx.attempt))

    def barrier(self, epoch, run):
        put_data(self.zk, self.qp.barrier, dump({"epoch": epoch, "run": run}))

    def coordinator(self, owner="c1", **policy):
        app = AppCoordinator(self.zk, self.paths.root, "app", SIGNER, owner, CommitPolicy(**policy))
        app.acquire()
        self.coordinators.append(app)
        return app

    def close(self):
        """Close the coordinators made here (their sinks' connections go with them)."""
        for app in self.coordinators:
            app.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

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


class CallCounter:
    """Counts calls of a function (reconcile passes, looks for a checkpoint), so a test can await them:
    ``reconcile = counter.wrap(reconcile)``."""

    def __init__(self) -> None:
        self.count = 0
        self._passed = threading.Condition()

    def wrap(self, reconcile):
        def counted(*args, **kwargs):
            try:
                return reconcile(*args, **kwargs)
            finally:
                with self._passed:
                    self.count += 1
                    self._passed.notify_all()
        return counted

    def await_calls(self, n: int) -> None:
        with self._passed:
            assert self._passed.wait_for(lambda: self.count >= n, timeout=30), f"{self.count} calls, awaited {n}"
