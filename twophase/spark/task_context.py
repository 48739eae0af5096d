"""The running Spark task as a twophase attempt: what every twophase writer reads from TaskContext.

Inside a task of a streaming micro-batch, Spark's local properties name the query
(``sql.streaming.queryId``, stable across restarts), the run (``spark.jobGroup.id``, new on every
start) and the epoch (``streaming.sql.batchId``); docs/spark-facts.md. Both the ``foreach`` writer and
the batch path's writers build their TxnContext here::

    ctx = task_context("orders")              # in a task: epoch and partition are the task's
    ctx = task_context("orders", partition_id, epoch_id)   # ForeachWriter.open's arguments
"""

from __future__ import annotations

from pyspark import TaskContext

from twophase.sink import TxnContext


class ContinuousProcessingNotSupported(RuntimeError):
    """A twophase writer was used with trigger(continuous=...), which has no micro-batch barriers."""


CONTINUOUS_REFUSED = ("twophase needs micro-batch epochs as commit barriers; "
                      "use a micro-batch trigger instead of trigger(continuous=...)")


class NotInStream(RuntimeError):
    """A twophase writer ran outside a streaming query's micro-batch: there is no epoch to commit on."""


def task_context(app: str, partition: int | None = None, epoch: int | None = None) -> TxnContext:
    """The running Spark task's attempt as a TxnContext (``partition`` and ``epoch`` default to the task's).

    Raises ContinuousProcessingNotSupported under a continuous trigger, and NotInStream outside a
    streaming micro-batch.
    """
    task = TaskContext.get()
    if task.getLocalProperty("__is_continuous_processing") == "true":
        raise ContinuousProcessingNotSupported(CONTINUOUS_REFUSED)
    if epoch is None and task.getLocalProperty("streaming.sql.batchId") is None:
        raise NotInStream("twophase writes the micro-batches of a streaming query: use writeStream, or write "
                          "from foreachBatch with TwoPhaseBatchSink, not a batch DataFrame's write")
    return TxnContext(
        app=app,
        query_id=task.getLocalProperty("sql.streaming.queryId"),
        run_id=task.getLocalProperty("spark.jobGroup.id"),
        epoch=int(task.getLocalProperty("streaming.sql.batchId")) if epoch is None else epoch,
        partition=task.partitionId() if partition is None else partition,
        attempt=task.attemptNumber(),
    )
