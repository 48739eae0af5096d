"""Storage-layer exceptions, each carrying the Kafka error code the server returns for it.

Example::

    try:
        log.append(records, now_ms)
    except KafkaError as exc:
        partition_response.error_code = exc.code
"""

from __future__ import annotations


class KafkaError(Exception):
    """Base class: ``code`` is the Kafka protocol error code for the failure."""

    code: int = -1  # UNKNOWN_SERVER_ERROR

    def __init__(self, message: str = "") -> None:
        super().__init__(message or type(self).__name__)
        self.message = message


class OffsetOutOfRangeError(KafkaError):
    code = 1


class CorruptRecordError(KafkaError):
    """A record batch failed structural or CRC validation (CORRUPT_MESSAGE)."""

    code = 2

    def __init__(self, reason: str, position: int | None = None) -> None:
        super().__init__(reason if position is None else f"{reason} (at byte {position})")
        self.reason = reason
        self.position = position


class UnknownTopicOrPartitionError(KafkaError):
    code = 3


class MessageTooLargeError(KafkaError):
    code = 10


class InvalidTopicError(KafkaError):
    code = 17


class TopicAlreadyExistsError(KafkaError):
    code = 36


class InvalidPartitionsError(KafkaError):
    code = 37


class InvalidConfigError(KafkaError):
    code = 40


class OutOfOrderSequenceError(KafkaError):
    code = 45


class InvalidProducerEpochError(KafkaError):
    code = 47


class InvalidTxnStateError(KafkaError):
    code = 48


class TransactionCoordinatorFencedError(KafkaError):
    code = 52


class KafkaStorageError(KafkaError):
    code = 56


class InvalidRecordError(KafkaError):
    code = 87


class DataDirLockedError(RuntimeError):
    """Another process (or LogManager) already holds the data directory."""
