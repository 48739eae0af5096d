"""kafka-python 3.x against the built-in broker.

kafka-python starts with ApiVersions v4 and falls back on UNSUPPORTED_VERSION; it then uses
Produce <= 9 and Fetch <= 12, with fetch sessions requested (the broker answers "no session").
"""

from __future__ import annotations

import kafka.codec
import pytest
from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer, TopicPartition
from kafka.admin import NewTopic

PARTITIONS = 3


def consume(bootstrap: str, topic: str, partitions: int, expected: int):
    c = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, auto_offset_reset="earliest",
                      consumer_timeout_ms=10_000)
    c.assign([TopicPartition(topic, p) for p in range(partitions)])
    c.seek_to_beginning()
    records = []
    try:
        for record in c:
            records.append(record)
            if len(records) >= expected:
                break
    finally:
        c.close()
    return records


@pytest.mark.parametrize("compression", [None, "gzip", "snappy", "lz4", "zstd"])
def test_produce_and_consume(broker, topic, compression):
    if compression and not getattr(kafka.codec, f"has_{compression}")():
        pytest.skip(f"kafka-python has no {compression} library here (python-snappy, lz4, zstandard)")
    admin = KafkaAdminClient(bootstrap_servers=broker.bootstrap)
    admin.create_topics([NewTopic(topic, PARTITIONS, 1)])
    admin.close()
    producer = KafkaProducer(bootstrap_servers=broker.bootstrap, compression_type=compression,
                             enable_idempotence=True, acks="all", linger_ms=5)
    futures = [producer.send(topic, key=f"k{i % 7}".encode(), value=f"v{i}".encode(),
                             headers=[("n", str(i).encode())]) for i in range(200)]
    producer.flush(30)
    metas = [f.get(timeout=30) for f in futures]
    producer.close()
    assert len({(m.partition, m.offset) for m in metas}) == 200

    records = consume(broker.bootstrap, topic, PARTITIONS, 200)
    assert len(records) == 200
    by_partition: dict[int, list] = {}
    for r in records:
        by_partition.setdefault(r.partition, []).append(r)
    seen = []
    for rs in by_partition.values():
        assert [r.offset for r in rs] == list(range(len(rs)))
        ns = [int(dict(r.headers)["n"]) for r in rs]
        assert ns == sorted(ns)  # per partition, in send order
        for r, n in zip(rs, ns):
            assert r.value == f"v{n}".encode() and r.key == f"k{n % 7}".encode()
        seen += ns
    assert sorted(seen) == list(range(200))


def test_offsets_for_times_and_end_offsets(broker, topic):
    producer = KafkaProducer(bootstrap_servers=broker.bootstrap)
    for i in range(5):
        producer.send(topic, value=b"x", partition=0, timestamp_ms=5_000 + i)
    producer.flush(30)
    producer.close()
    c = KafkaConsumer(bootstrap_servers=broker.bootstrap, enable_auto_commit=False)
    try:
        tp = TopicPartition(topic, 0)
        assert c.end_offsets([tp])[tp] == 5
        assert c.beginning_offsets([tp])[tp] == 0
        found = c.offsets_for_times({tp: 5_003})[tp]
        assert (found.offset, found.timestamp) == (3, 5_003)
        assert c.offsets_for_times({tp: 9_999})[tp] is None
    finally:
        c.close()
