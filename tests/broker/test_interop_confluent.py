"""confluent-kafka (librdkafka) against the built-in broker.

Producer: idempotent, keys, headers, every compression codec (the broker never decodes records).
Consumer: assign() with explicit offsets (groups: test_groups_interop.py). Admin: create and
delete topics. Every record must arrive once, in order, per partition.
"""

from __future__ import annotations

import time

import pytest
from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

PARTITIONS = 3


def create_topic(bootstrap: str, topic: str, partitions: int = PARTITIONS) -> None:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.create_topics([NewTopic(topic, partitions, 1)])[topic].result(timeout=30)


def consumer(bootstrap: str, **extra) -> Consumer:
    return Consumer({"bootstrap.servers": bootstrap, "group.id": "interop", "enable.auto.commit": False,
                     "enable.partition.eof": True, "auto.offset.reset": "earliest", **extra})


def consume_all(bootstrap: str, topic: str, partitions: int, expected: int, timeout: float = 30.0):
    """Every message until each partition reached its end and ``expected`` messages arrived."""
    c = consumer(bootstrap)
    c.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in range(partitions)])
    messages, at_end = [], set()
    deadline = time.monotonic() + timeout
    try:
        while (len(at_end) < partitions or len(messages) < expected) and time.monotonic() < deadline:
            m = c.poll(1.0)
            if m is None:
                continue
            if m.error():
                assert m.error().code() == KafkaError._PARTITION_EOF, m.error()
                at_end.add(m.partition())
                continue
            messages.append(m)
    finally:
        c.close()
    return messages


@pytest.mark.parametrize("compression", ["none", "gzip", "snappy", "lz4", "zstd"])
def test_idempotent_producer_and_consumer(broker, topic, compression):
    create_topic(broker.bootstrap, topic)
    p = Producer({"bootstrap.servers": broker.bootstrap, "enable.idempotence": True,
                  "compression.type": compression, "linger.ms": 5})
    errors = []

    def report(err, msg):
        if err is not None:
            errors.append(err)

    sent = {}
    for i in range(300):
        key = f"key-{i % 17}".encode()
        p.produce(topic, key=key, value=f"value-{i}".encode(), headers=[("n", str(i).encode()), ("h", b"x")],
                  on_delivery=report)
        sent.setdefault(key, []).append(i)
        if i % 50 == 0:
            p.poll(0)
    assert p.flush(30) == 0
    assert errors == []

    messages = consume_all(broker.bootstrap, topic, PARTITIONS, 300)
    assert len(messages) == 300
    by_partition: dict[int, list] = {}
    for m in messages:
        by_partition.setdefault(m.partition(), []).append(m)
    received = {}
    for p_messages in by_partition.values():
        offsets = [m.offset() for m in p_messages]
        assert offsets == list(range(len(offsets)))  # once each, in order, no gaps
        for m in p_messages:
            headers = dict(m.headers())
            assert headers["h"] == b"x"
            n = int(headers["n"])
            assert m.value() == f"value-{n}".encode()
            received.setdefault(m.key(), []).append(n)
    assert received == sent  # per key (= per partition) order preserved


def test_offsets_for_times(broker, topic):
    create_topic(broker.bootstrap, topic, 1)
    p = Producer({"bootstrap.servers": broker.bootstrap})
    for i in range(10):
        p.produce(topic, value=str(i).encode(), timestamp=1_000_000 + i * 1000, partition=0)
    assert p.flush(30) == 0
    c = consumer(broker.bootstrap)
    try:
        found = c.offsets_for_times([TopicPartition(topic, 0, 1_004_500)], timeout=10)
        assert found[0].offset == 5
        found = c.offsets_for_times([TopicPartition(topic, 0, 1_000_000)], timeout=10)
        assert found[0].offset == 0
        found = c.offsets_for_times([TopicPartition(topic, 0, 2_000_000)], timeout=10)
        assert found[0].offset == -1  # after every record: the end
        low, high = c.get_watermark_offsets(TopicPartition(topic, 0), timeout=10)
        assert (low, high) == (0, 10)
    finally:
        c.close()


def test_consumer_long_polls_and_wakes_on_produce(broker, topic):
    create_topic(broker.bootstrap, topic, 1)
    p = Producer({"bootstrap.servers": broker.bootstrap})
    p.produce(topic, value=b"first", partition=0)
    assert p.flush(10) == 0
    # fetch.wait.max.ms is librdkafka's maximum, 5 min: far beyond the poll below, so the record can
    # only arrive in time if the produce woke the parked fetch.
    c = consumer(broker.bootstrap, **{"fetch.wait.max.ms": 300_000, "socket.timeout.ms": 300_000,
                                      "enable.partition.eof": False})
    c.assign([TopicPartition(topic, 0, OFFSET_BEGINNING)])
    try:
        m = c.poll(30)
        assert m is not None and not m.error() and m.value() == b"first"
        # The consumer's next fetch finds nothing and parks on the broker; a produce must wake it.
        p.produce(topic, value=b"wake up", partition=0)
        assert p.flush(30) == 0
        m = c.poll(60)
        assert m is not None and not m.error() and m.value() == b"wake up", "the parked fetch was not woken"
    finally:
        c.close()


def test_admin_create_and_delete_topics(broker, topic):
    admin = AdminClient({"bootstrap.servers": broker.bootstrap})
    admin.create_topics([NewTopic(topic, 2, 1)])[topic].result(timeout=30)
    with pytest.raises(Exception, match="(?i)already exists"):
        admin.create_topics([NewTopic(topic, 2, 1)])[topic].result(timeout=30)
    metadata = admin.list_topics(timeout=10)
    assert len(metadata.topics[topic].partitions) == 2
    assert metadata.cluster_id == broker.cluster_id
    admin.delete_topics([topic])[topic].result(timeout=30)
    assert topic not in admin.list_topics(timeout=10).topics


def test_auto_created_topic_gets_default_partitions(broker_factory, topic):
    b = broker_factory(default_partitions=4)
    p = Producer({"bootstrap.servers": b.bootstrap})
    p.produce(topic, value=b"x")
    assert p.flush(30) == 0
    admin = AdminClient({"bootstrap.servers": b.bootstrap})
    assert len(admin.list_topics(timeout=10).topics[topic].partitions) == 4


def test_unknown_topic_without_auto_creation(broker_factory, topic):
    b = broker_factory(auto_create_topics=False)
    p = Producer({"bootstrap.servers": b.bootstrap, "message.timeout.ms": 1000})
    failures = []
    p.produce(topic, value=b"x", on_delivery=lambda err, msg: failures.append(err))
    p.flush(10)
    assert failures and failures[0] is not None
    assert topic not in AdminClient({"bootstrap.servers": b.bootstrap}).list_topics(timeout=10).topics
