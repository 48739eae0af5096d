"""Storage of the built-in broker: partition logs of Kafka RecordBatch v2 bytes, producer state, topics,
and the partition side of transactions (markers, last stable offset, aborted-transactions index).

Example::

    from twophase.broker.storage import LogConfig, LogManager

    manager = LogManager("/tmp/data", LogConfig())
    manager.create_topic("events", partitions=2)
    result = manager.partition("events", 0).append(record_batch_bytes, now_ms=0)
    data = manager.partition("events", 0).read(result.base_offset, max_bytes=1 << 20)
    manager.close()
"""

from .config import LogConfig
from .errors import (
    CorruptRecordError,
    DataDirLockedError,
    InvalidConfigError,
    InvalidPartitionsError,
    InvalidProducerEpochError,
    InvalidRecordError,
    InvalidTopicError,
    InvalidTxnStateError,
    KafkaError,
    KafkaStorageError,
    MessageTooLargeError,
    OffsetOutOfRangeError,
    OutOfOrderSequenceError,
    TopicAlreadyExistsError,
    TransactionCoordinatorFencedError,
    UnknownTopicOrPartitionError,
)
from .log import PartitionLog
from .manager import LogManager, TopicInfo, run_flushes, validate_topic_name
from .producers import ProducerStateManager
from .records import (
    BatchHeader,
    ControlRecord,
    control_batch,
    iter_batches,
    parse_control_record,
    parse_header,
    set_base_offset,
    validate_batch,
)
from .results import AppendResult, TimestampOffset
from .txnindex import AbortedTxn, TransactionIndex

__all__ = [
    "AbortedTxn",
    "AppendResult",
    "BatchHeader",
    "ControlRecord",
    "CorruptRecordError",
    "DataDirLockedError",
    "InvalidConfigError",
    "InvalidPartitionsError",
    "InvalidProducerEpochError",
    "InvalidRecordError",
    "InvalidTopicError",
    "InvalidTxnStateError",
    "KafkaError",
    "KafkaStorageError",
    "LogConfig",
    "LogManager",
    "MessageTooLargeError",
    "OffsetOutOfRangeError",
    "OutOfOrderSequenceError",
    "PartitionLog",
    "ProducerStateManager",
    "TimestampOffset",
    "TopicAlreadyExistsError",
    "TopicInfo",
    "TransactionCoordinatorFencedError",
    "TransactionIndex",
    "UnknownTopicOrPartitionError",
    "control_batch",
    "iter_batches",
    "parse_control_record",
    "parse_header",
    "run_flushes",
    "set_base_offset",
    "validate_batch",
    "validate_topic_name",
]
