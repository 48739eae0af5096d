"""Topic creation and broker start when something fails part-way: nothing half-made is left behind.

- A create the disk or the descriptor limit refuses half-way (CreateTopics, or auto-create by
  Metadata and Produce) is answered KAFKA_STORAGE_ERROR and undone: no topic in Metadata or
  ``topics.json``, no partition directory, no descriptor held.
- Creating a topic does not take a descriptor per partition: segment files are opened when used.
- CreateTopics with validate_only meets the same checks as a real create.
- A start that fails (busy port, bad port, unknown host, damaged ``topics.json``) leaves a fresh
  data directory uncreated and an existing one untouched, and releases its lock and its port.

Example::

    with fd_headroom(40):                      # RLIMIT_NOFILE = descriptors open now + 40
        wire.request(create_topics_request(("many", 100, 1, None)))
    with refused_after(50, monkeypatch):       # the 51st partition log of a create: EMFILE
        ...
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import resource
import socket

import pytest

from twophase.broker import Broker
from twophase.broker.storage import LogManager
from twophase.wire.errors import KafkaStorageError
from twophase.zkserver import free_port

from .batches import batch
from .conftest import WireClient, create_topics_request, metadata_request, only_partition, produce_request

STORAGE_ERROR = KafkaStorageError.code  # 56, KAFKA_STORAGE_ERROR
HEADROOM = 40  # descriptors left for the broker: fewer than one per partition of a PARTITIONS-topic
PARTITIONS = 100


@contextlib.contextmanager
def fd_headroom(extra: int):
    """Lower this process's descriptor limit to the descriptors open now plus ``extra``; restored after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + extra, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@contextlib.contextmanager
def refused_after(opened: int, monkeypatch):
    """Partition logs of a create past the first ``opened`` fail to open, as when out of descriptors."""
    real_open = LogManager._open
    count = [0]

    def open_or_refuse(self, topic, partition, info):
        count[0] += 1
        if count[0] > opened:
            raise OSError(errno.EMFILE, "Too many open files")
        return real_open(self, topic, partition, info)

    with monkeypatch.context() as patch:
        patch.setattr(LogManager, "_open", open_or_refuse)
        yield


def listed_topics(broker: Broker) -> dict:
    with open(os.path.join(broker.data_dir, "topics.json")) as f:
        return json.load(f)["topics"]


def assert_not_created(broker: Broker, wire: WireClient, name: str) -> None:
    [t] = wire.request(metadata_request(12, [name], allow_auto=False)).topics
    assert t.error_code == 3 and not t.partitions  # UNKNOWN_TOPIC_OR_PARTITION
    assert name not in broker.topics()
    assert not os.path.exists(os.path.join(broker.data_dir, "topics.json")) or name not in listed_topics(broker)
    assert not [e for e in os.listdir(broker.data_dir) if e.startswith(f"{name}-")]
    assert not [key for key in broker.call(broker.logs.partitions) if key[0] == name]


