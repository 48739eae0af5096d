"""Attacks on the broker and the framework: a hostile client, a damaged disk, a careless operator.

Each test runs one attack with real components and asserts the safe outcome. The broker fixtures
(``broker``, ``broker_factory``, ``wire``, ``topic``) and storage release are those of
tests/broker/conftest.py; the ZooKeeper fixtures come from tests/conftest.py.
"""

from tests.broker.conftest import (  # noqa: F401  (fixtures re-exported for this folder)
    broker,
    broker_factory,
    release_storage,
    topic,
    wire,
)
