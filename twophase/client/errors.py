"""Client exceptions: Kafka error codes as exceptions, plus the client's own failures.

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


class KafkaError(Exception):
    """A broker answered with an error code (``code``), or the client gave up (``retriable`` says if a
    later attempt may succeed)."""

    retriable = False

    def __init__(self, message: str, code: ErrorCode | None = None) -> None:
        super().__init__(message)
        self.code = code


class RetriableError(KafkaError):
    retriable = True


class KafkaConnectionError(RetriableError):
    """The connection to a broker failed or was closed."""


class KafkaTimeout(KafkaError):
    """An operation did not succeed before its deadline (the last error is the cause)."""


class ProducerFenced(KafkaError):
    """Another producer with the same transactional id (a newer epoch) took over: this one must stop."""


class TransactionStateError(KafkaError):
    """A transactional method was called in a state that does not allow it."""


class PreparedTxnLost(KafkaError):
    """A prepared transaction cannot be committed: it was aborted or replaced by someone else."""


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
