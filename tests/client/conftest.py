"""Client test fixtures: the broker fixtures of tests/broker, plus polling helpers.

    def test_x(broker, topic):
        messages = consume_all(Consumer(broker.bootstrap), topic, 3, expected=10)
"""

from __future__ import annotations

import collections
import time

from tests.broker.conftest import broker, broker_factory, topic  # noqa: F401  (fixtures)
from twophase.client import KafkaConnectionError
from twophase.client.connection import Connection


def refuse_requests(monkeypatch, api_key: int, message: str) -> None:
    """From now on (until ``monkeypatch.undo()``), every request of ``api_key`` fails like a lost network."""
    original = Connection.request_many

    def refusing(self, requests, timeout_s=None, while_waiting=None):
        requests = list(requests)
        if any(request.__api_key__ == api_key for request in requests):
            raise KafkaConnectionError(message)
        return original(self, requests, timeout_s, while_waiting)

    monkeypatch.setattr(Connection, "request_many", refusing)


def count_requests(monkeypatch) -> collections.Counter:
    """From now on (until ``monkeypatch.undo()``), count the requests every client sends, by api key."""
    counts: collections.Counter = collections.Counter()
    original = Connection.request_many

    def counting(self, requests, timeout_s=None, while_waiting=None):
        requests = list(requests)
        counts.update(request.__api_key__ for request in requests)
        return original(self, requests, timeout_s, while_waiting)

    monkeypatch.setattr(Connection, "request_many", counting)
    return counts


def drain(consumer, expected: int, timeout_s: float = 15.0, settle_s: float = 0.5) -> list:
    """Poll until ``expected`` messages arrived, then ``settle_s`` longer to catch extra ones."""
    got = []
    deadline = time.monotonic() + timeout_s
    while len(got) < expected and time.monotonic() < deadline:
        got += consumer.poll(timeout_s=0.5)
    settle = time.monotonic() + settle_s
    while time.monotonic() < settle:
        got += consumer.poll(timeout_s=0.2)
    return got


def confluent_drain(consumer, expected: int, timeout_s: float = 20.0, settle_s: float = 1.0) -> list:
    """The same for a confluent_kafka.Consumer: (topic, partition, offset, key, value, headers) tuples."""
    got = []
    deadline = time.monotonic() + timeout_s
    settle_until = None
    while time.monotonic() < deadline:
        m = consumer.poll(0.2)
        if m is not None and m.error() is None:
            got.append((m.topic(), m.partition(), m.offset(), m.key(), m.value(), m.headers() or []))
        if len(got) >= expected and settle_until is None:
            settle_until = time.monotonic() + settle_s
        if settle_until is not None and time.monotonic() > settle_until:
            break
    return got
