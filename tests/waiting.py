"""The one polling helper of the tests: wait for a condition that other threads or processes make true.

    wait_until(lambda: server.connection_count == 0, timeout=10, what="the connection to close")
    record = wait_for(lambda: consumer.poll(timeout_s=0.2), what="a record")   # the truthy value

A test waits for an event this way, with a generous deadline that only a broken run reaches, and
then asserts: never a sleep followed by an assertion, never an elapsed-time bound.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_for(predicate: Callable[[], T], timeout: float = 60.0, interval: float = 0.05,
             what: str = "condition") -> T:
    """Call ``predicate`` every ``interval`` seconds until it returns something truthy, and return that;
    AssertionError naming ``what`` if ``timeout`` seconds pass first. The predicate is called at least
    once, and once more at the deadline, so a slow machine never fails a condition that did come true."""
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        _check_deadline(deadline, timeout, what)
        time.sleep(interval)
    return value


def wait_until(predicate: Callable[[], object], timeout: float = 60.0, interval: float = 0.05,
               what: str = "condition") -> None:
    """Like :func:`wait_for`, without the value."""
    wait_for(predicate, timeout, interval, what)


async def async_wait_for(predicate: Callable[[], T], timeout: float = 60.0, interval: float = 0.01,
                         what: str = "condition") -> T:
    """:func:`wait_for` inside an event loop: the loop runs (and can make the predicate true) meanwhile."""
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        _check_deadline(deadline, timeout, what)
        await asyncio.sleep(interval)
    return value


def _check_deadline(deadline: float, timeout: float, what: str) -> None:
    if time.monotonic() >= deadline:
        raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
