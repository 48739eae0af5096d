"""Kafka protocol errors: one base carrying the Kafka error code, and one class per code raised here.

Broker and client share this module. The broker answers a request with ``exc.code`` of what its
storage raised; the client raises these (or its own subclasses, see :mod:`twophase.client.errors`)
for an error code a broker answered. The codes are kio's :class:`~kio.schema.errors.ErrorCode`.

Example::

    try:
        log.append(records, now_ms)
    except KafkaError as exc:
        partition_response.error_code = exc.code       # CorruptRecordError -> 2 (CORRUPT_MESSAGE)
"""

from __future__ import annotations


class KafkaError(Exception):
    """A failure with a Kafka protocol error code.

    Subclasses for one code set ``code`` as a class attribute; others pass it per instance
    (a client's error for the code a broker answered). ``retriable`` says whether a later attempt
    may succeed. Without a code it is UNKNOWN_SERVER_ERROR (-1).

    Example::

        raise KafkaError("EndTxn: INVALID_TXN_STATE (48)", ErrorCode.invalid_txn_state)
    """

    code: int = -1  # UNKNOWN_SERVER_ERROR
    retriable: bool = False

    def __init__(self, message: str = "", code: int | None = None) -> None:
        super().__init__(message or type(self).__name__)
        self.message = message
        if code is not None:
            self.code = code


class OffsetOutOfRangeError(KafkaError):
    """An offset before the log start or after the log end (OFFSET_OUT_OF_RANGE)."""

    code = 1


class CorruptRecordError(KafkaError):
    """A record batch failed structural or CRC validation (CORRUPT_MESSAGE)."""

    code = 2

    def __init__(self, reason: str, position: int | None = None) -> None:
        super().__init__(reason if position is None else f"{reason} (at byte {position})")
        self.reason = reason
        self.position = position


class UnknownTopicOrPartitionError(KafkaError):
    """No such topic, or no such partition of it (UNKNOWN_TOPIC_OR_PARTITION)."""

    code = 3


class MessageTooLargeError(KafkaError):
    """A batch larger than the topic's max.message.bytes (MESSAGE_TOO_LARGE)."""

    code = 10


class InvalidTopicError(KafkaError):
    """A topic name Kafka's naming rules refuse (INVALID_TOPIC_EXCEPTION)."""

    code = 17


class TopicAlreadyExistsError(KafkaError):
    """A create of a topic that exists (TOPIC_ALREADY_EXISTS)."""

    code = 36


class InvalidPartitionsError(KafkaError):
    """A partition count below 1 or above the limit (INVALID_PARTITIONS)."""

    code = 37


class InvalidConfigError(KafkaError):
    """A topic config that is unknown or out of range (INVALID_CONFIG)."""

    code = 40


class OutOfOrderSequenceError(KafkaError):
    """An idempotent batch whose sequence does not follow the last one (OUT_OF_ORDER_SEQUENCE_NUMBER)."""

    code = 45


class InvalidProducerEpochError(KafkaError):
    """A batch from a fenced (older) producer epoch (INVALID_PRODUCER_EPOCH)."""

    code = 47


class InvalidTxnStateError(KafkaError):
    """A transactional request the transaction's state does not allow (INVALID_TXN_STATE)."""

    code = 48


class TransactionCoordinatorFencedError(KafkaError):
    """A marker from an older coordinator epoch (TRANSACTION_COORDINATOR_FENCED)."""

    code = 52


class KafkaStorageError(KafkaError):
    """A disk failure (or out of descriptors) while reading or writing a log (KAFKA_STORAGE_ERROR)."""

    code = 56


class InvalidRecordError(KafkaError):
    """A batch that is well-formed but not acceptable here (INVALID_RECORD)."""

    code = 87
