"""Spark integration.

- ``foreach(TwoPhaseSink(sink, app=..., zk=...))``: the row-at-a-time writer (twophase/spark/writer.py);
- ``write_stream(df, sink, app=..., zk=...)`` and ``format("twophase-kafka")``: the batch path, Arrow
  batches through ``write_batch`` (twophase/spark/streams.py); ``await_committed(query)`` waits for it;
- ``TwoPhaseBatchSink(sink, app=..., zk=...).write(batch_df, batch_id)``: exactly-once targets inside
  ``foreachBatch`` (twophase/spark/foreach_batch.py);
- ``register(spark)`` adds the ``twophase-kafka`` source and sink and the ``twophase`` sink to a session.
"""

from twophase.spark.driver import HookFailed
from twophase.spark.foreach_batch import TwoPhaseBatchSink
from twophase.spark.stream_sink import DriverHookMissing
from twophase.spark.streams import await_committed, register, write_stream
from twophase.spark.task_context import ContinuousProcessingNotSupported, NotInStream
from twophase.spark.writer import TwoPhaseSink
from twophase.supervisor import Supervision
from twophase.task import PhaseTwoHalted

__all__ = ["ContinuousProcessingNotSupported", "DriverHookMissing", "HookFailed", "NotInStream", "PhaseTwoHalted", "Supervision",
           "TwoPhaseBatchSink", "TwoPhaseSink", "await_committed", "register", "write_stream"]
