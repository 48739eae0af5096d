"""Storage of the built-in broker: partition logs of Kafka RecordBatch v2 bytes, producer state, topics,
and the partition side of transactions (markers, last stable offset, aborted-transactions index).

The batch format and the errors with Kafka codes it raises are in :mod:`twophase.wire`.

Example::

    from twophase.broker.storage import LogConfig, LogManager

    manager = LogManager("/tmp/data", LogConfig())
    manager.create_topic("events", partitions=2)
    result = manager.partition("events", 0).append(record_batch_bytes, now_ms=0)
    data = manager.partition("events", 0).read(result.base_offset, max_bytes=1 << 20)
    manager.close()
"""

from .config import LogConfig
from .errors import DataDirLockedError, MetadataFileError
from .log import PartitionLog
from .manager import LogManager, TopicInfo, run_flushes, validate_topic_name
from .producers import ProducerStateManager
from .results import AppendResult, TimestampOffset
from .txnindex import AbortedTxn, TransactionIndex

__all__ = [
    "AbortedTxn",
    "AppendResult",
    "DataDirLockedError",
    "LogConfig",
    "LogManager",
    "MetadataFileError",
    "PartitionLog",
    "ProducerStateManager",
    "TimestampOffset",
    "TopicInfo",
    "TransactionIndex",
    "run_flushes",
    "validate_topic_name",
]
