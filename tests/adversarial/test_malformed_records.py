"""Issue 11, item 8: a Produce of batches whose records do not parse is refused and stores nothing.

Raw wire Produce requests carry batches with a valid CRC whose records lie: a record count that
disagrees with the records, garbage records, compressed data (gzip, snappy, lz4, zstd) that
inflates garbage or does not inflate, a bomb of each codec, a control batch. Each is answered with Kafka's error code, the partition's end does not move, and real
consumers (twophase.client and confluent-kafka) then read the good records around the attack
without an error.
"""

from __future__ import annotations

import gzip
import struct

import pytest
from confluent_kafka import OFFSET_BEGINNING, TopicPartition
from confluent_kafka import Consumer as ConfluentConsumer
from confluent_kafka import KafkaError as ConfluentError

from tests.adversarial.crafted import (
    ATTR_CONTROL,
    GZIP,
    LZ4,
    SNAPPY,
    ZSTD,
    gzip_bomb,
    lz4_bomb,
    raw_batch,
    record,
    snappy_bomb,
    snappy_declaring,
    zstd_bomb,
)
from tests.broker.batches import batch
from tests.broker.conftest import (
    MS,
    list_offsets_request,
    only_partition,
    produce_request,
    req,
    sub,
)
from tests.waiting import wait_for
from twophase.client import Consumer
from twophase.wire.compression import compress

INVALID_RECORD, CORRUPT_MESSAGE, MESSAGE_TOO_LARGE = 87, 2, 10
TWO_RECORDS = record(0, b"a") + record(1, b"b")
GARBAGE = b"\xde\xad\xbe\xef" * 20
CODECS = {"snappy": SNAPPY, "lz4": LZ4, "zstd": ZSTD}  # gzip has cases of its own


def _control_record() -> bytes:
    return record(0, struct.pack(">hi", 0, 0), key=struct.pack(">hh", 0, 1))  # a COMMIT marker


ATTACKS = {
    "count says 3, holds 2": (lambda: raw_batch(TWO_RECORDS, count=3), INVALID_RECORD, "malformed records"),
    "count says 1, holds 2": (lambda: raw_batch(TWO_RECORDS, count=1), INVALID_RECORD, "unconsumed bytes"),
    "garbage records": (lambda: raw_batch(GARBAGE, count=2), INVALID_RECORD, "malformed records"),
    "offset deltas 0, 0": (lambda: raw_batch(record(0, b"a") + record(0, b"b"), count=2), INVALID_RECORD,
                           "offset deltas"),
    "gzip inflating garbage": (lambda: raw_batch(gzip.compress(GARBAGE), count=1, codec=GZIP), INVALID_RECORD,
                               "malformed records"),
    "gzip that does not inflate": (lambda: raw_batch(GARBAGE, count=1, codec=GZIP), CORRUPT_MESSAGE, "gzip"),
    "gzip bomb, 1 MB to 1 GiB": (lambda: raw_batch(gzip_bomb(), count=1, codec=GZIP), MESSAGE_TOO_LARGE,
                                 "inflate to more than"),
    **{f"{name} inflating garbage": (lambda codec=codec: raw_batch(compress(codec, GARBAGE), count=1, codec=codec),
                                     INVALID_RECORD, "malformed records") for name, codec in CODECS.items()},
    **{f"{name} that does not inflate": (lambda codec=codec: raw_batch(GARBAGE, count=1, codec=codec),
                                         CORRUPT_MESSAGE, name) for name, codec in CODECS.items()},
    "snappy bomb, 6 MB to 128 MiB": (lambda: raw_batch(snappy_bomb(), count=1, codec=SNAPPY), MESSAGE_TOO_LARGE,
                                     "inflate to more than"),
    "snappy declaring 1 GiB in 13 bytes": (lambda: raw_batch(snappy_declaring(), count=1, codec=SNAPPY),
                                           MESSAGE_TOO_LARGE, "inflate to more than"),
    "lz4 bomb, 4.5 MB to 1 GiB": (lambda: raw_batch(lz4_bomb(), count=1, codec=LZ4), MESSAGE_TOO_LARGE,
                                  "inflate to more than"),
    "zstd bomb, 32 KB to 1 GiB": (lambda: raw_batch(zstd_bomb(), count=1, codec=ZSTD), MESSAGE_TOO_LARGE,
                                  "inflate to more than"),
    "unknown codec 5": (lambda: raw_batch(TWO_RECORDS, count=2, codec=5), CORRUPT_MESSAGE, "codec 5"),
    "control batch from a client": (lambda: raw_batch(_control_record(), count=1, attributes=ATTR_CONTROL),
                                    INVALID_RECORD, "control"),
    "garbage under a bad CRC": (lambda: _bad_crc(raw_batch(GARBAGE, count=2)), CORRUPT_MESSAGE, "CRC"),
}


