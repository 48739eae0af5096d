"""read_committed over the wire: hand-built transactional batches and their markers appended to the
partition directly (so the test controls the interleaving the coordinator would otherwise decide;
test_txn_interop.py goes through the coordinator), then raw Fetch/ListOffsets and real consumers
(confluent-kafka, kafka-python, aiokafka) in both isolation levels."""

from __future__ import annotations

import asyncio
import dataclasses
import select
import time

import pytest
from aiokafka import AIOKafkaConsumer
from aiokafka import TopicPartition as AioTopicPartition
from confluent_kafka import Consumer, TopicPartition
from kafka import KafkaConsumer
from kafka import TopicPartition as KpTopicPartition

from .batches import batch, decode
from .conftest import MS, WireClient, fetch_request, only_partition, req, sub

READ_UNCOMMITTED, READ_COMMITTED = 0, 1


class TxnWriter:
    """Produces sequenced batches of one producer id (from InitProducerId) and ends its transactions."""

    def __init__(self, broker, client: WireClient, topic: str) -> None:
        self.broker, self.client, self.topic = broker, client, topic
        if topic not in broker.call(broker.topics):
            broker.call(broker.create_topic, topic, 1)
        response = client.request(req(22, 4, transactional_id=None, transaction_timeout=60_000 * MS,
                                      producer_id=-1, producer_epoch=-1))
        assert response.error_code == 0
        self.pid, self.epoch, self.seq = response.producer_id, response.producer_epoch, 0

    def send(self, *values: bytes, transactional: bool = True, timestamp: int = 1_000) -> int:
        records = batch(list(values), producer_id=self.pid, producer_epoch=self.epoch, base_sequence=self.seq,
                        transactional=transactional, timestamp=timestamp)

        def append() -> int:
            result = self.broker.partition_log(self.topic, 0).append(records, int(time.time() * 1000))
            self.broker.data_arrived(self.topic, 0)
            return result.base_offset

        base_offset = self.broker.call(append)
        self.seq += len(values)
        return base_offset

    def end(self, commit: bool) -> int:
        def write_marker() -> int:
            offset = self.broker.partition_log(self.topic, 0).append_marker(
                self.pid, self.epoch, commit, coordinator_epoch=0, now_ms=int(time.time() * 1000))
            self.broker.data_arrived(self.topic, 0)
            return offset

        return self.broker.call(write_marker)


def committed_fetch(topic: str, offset: int, **options):
    request = fetch_request(topic, offset, **options)
    return dataclasses.replace(request, isolation_level=READ_COMMITTED)


def list_offsets(client: WireClient, topic: str, timestamp: int, isolation_level: int, version: int = 7):
    part = sub(2, version, "ListOffsetsPartition", partition_index=0, current_leader_epoch=-1, timestamp=timestamp)
    response = client.request(req(2, version, replica_id=-1, isolation_level=isolation_level,
                                  topics=(sub(2, version, "ListOffsetsTopic", name=topic, partitions=(part,)),)))
    [topic_response] = response.topics
    [partition] = topic_response.partitions
    assert partition.error_code == 0
    return partition.offset


@pytest.fixture
def scenario(broker, wire, topic):
    """Interleaved transactions, all completed, ending with a committed sentinel; returns the expected views."""
    client = wire()
    a, b, plain = TxnWriter(broker, client, topic), TxnWriter(broker, client, topic), TxnWriter(broker, client, topic)
    a.send(b"a1", b"a2")
    b.send(b"b1")
    plain.send(b"p1", transactional=False)
    a.send(b"a3")
    b.send(b"b2", b"b3")
    b.end(commit=False)
    a.end(commit=True)
    b.send(b"b4")
    a.send(b"a4")
    b.end(commit=False)
    a.send(b"a5")
    a.end(commit=True)
    plain.send(b"END", transactional=False)
    committed = [b"a1", b"a2", b"p1", b"a3", b"a4", b"a5", b"END"]
    everything = [b"a1", b"a2", b"b1", b"p1", b"a3", b"b2", b"b3", b"b4", b"a4", b"a5", b"END"]
    return client, b.pid, committed, everything


def test_raw_fetch_reports_lso_and_aborted_transactions(broker, scenario, topic):
    client, b_pid, committed, everything = scenario
    hw = broker.call(lambda: broker.partition_log(topic, 0).high_watermark)
    uncommitted = only_partition(client.request(fetch_request(topic, 0)))
    assert uncommitted.aborted_transactions is None
    assert uncommitted.last_stable_offset == uncommitted.high_watermark == hw
    assert [v for *_, v in decode(uncommitted.records)] == everything  # control records are not data
    response = only_partition(client.request(committed_fetch(topic, 0)))
    assert response.last_stable_offset == hw
    assert [(t.producer_id, t.first_offset) for t in response.aborted_transactions] == [(b_pid, 2), (b_pid, 9)]
    # From past b's first abort marker (offset 7) only its second aborted transaction overlaps.
    later = only_partition(client.request(committed_fetch(topic, 8)))
    assert [(t.producer_id, t.first_offset) for t in later.aborted_transactions] == [(b_pid, 9)]