def test_create_topics_out_of_descriptors_is_answered_and_undone(broker, topic, monkeypatch):
    with WireClient(broker.port) as wire:
        wire.request(create_topics_request(("other", 1, 1, None)))  # topics.json exists beforehand
        with refused_after(PARTITIONS // 2, monkeypatch):
            [r] = wire.request(create_topics_request((topic, PARTITIONS, 1, None))).topics
        assert r.error_code == STORAGE_ERROR and "Too many open files" in r.error_message
        assert_not_created(broker, wire, topic)
        # The undo closed what it opened, and a topic needs no descriptor per partition: one with
        # more partitions than descriptors to spare is created.
        with fd_headroom(HEADROOM):
            [r] = wire.request(create_topics_request((topic, PARTITIONS, 1, None))).topics
        assert r.error_code == 0 and r.num_partitions == PARTITIONS
        assert listed_topics(broker)[topic]["partitions"] == PARTITIONS
        [t] = wire.request(metadata_request(12, [topic], allow_auto=False)).topics
        assert len(t.partitions) == PARTITIONS
        assert only_partition(wire.request(produce_request(topic, batch([b"v"]), partition=4))).error_code == 0


def test_auto_create_out_of_descriptors_is_answered_and_undone(broker_factory, topic, monkeypatch):
    broker = broker_factory(default_partitions=PARTITIONS)
    with WireClient(broker.port) as wire:
        with refused_after(PARTITIONS // 2, monkeypatch):
            [t] = wire.request(metadata_request(12, [topic], allow_auto=True)).topics
            assert t.error_code == STORAGE_ERROR and not t.partitions
            assert_not_created(broker, wire, topic)
            produced = only_partition(wire.request(produce_request(topic, batch([b"v"]))))
            assert produced.error_code == STORAGE_ERROR
            assert_not_created(broker, wire, topic)
        [t] = wire.request(metadata_request(12, [topic], allow_auto=True)).topics
        assert t.error_code == 0 and len(t.partitions) == PARTITIONS


def test_validate_only_refuses_what_a_create_refuses(broker):
    with WireClient(broker.port) as wire:
        assert wire.request(create_topics_request(("a.b", 1, 1, None))).topics[0].error_code == 0
        for name, code in (("a_b", 17), ("a.b", 36), ("a-b", 0)):  # INVALID_TOPIC_EXCEPTION, TOPIC_ALREADY_EXISTS
            [checked] = wire.request(create_topics_request((name, 1, 1, None), validate_only=True)).topics
            [created] = wire.request(create_topics_request((name, 1, 1, None))).topics
            assert (checked.error_code, created.error_code) == (code, code), name
        [r] = wire.request(create_topics_request(("x", 1, 1, {"no.such.config": "1"}), validate_only=True)).topics
        assert r.error_code == 40  # INVALID_CONFIG
        assert sorted(broker.topics()) == ["a-b", "a.b"]


def snapshot(directory: str) -> dict[str, tuple[int, str | None]]:
    """Every entry under ``directory``: (mtime, content hash of files)."""
    out = {}
    for root, dirs, files in os.walk(directory):
        for name in dirs + files:
            path = os.path.join(root, name)
            digest = None
            if name in files:
                with open(path, "rb") as f:
                    digest = hashlib.sha256(f.read()).hexdigest()
            out[os.path.relpath(path, directory)] = (os.stat(path).st_mtime_ns, digest)
    return out


@pytest.fixture
def busy_port():
    with socket.create_server(("127.0.0.1", 0)) as sock:
        yield sock.getsockname()[1]


@pytest.mark.parametrize("options", [
    pytest.param({"port": "busy"}, id="busy-port"),
    pytest.param({"host": "no-such-host.invalid"}, id="unknown-host"),
    pytest.param({"port": 70000}, id="bad-port"),
])
def test_failed_start_leaves_the_data_directory_as_it_was(tmp_path, busy_port, topic, options):
    options = {k: busy_port if v == "busy" else v for k, v in options.items()}
    fresh = tmp_path / "fresh"
    with pytest.raises((OSError, ValueError)):
        Broker(str(fresh), **options).start()
    assert not fresh.exists()

    existing = str(tmp_path / "existing")
    with Broker(existing) as b:
        b.call(b.create_topic, topic, 2)
        with WireClient(b.port) as wire:
            assert only_partition(wire.request(produce_request(topic, batch([b"v"])))).error_code == 0
    before = snapshot(existing)
    with pytest.raises((OSError, ValueError)):
        Broker(existing, **options).start()
    assert snapshot(existing) == before
    with Broker(existing) as b:  # not locked
        assert b.topics()[topic].partitions == 2


def test_failed_storage_start_releases_lock_and_port(tmp_path, topic):
    data_dir = str(tmp_path / "d")
    with Broker(data_dir) as b:
        b.call(b.create_topic, topic, 1)
    metadata = os.path.join(data_dir, "topics.json")
    with open(metadata, "rb") as f:
        good = f.read()
    with open(metadata, "wb") as f:
        f.write(b"{damaged")
    port = free_port()
    with pytest.raises(ValueError):
        Broker(data_dir, port=port).start()
    with open(metadata, "wb") as f:
        f.write(good)
    with Broker(data_dir, port=port) as b:  # neither the lock nor the port is still held
        assert topic in b.topics()
