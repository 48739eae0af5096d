"""Broker fixtures: a Broker on a free port in a temporary data directory, and a raw wire client.

    def test_x(broker):                  # started, stopped after the test
        Producer({"bootstrap.servers": broker.bootstrap})

    def test_y(broker_factory, tmp_path):
        b = broker_factory(default_partitions=3, data_dir=tmp_path / "d")

    def test_z(wire):                    # raw Kafka protocol over a socket
        response = wire().request(metadata_request(12, ["topic"]))

Test modules import WireClient and the request builders at the end of this file directly.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
import struct
import uuid
from collections.abc import Iterator

import pytest
from kio.index import load_request_schema, load_response_schema
from kio.serial import entity_reader

from twophase.broker import Broker
from twophase.broker.storage import LogManager, PartitionLog
from twophase.wire.codec import build, encode_request, nested


def crash(storage: PartitionLog | LogManager) -> None:
    """Release what a PartitionLog or LogManager holds the way a kill -9 does: every descriptor closed,
    nothing fsynced or written (no index, no snapshot). Tests that simulate a crash by opening the
    directory again may call it on the abandoned object; the fixture below does it for them."""
    if isinstance(storage, LogManager):
        for plog in list(storage._logs.values()):
            crash(plog)
        if storage._lock_fd >= 0:
            os.close(storage._lock_fd)
            storage._lock_fd = -1
        return
    if storage._closed and all(s._file_fd < 0 for s in storage.segments):
        return
    storage._closed = True
    storage._discard_pending_seals()  # their duplicate descriptors
    for segment in storage.segments:
        segment._file_closed = True  # not opened again (segments open their file when used)
        if segment._file_fd >= 0:
            os.close(segment._file_fd)
            segment._file_fd = -1
        index = segment.txn_index
        if index._fd >= 0:
            os.close(index._fd)
            index._fd = -1


@contextlib.contextmanager
def logs_in(directory: str):
    """``open(config=None)`` opens a PartitionLog on ``directory``; every one is released (as by a crash,
    if not closed) when the example ends, before its directory is removed."""
    opened = []

    def open_log(config=None) -> PartitionLog:
        opened.append(PartitionLog(directory, config))
        return opened[-1]

    try:
        yield open_log
    finally:
        for log in opened:
            crash(log)


@pytest.fixture(autouse=True)
def release_storage() -> Iterator[None]:
    """Storage tests open PartitionLogs and LogManagers directly, and many abandon one on purpose to
    play a crash (then open the directory again). Whatever a test leaves open is released at its
    end as a crash would (tests/conftest.py fails a test that leaves descriptors behind).

    A MonkeyPatch of its own: a test's ``monkeypatch.undo()`` must not stop the tracking."""
    opened: list = []
    with pytest.MonkeyPatch.context() as patch:
        for cls in (PartitionLog, LogManager):
            def tracking_init(self, *args, __init=cls.__init__, **kwargs):
                __init(self, *args, **kwargs)  # a failed open releases what it took itself
                opened.append(self)
            patch.setattr(cls, "__init__", tracking_init)
        yield
    for storage in reversed(opened):
        crash(storage)


def with_deleted_head(broker: Broker, topic: str, records: int = 30) -> int:
    """Create ``topic`` (one partition, 1 KiB segments, retention.bytes 1) and write ``records`` records
    of 100 bytes: retention deletes the first segments. Returns the partition's log start offset (> 0)."""
    from twophase.client import (
        Producer,  # the client only where a test writes through it
    )

    broker.create_topic(topic, 1, {"segment.bytes": "1024", "retention.bytes": "1"})
    with Producer(broker.bootstrap) as p:
        for _ in range(records):
            p.send(topic, value=bytes(100), partition=0)
            p.flush()
    start = broker.partition_log(topic, 0).log_start_offset
    assert start > 0
    return start


@pytest.fixture
def broker_factory(tmp_path) -> Iterator:
    started: list[Broker] = []

    def make(data_dir=None, **options) -> Broker:
        directory = data_dir or tmp_path / f"broker-data-{len(started)}"
        b = Broker(str(directory), **options).start()
        started.append(b)
        return b

    yield make
    for b in reversed(started):
        b.stop()


@pytest.fixture
def broker(broker_factory) -> Broker:
    return broker_factory()


@pytest.fixture
def topic() -> str:
    """A fresh topic name per test."""
    return f"t-{uuid.uuid4().hex[:10]}"


