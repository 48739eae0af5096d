"""Client exceptions: the client's failures, as subclasses of the shared :class:`KafkaError`.

:class:`~twophase.wire.errors.KafkaError` (a broker answered with an error code, ``code``; or the
client gave up) is the base the broker shares; here are the client's refinements of it, and
:func:`error_for`, which picks the right one for an error code.

Example::

    try:
        producer.commit_transaction()
    except ProducerFenced:          # another instance took over the transactional id: stop
        producer.close()
    except KafkaError as e:
        if e.retriable: ...
"""

from __future__ import annotations

from kio.schema.errors import ErrorCode

from twophase.wire.errors import KafkaError


class RetriableError(KafkaError):
    """An error a later attempt may not see (a retriable error code, a lost connection)."""

    retriable = True


class KafkaConnectionError(RetriableError):
    """The connection to a broker failed or was closed."""


class AuthenticationError(KafkaError):
    """The client could not authenticate with the broker, or the broker with the client: not retried
    (another attempt with the same settings fails the same way)."""


class SaslAuthenticationError(AuthenticationError):
    """SASL authentication failed (SASL_AUTHENTICATION_FAILED, 58): a wrong user or password, or a
    mechanism the broker does not enable (UNSUPPORTED_SASL_MECHANISM, 33) or a SASL exchange out of
    order (ILLEGAL_SASL_STATE, 34); ``code`` says which."""

    code = 58


class SslAuthenticationError(AuthenticationError):
    """The broker's TLS certificate was not trusted, or does not name the host connected to."""


class KafkaTimeout(KafkaError):
    """An operation did not succeed before its deadline (the last error is the cause)."""


class ProducerFenced(KafkaError):
    """Another producer with the same transactional id (a newer epoch) took over: this one must stop."""


class TransactionStateError(KafkaError):
    """A transactional method was called in a state that does not allow it."""


class PreparedTxnLost(KafkaError):
    """A prepared transaction cannot be committed: it was aborted or replaced by someone else."""


class TransactionUnknown(PreparedTxnLost):
    """The transaction coordinator no longer knows the transactional id (it expired after
    transactional.id.expiration.ms idle): whether the transaction committed cannot be told."""


class CorruptRecordBatch(KafkaError):
    """A fetched batch the consumer cannot read (CORRUPT_MESSAGE): a bad CRC, records that do not parse,
    compressed records inflating past ``max_inflated_batch_bytes``, or offsets the broker refuses to
    serve because it holds them damaged. ``topic``, ``partition`` and ``base_offset``..``last_offset``
    say where it is (``last_offset`` as the damaged header claims it); the consumer's position stays at
    it. ``next_offset`` is where reading can go on past it: after ``last_offset`` if the batch's CRC
    holds; else, not trusting its header, the next intact batch's base offset in the same response,
    or one offset on.

    Example::

        try:
            messages = consumer.poll()
        except CorruptRecordBatch as e:       # or Consumer(on_corrupt="skip"): skipped, counted, logged
            log.error("%s", e)
            consumer.seek(e.topic, e.partition, e.next_offset)   # accept the loss; poll again
    """

    code = 2

    def __init__(self, topic: str, partition: int, base_offset: int, last_offset: int, reason: str,
                 next_offset: int | None = None) -> None:
        super().__init__(f"corrupt record batch in {topic}-{partition} at offsets {base_offset}..{last_offset}: "
                         f"{reason}")
        self.topic, self.partition = topic, partition
        self.base_offset, self.last_offset = base_offset, last_offset
        self.next_offset = base_offset + 1 if next_offset is None else next_offset
        self.reason = reason


class OffsetOutOfRange(KafkaError):
    """The broker holds no record at a consumer's position (OFFSET_OUT_OF_RANGE), and the consumer was made
    with ``auto_offset_reset="none"``: retention deleted the records there, or the topic was deleted and
    created again (its offsets went backwards). ``topic``, ``partition`` and ``offset`` say where; the
    consumer's position stays there until the caller seeks.

    Example::

        try:
            messages = consumer.poll()
        except OffsetOutOfRange as e:
            log.warning("%s", e)
            consumer.seek(e.topic, e.partition, EARLIEST)   # accept the loss
    """

    code = 1

    def __init__(self, topic: str, partition: int, offset: int) -> None:
        super().__init__(f"offset {offset} of {topic}-{partition} is out of range (OFFSET_OUT_OF_RANGE): "
                         "deleted by retention, or the topic was recreated", 1)
        self.topic, self.partition, self.offset = topic, partition, offset


def error_for(code: int, context: str) -> KafkaError:
    """The exception for a non-zero error code: ProducerFenced, RetriableError or KafkaError."""
    error = ErrorCode(code)
    message = f"{context}: {error.name.upper()} ({int(error)})"
    if error in (ErrorCode.producer_fenced, ErrorCode.invalid_producer_epoch):
        return ProducerFenced(message, error)
    if error.retriable:
        return RetriableError(message, error)
    return KafkaError(message, error)


def check(code: int, context: str) -> None:
    """Raise :func:`error_for` ``code`` unless it is 0."""
    if code:
        raise error_for(code, context)