def test_open_transaction_holds_back_read_committed_until_its_marker(broker, wire, topic):
    client = wire()
    a, b = TxnWriter(broker, client, topic), TxnWriter(broker, client, topic)
    a.send(b"before", transactional=False)
    first = b.send(b"open")
    a.send(b"after", transactional=False)
    assert list_offsets(client, topic, -1, READ_COMMITTED) == first == 1
    assert list_offsets(client, topic, -1, READ_UNCOMMITTED) == 3
    assert list_offsets(client, topic, -1, READ_UNCOMMITTED, version=1) == 3  # v1: no isolation level
    assert list_offsets(client, topic, 0, READ_COMMITTED) == 0  # by timestamp: only below the LSO
    assert list_offsets(client, topic, 1_001, READ_COMMITTED) == -1
    response = only_partition(client.request(committed_fetch(topic, 0)))
    assert [v for *_, v in decode(response.records)] == [b"before"]
    assert (response.last_stable_offset, response.high_watermark) == (1, 3)
    # A long poll at the LSO is not woken by data above it, only by the marker that moves the LSO.
    # max_wait far beyond the socket timeout: only a wake-up can answer the fetch in time.
    poller = WireClient(broker.port, timeout=60)
    try:
        correlation = poller.send(committed_fetch(topic, 1, max_wait_ms=600_000, min_bytes=1))
        a.send(b"more", transactional=False)  # answered: the broker has stored it (and woken the fetch, if wrongly)
        assert select.select([poller.sock], [], [], 0.2)[0] == [], "woken by data above the LSO"
        b.end(commit=True)
        parked = only_partition(poller.recv(type(committed_fetch(topic, 0)), correlation))
    finally:
        poller.close()
    assert [v for *_, v in decode(parked.records)] == [b"open", b"after", b"more"]
    assert parked.last_stable_offset == parked.high_watermark == 5
    assert list_offsets(client, topic, -1, READ_COMMITTED) == 5


def _consume_confluent(bootstrap: str, topic: str, isolation: str, until: bytes) -> list[bytes]:
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"g-{isolation}", "isolation.level": isolation,
                         "enable.auto.commit": False, "auto.offset.reset": "earliest", "log_level": 0})
    consumer.assign([TopicPartition(topic, 0, 0)])
    values: list[bytes] = []
    deadline = time.monotonic() + 30
    try:
        while until not in values:
            assert time.monotonic() < deadline, f"read so far: {values}"
            message = consumer.poll(0.5)
            if message is not None:
                assert message.error() is None, message.error()
                values.append(message.value())
    finally:
        consumer.close()
    return values


def _consume_kafka_python(bootstrap: str, topic: str, isolation: str, until: bytes) -> list[bytes]:
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, isolation_level=isolation, enable_auto_commit=False,
                             auto_offset_reset="earliest", consumer_timeout_ms=20_000)
    consumer.assign([KpTopicPartition(topic, 0)])
    values: list[bytes] = []
    try:
        for record in consumer:
            values.append(record.value)
            if record.value == until:
                break
    finally:
        consumer.close()
    return values


def _consume_aiokafka(bootstrap: str, topic: str, isolation: str, until: bytes) -> list[bytes]:
    async def run() -> list[bytes]:
        consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, isolation_level=isolation,
                                    enable_auto_commit=False, auto_offset_reset="earliest")
        await consumer.start()
        values: list[bytes] = []
        try:
            consumer.assign([AioTopicPartition(topic, 0)])
            async with asyncio.timeout(30):
                while until not in values:
                    for records in (await consumer.getmany(timeout_ms=500)).values():
                        values.extend(r.value for r in records)
        finally:
            await consumer.stop()
        return values

    return asyncio.run(run())


def test_max_timestamp_lookup_honours_the_isolation_level(broker, wire, topic):
    client = wire()
    a, b = TxnWriter(broker, client, topic), TxnWriter(broker, client, topic)
    a.send(b"old", transactional=False, timestamp=1_000)
    newest = b.send(b"newest, still open", timestamp=5_000)
    assert list_offsets(client, topic, -3, READ_UNCOMMITTED) == newest
    assert list_offsets(client, topic, -3, READ_COMMITTED) == -1  # not readable there yet


@pytest.mark.parametrize("consume", [_consume_confluent, _consume_kafka_python, _consume_aiokafka])
def test_real_consumers_see_exactly_the_committed_records(broker, scenario, topic, consume):
    _, _, committed, everything = scenario
    assert consume(broker.bootstrap, topic, "read_committed", b"END") == committed
    assert consume(broker.bootstrap, topic, "read_uncommitted", b"END") == everything