class WireClient:
    """A blocking Kafka-protocol client over one socket: requests are kio objects."""

    def __init__(self, port: int, timeout: float = 10.0) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        self.correlation_id = 0

    def send_raw(self, data: bytes) -> None:
        self.sock.sendall(data)

    def send(self, request, client_id: str | None = "wire-test") -> int:
        self.correlation_id += 1
        self.sock.sendall(encode_request(self.correlation_id, request, client_id))
        return self.correlation_id

    def _read_exactly(self, n: int) -> bytes:
        chunks = []
        while n:
            chunk = self.sock.recv(n)
            if not chunk:
                raise ConnectionError("closed by the broker")
            chunks.append(chunk)
            n -= len(chunk)
        return b"".join(chunks)

    def recv_frame(self) -> bytes:
        (size,) = struct.unpack(">i", self._read_exactly(4))
        return self._read_exactly(size)

    def recv(self, request_type, correlation_id: int):
        """Decode the next response frame as the response to a ``request_type`` request."""
        response_type = load_response_schema(request_type.__api_key__, request_type.__version__)
        frame = self.recv_frame()
        header, size = entity_reader(response_type.__header_schema__)(frame, 0)
        assert header.correlation_id == correlation_id
        body, used = entity_reader(response_type)(frame, size)
        assert size + used == len(frame), "trailing bytes after the response"
        return body

    def request(self, request, client_id: str | None = "wire-test"):
        return self.recv(type(request), self.send(request, client_id))

    def is_closed(self) -> bool:
        """True once the broker has closed the connection (waits up to the socket timeout)."""
        try:
            while True:
                data = self.sock.recv(65536)
                if not data:
                    return True
        except (ConnectionResetError, BrokenPipeError):
            return True
        except TimeoutError:
            return False

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> WireClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@pytest.fixture
def wire(broker) -> Iterator:
    clients: list[WireClient] = []

    def connect(port: int | None = None) -> WireClient:
        client = WireClient(port or broker.port)
        clients.append(client)
        return client

    yield connect
    for c in clients:
        c.close()


# -- request builders (any version: fields a version lacks are dropped) ------------------------

MS = datetime.timedelta(milliseconds=1)


def req(api_key: int, version: int, **fields):
    return build(load_request_schema(api_key, version), **fields)


def sub(api_key: int, version: int, class_name: str, /, **fields):
    return build(nested(load_request_schema(api_key, version), class_name), **fields)


def metadata_request(version: int, topics=None, allow_auto=True):
    if topics is not None:
        topics = tuple(sub(3, version, "MetadataRequestTopic", name=t, topic_id=None) for t in topics)
    elif version == 0:
        topics = ()
    return req(3, version, topics=topics, allow_auto_topic_creation=allow_auto,
               include_cluster_authorized_operations=False, include_topic_authorized_operations=False)


def produce_request(topic: str, records: bytes, partition: int = 0, acks: int = -1, version: int = 9):
    part = sub(0, version, "PartitionProduceData", index=partition, records=records)
    return req(0, version, transactional_id=None, acks=acks, timeout=30_000 * MS,
               topic_data=(sub(0, version, "TopicProduceData", name=topic, partition_data=(part,)),))


def fetch_request(topic: str, offset: int, partition: int = 0, max_wait_ms: int = 0, min_bytes: int = 1,
                  max_bytes: int = 1 << 20, partition_max_bytes: int = 1 << 20, version: int = 12,
                  session_id: int = 0, session_epoch: int = -1):
    part = sub(1, version, "FetchPartition", partition=partition, current_leader_epoch=-1, fetch_offset=offset,
               last_fetched_epoch=-1, log_start_offset=-1, partition_max_bytes=partition_max_bytes)
    return req(1, version, replica_id=-1, max_wait=max_wait_ms * MS, min_bytes=min_bytes, max_bytes=max_bytes,
               isolation_level=0, session_id=session_id, session_epoch=session_epoch,
               topics=(sub(1, version, "FetchTopic", topic=topic, partitions=(part,)),),
               forgotten_topics_data=(), rack_id="")


def list_offsets_request(topic: str, timestamp: int, partition: int = 0, version: int = 7):
    part = sub(2, version, "ListOffsetsPartition", partition_index=partition, current_leader_epoch=-1,
               timestamp=timestamp)
    return req(2, version, replica_id=-1, isolation_level=0,
               topics=(sub(2, version, "ListOffsetsTopic", name=topic, partitions=(part,)),))


def create_topics_request(*topics, version: int = 7, validate_only: bool = False):
    Topic = nested(load_request_schema(19, version), "CreatableTopic")
    Config = nested(load_request_schema(19, version), "CreatableTopicConfig")
    entries = tuple(build(Topic, name=name, num_partitions=n, replication_factor=rf, assignments=(),
                          configs=tuple(build(Config, name=k, value=v) for k, v in (configs or {}).items()))
                    for name, n, rf, configs in topics)
    return req(19, version, topics=entries, timeout=10_000 * MS, validate_only=validate_only)


def only_partition(response):
    [topic] = response.responses
    [partition] = topic.partitions if hasattr(topic, "partitions") else topic.partition_responses
    return partition
