"""Retrying retriable Kafka errors with exponential backoff until a deadline (tenacity underneath).

Example::

    response = retry(lambda: send_once(), timeout_s=30, what="metadata")  # KafkaTimeout if it never works
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from tenacity import RetryError, Retrying, retry_if_exception, stop_after_delay, wait_exponential

from twophase.wire.errors import KafkaError

from .errors import KafkaTimeout

T = TypeVar("T")


def _retriable(exc: BaseException) -> bool:
    return isinstance(exc, KafkaError) and exc.retriable


def retry(call: Callable[[], T], timeout_s: float, what: str) -> T:
    """``call()`` until it returns or raises a non-retriable error; KafkaTimeout after ``timeout_s``."""
    try:
        for attempt in Retrying(retry=retry_if_exception(_retriable), stop=stop_after_delay(timeout_s),
                                wait=wait_exponential(multiplier=0.05, max=1.0)):
            with attempt:
                return call()
    except RetryError as exc:
        last = exc.last_attempt.exception()
        raise KafkaTimeout(f"{what} did not succeed within {timeout_s:g}s: {last}",
                           getattr(last, "code", None)) from last
    raise AssertionError("unreachable")  # Retrying either returns, raises or stops