def _bad_crc(data: bytes) -> bytes:
    damaged = bytearray(data)
    damaged[17] ^= 0xFF
    return bytes(damaged)


def _produce(client, topic: str, data: bytes):
    return only_partition(client.request(produce_request(topic, data)))


def _log_end(client, topic: str) -> int:
    [topic_offsets] = client.request(list_offsets_request(topic, -1)).topics
    [partition] = topic_offsets.partitions
    return partition.offset


def _read_with_twophase_client(bootstrap: str, topic: str, expected: int) -> list[bytes]:
    with Consumer(bootstrap) as consumer:
        consumer.assign([(topic, 0)])
        messages: list = []
        wait_for(lambda: messages.extend(consumer.poll(timeout_s=0.5)) or len(messages) >= expected,
                 what=f"{expected} records through twophase.client")
        return [m.value for m in messages]


def _read_with_confluent(bootstrap: str, topic: str, expected: int) -> list[bytes]:
    consumer = ConfluentConsumer({"bootstrap.servers": bootstrap, "group.id": "attack", "enable.auto.commit": False,
                                  "enable.partition.eof": True})
    consumer.assign([TopicPartition(topic, 0, OFFSET_BEGINNING)])
    values: list[bytes] = []

    def read_to_end() -> bool:
        m = consumer.poll(0.5)
        if m is None:
            return False
        if m.error():
            assert m.error().code() == ConfluentError._PARTITION_EOF, m.error()
            return len(values) >= expected
        values.append(m.value())
        return False

    try:
        wait_for(read_to_end, what=f"{expected} records and the partition's end through confluent-kafka")
    finally:
        consumer.close()
    return values


@pytest.mark.parametrize("attack", list(ATTACKS))
def test_malformed_batch_is_refused_and_nothing_is_stored(broker, wire, topic, attack):
    build, code, reason = ATTACKS[attack]
    client = wire()
    assert _produce(client, topic, batch([b"before-0", b"before-1"])).error_code == 0

    refused = _produce(client, topic, build())

    assert refused.error_code == code, refused.error_message
    assert reason in refused.error_message
    assert _log_end(client, topic) == 2  # nothing of the refused batch was stored
    after = _produce(client, topic, batch([b"after"]))
    assert (after.error_code, after.base_offset) == (0, 2)
    good = [b"before-0", b"before-1", b"after"]
    assert _read_with_twophase_client(broker.bootstrap, topic, 3) == good
    assert _read_with_confluent(broker.bootstrap, topic, 3) == good


def test_well_formed_gzip_batch_is_accepted(broker, wire, topic):
    """The checks refuse lies, not compression: records that inflate and parse are stored."""
    client = wire()
    body = gzip.compress(record(0, b"x" * 1000) + record(1, b"y" * 1000, timestamp_delta=5))
    assert _produce(client, topic, raw_batch(body, count=2, codec=GZIP)).error_code == 0
    assert _read_with_twophase_client(broker.bootstrap, topic, 2) == [b"x" * 1000, b"y" * 1000]


def test_inflation_is_bounded_per_request_not_per_batch(wire, topic):
    """Two batches of 40 MiB inflated each, in one request: the first fits the request's 64 MiB, the
    second does not (many bombs in one request cost no more than one)."""
    body = gzip.compress(record(0, bytes(40 << 20)))
    data = raw_batch(body, count=1, codec=GZIP)
    topics = (f"{topic}-a", f"{topic}-b")
    request = req(0, 9, transactional_id=None, acks=-1, timeout=30_000 * MS, topic_data=tuple(
        sub(0, 9, "TopicProduceData", name=t, partition_data=(sub(0, 9, "PartitionProduceData", index=0,
                                                                      records=data),)) for t in topics))
    responses = {t.name: t.partition_responses[0].error_code for t in wire().request(request).responses}
    assert responses == {topics[0]: 0, topics[1]: MESSAGE_TOO_LARGE}
