"""Issue 12: every codec a producer may use, both ways, against the real broker.

confluent-kafka (librdkafka: raw snappy, LZ4 frames, zstd) writes transactions compressed with each
codec, one of them aborted; twophase.client reads every committed record exactly once under
read_committed and every record under read_uncommitted, keys, values and headers intact. The other
way, twophase.client writes each codec (snappy-java framing for snappy) and confluent-kafka,
kafka-python, aiokafka and kcat read it. Each test first checks that the stored batches carry the
codec, so a client that silently fell back to no compression would fail it.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess

import aiokafka.codec
import kafka.codec
import pytest
from aiokafka import AIOKafkaConsumer
from aiokafka import TopicPartition as AioTopicPartition
from confluent_kafka import Consumer as ConfluentConsumer
from confluent_kafka import Producer as ConfluentProducer
from kafka import KafkaConsumer
from kafka import TopicPartition as KafkaPythonTopicPartition

from twophase.client import Admin, Consumer, Producer
from twophase.wire.compression import CODEC_NAMES
from twophase.wire.records import iter_batches

from .conftest import confluent_drain, drain

CODECS = [name for name in CODEC_NAMES if name != "none"]
PARTITIONS = 2
N = 300


def _record(i: int) -> tuple[bytes, bytes, list[tuple[str, bytes]]]:
    """Key, value and headers of record ``i``: values compress well, as real payloads do."""
    return b"key-%d" % (i % 17), b"value %d " % i + b"payload " * 20, [("n", b"%d" % i), ("codec", b"c")]


def _stored_codecs(broker, topic: str) -> set[int]:
    """The codec ids of the data batches stored in ``topic``'s partitions, as the broker's log holds them."""
    codecs = set()
    for partition in range(PARTITIONS):
        stored = broker.call(lambda: broker.partition_log(topic, partition).read(0, 64 << 20))
        codecs |= {header.compression for _, header in iter_batches(stored) if not header.is_control}
    return codecs


def _confluent_writes_transactions(bootstrap: str, topic: str, codec: str) -> None:
    """Committed records 0..N-1 in two transactions around an aborted one (records N..N+49)."""
    producer = ConfluentProducer({"bootstrap.servers": bootstrap, "transactional.id": f"tx-{topic}",
                                  "compression.type": codec, "linger.ms": 20, "partitioner": "murmur2_random"})
    producer.init_transactions(10)
    for numbers, commit in ((range(N // 2), True), (range(N, N + 50), False), (range(N // 2, N), True)):
        producer.begin_transaction()
        for i in numbers:
            key, value, headers = _record(i)
            producer.produce(topic, key=key, value=value, headers=headers)
        producer.flush(10)
        if commit:
            producer.commit_transaction(10)
        else:
            producer.abort_transaction(10)


@pytest.mark.parametrize("codec", CODECS)
def test_twophase_reads_what_confluent_compressed(broker, topic, codec):
    Admin(broker.bootstrap).create_topics({topic: PARTITIONS})
    _confluent_writes_transactions(broker.bootstrap, topic, codec)
    assert _stored_codecs(broker, topic) == {CODEC_NAMES[codec]}
    for isolation, expected in (("read_committed", list(range(N))), ("read_uncommitted", list(range(N + 50)))):
        with Consumer(broker.bootstrap, isolation_level=isolation) as consumer:
            consumer.assign([(topic, p) for p in range(PARTITIONS)])
            got = drain(consumer, len(expected))
        numbers = [int(dict(m.headers)["n"]) for m in got]
        assert sorted(numbers) == expected, isolation  # each exactly once
        for m, i in zip(got, numbers):
            key, value, headers = _record(i)
            assert (m.key, m.value, m.headers) == (key, value, tuple(headers))


def _twophase_writes(bootstrap: str, topic: str, codec: str) -> None:
    with Producer(bootstrap, compression=codec, linger_ms=20) as producer:
        for i in range(N):
            key, value, headers = _record(i)
            producer.send(topic, key=key, value=value, headers=headers)
        producer.flush()


def _check(records: list[tuple[bytes | None, bytes | None, list]]) -> None:
    """Every record once, its key, value and headers as written."""
    assert len(records) == N
    numbers = []
    for key, value, headers in records:
        i = int(dict(headers)["n"])
        numbers.append(i)
        expected_key, expected_value, expected_headers = _record(i)
        assert (key, value, [(k, bytes(v)) for k, v in headers]) == (expected_key, expected_value, expected_headers)
    assert sorted(numbers) == list(range(N))


def _read_with_confluent(bootstrap: str, topic: str) -> list:
    consumer = ConfluentConsumer({"bootstrap.servers": bootstrap, "group.id": f"g-{topic}",
                                  "auto.offset.reset": "earliest", "enable.auto.commit": False,
                                  "isolation.level": "read_committed"})
    consumer.subscribe([topic])
    try:
        return [(key, value, headers) for _, _, _, key, value, headers in confluent_drain(consumer, N)]
    finally:
        consumer.close()


def _read_with_kafka_python(bootstrap: str, topic: str) -> list:
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, auto_offset_reset="earliest",
                             consumer_timeout_ms=10_000)
    consumer.assign([KafkaPythonTopicPartition(topic, p) for p in range(PARTITIONS)])
    try:
        records = []
        for record in consumer:
            records.append((record.key, record.value, list(record.headers)))
            if len(records) >= N:
                break
        return records
    finally:
        consumer.close()


def _read_with_aiokafka(bootstrap: str, topic: str) -> list:
    async def read() -> list:
        consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False,
                                    auto_offset_reset="earliest")
        await consumer.start()
        try:
            consumer.assign([AioTopicPartition(topic, p) for p in range(PARTITIONS)])
            records = []
            async with asyncio.timeout(30):
                while len(records) < N:
                    for batch in (await consumer.getmany(timeout_ms=1000)).values():
                        records += [(r.key, r.value, list(r.headers)) for r in batch]
            return records
        finally:
            await consumer.stop()

    return asyncio.run(read())


def _read_with_kcat(bootstrap: str, topic: str) -> list:
    result = subprocess.run(["kcat", "-b", bootstrap, "-C", "-t", topic, "-e", "-q", "-f", "%k\t%s\t%h\n"],
                            capture_output=True, timeout=60)
    assert result.returncode == 0, result.stderr
    records = []
    for line in result.stdout.decode().splitlines():
        key, value, headers = line.split("\t")
        records.append((key.encode(), value.encode(),
                        [(name, v.encode()) for name, v in (h.split("=", 1) for h in headers.split(","))]))
    return records


def _has(library_check) -> dict:
    return {name: getattr(library_check, f"has_{name}")() for name in CODECS}


READERS = {
    "confluent-kafka": (_read_with_confluent, dict.fromkeys(CODECS, True)),
    "kafka-python": (_read_with_kafka_python, _has(kafka.codec)),  # python-snappy, lz4, zstandard
    "aiokafka": (_read_with_aiokafka, _has(aiokafka.codec)),       # cramjam
    "kcat": (_read_with_kcat, dict.fromkeys(CODECS, shutil.which("kcat") is not None)),
}


@pytest.mark.parametrize("reader", list(READERS))
@pytest.mark.parametrize("codec", CODECS)
def test_other_clients_read_what_twophase_compressed(broker, topic, codec, reader):
    read, available = READERS[reader]
    if not available[codec]:
        pytest.skip(f"{reader} has no {codec} library here")
    Admin(broker.bootstrap).create_topics({topic: PARTITIONS})
    _twophase_writes(broker.bootstrap, topic, codec)
    assert _stored_codecs(broker, topic) == {CODEC_NAMES[codec]}
    _check(read(broker.bootstrap, topic))


def test_unknown_codec_is_refused_when_the_producer_is_made():
    with pytest.raises(ValueError, match="unknown compression codec 'brotli': one of none, gzip, snappy, lz4, zstd"):
        Producer("127.0.0.1:1", compression="brotli")
