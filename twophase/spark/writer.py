"""TwoPhaseSink: the ForeachWriter that plugs a TwoPhaseCommitSink into Spark.

Usage::

    query = (df.writeStream
             .foreach(TwoPhaseSink(FileSink("/data/out"), app="orders", zk="127.0.0.1:2181"))
             .option("checkpointLocation", "/data/checkpoints/orders")
             .start())

Each task attempt runs one transaction: open() begins it, process() writes,
close(None) pre-commits and registers the handle in ZooKeeper, close(error)
aborts. Within a run one attempt per (epoch, partition) wins; a later attempt
that finds a winner skips its rows. Constructing the writer on the driver
installs the driver-side hook (listener and, by default, the embedded
coordinator); nothing else is asked of the user.
"""

from __future__ import annotations

from typing import Any

from pyspark.sql import SparkSession
from pyspark.sql.streaming import StreamingQuery

from coordinator.app import CommitPolicy
from coordinator.layout import DEFAULT_ROOT, AppPaths
from coordinator.precommits import PrecommitRegistry
from coordinator.zk import shared_client
from twophase.signing import Signer, load_secret
from twophase.sink import TwoPhaseCommitSink
from twophase.spark.driver import DriverHook, HookConfig
from twophase.spark.sink_options import check_app_settings, check_sink
from twophase.spark.task_context import task_context
from twophase.supervisor import Supervision
from twophase.task import TaskAttempt

class _OnDriver:
    """The default of ``close``'s argument: no error given, so the driver is closing the sink."""


_ON_DRIVER = _OnDriver()


class TwoPhaseSink:
    """A Spark ForeachWriter giving a TwoPhaseCommitSink exactly-once output.

    Args:
        sink: the participant that stores the rows.
        app: names this pipeline's state in ZooKeeper; one app per sink.
        zk: the ZooKeeper connection string.
        root: the znode under which all twophase state lives.
        secret: HMAC secret for payloads in ZooKeeper (see twophase.signing.load_secret).
        coordinator: "embedded" runs phase two in this driver; "daemon" leaves it
            to `twophase coordinator` daemons.
        policy: retry and retention settings of the embedded coordinator.
        supervision: how the driver's background jobs are restarted before the query is halted.
        spark: the session to hook into; the active one by default.

    On the driver, ``close()`` (or leaving a ``with`` block) stops what the sink started
    there: its share of the driver hook and its ZooKeeper client. In Spark tasks, Spark
    calls ``close(error)`` to end the attempt.
    """

    def __init__(self, sink: TwoPhaseCommitSink, app: str, zk: str, root: str = DEFAULT_ROOT,
                 secret: str | bytes | None = None, coordinator: str = "embedded",
                 policy: CommitPolicy | None = None, supervision: Supervision | None = None,
                 spark: SparkSession | None = None) -> None:
        check_sink(sink, takes_rows=True)
        check_app_settings(app, root, coordinator)
        sink.check_target(None)  # foreach hands rows over one at a time: no schema to check here
        self.sink = sink
        self.app = app
        self.zk = zk
        self.root = root
        self._secret = load_secret(secret)
        config = HookConfig(zk, root, app, self._secret, coordinator, policy or CommitPolicy(),
                            supervision or Supervision())
        self._hook: DriverHook | None = DriverHook.acquire(config, sink, spark)

    def __getstate__(self) -> dict[str, Any]:
        # Only what tasks need travels to executors; the driver hook stays home.
        return {k: v for k, v in self.__dict__.items() if k in ("sink", "app", "zk", "root", "_secret")}

    def __enter__(self) -> TwoPhaseSink:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def paths(self) -> AppPaths:
        """The ZooKeeper paths of this app."""
        return AppPaths(self.root, self.app)

    def await_committed(self, query: StreamingQuery, timeout: float = 60.0) -> int | None:
        """Block until every epoch Spark completed for `query` is committed; return the watermark.

        Raises HookFailed if the driver hook stopped for good (the cause is chained), ValueError for a
        query twophase refuses (Spark's async progress tracking).
        """
        if self._hook is None:
            raise RuntimeError("this TwoPhaseSink is closed")
        return self._hook.await_committed(query, timeout)

    # -- ForeachWriter protocol (runs in Spark tasks) ---------------------

    def open(self, partition_id: int, epoch_id: int) -> bool:
        """ForeachWriter.open, in a Spark task: begin this attempt's transaction.

        Returns False (Spark then skips the partition) if an attempt of this run
        already won it; raises PhaseTwoHalted if twophase halted the run, and
        ContinuousProcessingNotSupported under a continuous trigger.
        """
        ctx = task_context(self.app, partition_id, epoch_id)
        registry = PrecommitRegistry(shared_client(self.zk), self.paths.query(ctx.query_id), Signer(self._secret))
        self.attempt = TaskAttempt(self.sink, registry, ctx)
        if not self.attempt.open():
            return False
        # Spark looks up ``process`` on this object for every row: an instance attribute bound to the
        # sink's write shadows the method below, sparing two Python calls per row. close() drops it.
        self.process = self.attempt.row_writer()
        return True

    def process(self, row: Any) -> None:
        """ForeachWriter.process, in a Spark task: write one row into the attempt's transaction.

        Once ``open`` began a transaction, the attempt's :meth:`~twophase.task.TaskAttempt.row_writer`
        takes this method's place on the instance (the per-row path).
        """
        self.attempt.write(row)

    def close(self, error: BaseException | None | _OnDriver = _ON_DRIVER) -> None:
        """In a task (Spark passes ``error``): pre-commit and register, or discard on error.

        On the driver, without an argument: release the driver hook (idempotent).
        """
        if error is _ON_DRIVER:
            hook, self._hook = self.__dict__.get("_hook"), None
            if hook is not None:
                hook.release()
            return
        self.__dict__.pop("process", None)
        attempt = self.__dict__.pop("attempt", None)
        if attempt is not None:
            attempt.close(error)
