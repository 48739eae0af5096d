"""aiokafka against the built-in broker: it starts with ApiVersions v0 and uses only
non-flexible versions (Produce <= 8, Fetch <= 11, Metadata <= 5)."""

from __future__ import annotations

import asyncio

import aiokafka.codec
import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

PARTITIONS = 2


async def _roundtrip(bootstrap: str, topic: str, compression: str | None) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, enable_idempotence=True, acks="all",
                                compression_type=compression)
    await producer.start()
    try:
        for i in range(100):
            await producer.send(topic, key=f"k{i % 5}".encode(), value=f"v{i}".encode(),
                                headers=[("n", str(i).encode())], partition=i % PARTITIONS)
        await producer.flush()
        # send_and_wait of the last one: everything before is acknowledged too
        await producer.send_and_wait(topic, value=b"last", partition=0, headers=[("n", b"100")])
    finally:
        await producer.stop()

    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False,
                                auto_offset_reset="earliest")
    await consumer.start()
    try:
        consumer.assign([TopicPartition(topic, p) for p in range(PARTITIONS)])
        await consumer.seek_to_beginning()
        records = []
        async with asyncio.timeout(30):
            while len(records) < 101:
                batch = await consumer.getmany(timeout_ms=1000)
                for rs in batch.values():
                    records += rs
    finally:
        await consumer.stop()
    by_partition: dict[int, list] = {}
    for r in records:
        by_partition.setdefault(r.partition, []).append(r)
    for p, rs in by_partition.items():
        assert [r.offset for r in rs] == list(range(len(rs)))
        ns = [int(dict(r.headers)["n"]) for r in rs]
        assert ns == sorted(ns)
        assert all(n % PARTITIONS == p for n in ns if n < 100)
    assert sorted(int(dict(r.headers)["n"]) for r in records) == list(range(101))


@pytest.mark.parametrize("compression", [None, "gzip", "snappy", "lz4", "zstd"])
def test_produce_and_consume(broker_factory, topic, compression):
    if compression and not getattr(aiokafka.codec, f"has_{compression}")():
        pytest.skip(f"aiokafka has no {compression} library here (cramjam)")
    b = broker_factory(default_partitions=PARTITIONS)
    asyncio.run(_roundtrip(b.bootstrap, topic, compression))


def test_offsets_for_times(broker, topic):
    async def run():
        producer = AIOKafkaProducer(bootstrap_servers=broker.bootstrap)
        await producer.start()
        try:
            for i in range(4):
                await producer.send_and_wait(topic, value=b"x", partition=0, timestamp_ms=70_000 + i * 10)
        finally:
            await producer.stop()
        consumer = AIOKafkaConsumer(bootstrap_servers=broker.bootstrap, enable_auto_commit=False)
        await consumer.start()
        try:
            tp = TopicPartition(topic, 0)
            found = await consumer.offsets_for_times({tp: 70_015})
            assert (found[tp].offset, found[tp].timestamp) == (2, 70_020)
            assert (await consumer.end_offsets([tp]))[tp] == 4
        finally:
            await consumer.stop()

    asyncio.run(run())
