"""Issue 11, item 9: twophase.client does not trust what it fetches.

The broker now refuses malformed batches on Produce, so these attacks play a broker that serves
them anyway: a real Broker whose partition log got the crafted batch through PartitionLog.append,
which checks the batch's framing, header and CRC but not its records (as a log written before the
produce-side checks, or damaged under a valid CRC, would hold). The consumer must inflate every
codec with a bound (test_compression_bombs.py measures the memory a bomb of each costs), stop at
the bad batch with an error naming its offsets, and skip it on request, counted and logged.
"""

from __future__ import annotations

import glob
import gzip
import logging
import os
import struct
import time
import tracemalloc

import pytest

from tests.adversarial.crafted import (
    GZIP,
    LZ4,
    SNAPPY,
    ZSTD,
    gzip_bomb,
    lz4_bomb,
    raw_batch,
    record,
    snappy_declaring,
    zstd_bomb,
)
from tests.broker.batches import batch
from tests.waiting import wait_for
from twophase.client import Consumer, CorruptRecordBatch, Producer
from twophase.client.consumer import records_of
from twophase.wire.records import iter_batches

MIB = 1 << 20
BAD_BATCHES = {
    "count says 3, holds 2": lambda: raw_batch(record(0, b"a") + record(1, b"b"), count=3),
    "gzip bomb, 1 MB to 1 GiB": lambda: raw_batch(gzip_bomb(), count=1, codec=GZIP),
    # The broker's log takes batches of up to 1 MiB (max_message_bytes): snappy inflates 21-fold at most,
    # so its bomb here is a block declaring 1 GiB.
    "snappy declaring 1 GiB in 13 bytes": lambda: raw_batch(snappy_declaring(), count=1, codec=SNAPPY),
    "lz4 bomb, 0.8 MB to 192 MiB": lambda: raw_batch(lz4_bomb(192 * MIB), count=1, codec=LZ4),
    "zstd bomb, 32 KB to 1 GiB": lambda: raw_batch(zstd_bomb(), count=1, codec=ZSTD),
    "zstd that does not inflate": lambda: raw_batch(b"\x28\xb5\x2f\xfd" + b"\xff" * 40, count=1, codec=ZSTD),
}


def _store_behind_the_produce_checks(broker, topic: str, data: bytes) -> int:
    """Append ``data`` to partition 0 as storage takes it (no record checks); its first offset."""
    now_ms = int(time.time() * 1000)
    return broker.call(lambda: broker.partition_log(topic, 0).append(data, now_ms).base_offset)


@pytest.fixture
def poisoned(broker, topic):
    """Partition 0 of ``topic``: good records at 0-1, a crafted bad batch from 2, a good record after it.
    Returns the bad batch's last offset."""
    def make(bad: bytes) -> int:
        with Producer(broker.bootstrap) as producer:
            for value in (b"good-0", b"good-1"):
                producer.send(topic, value=value, partition=0)
            producer.flush()
        assert _store_behind_the_produce_checks(broker, topic, bad) == 2
        with Producer(broker.bootstrap) as producer:
            producer.send(topic, value=b"good-after", partition=0)
            producer.flush()
        (last_offset_delta,) = struct.unpack_from(">i", bad, 23)
        return 2 + last_offset_delta
    return make


def _poll_values(consumer: Consumer, expected: int) -> list[bytes]:
    values: list[bytes] = []
    wait_for(lambda: values.extend(m.value for m in consumer.poll(timeout_s=0.5)) or len(values) >= expected,
             what=f"{expected} records")
    return values


def test_gzip_bomb_inflates_within_the_bound():
    """1 MB that would inflate to 1 GiB: decoding stops at the bound, in bounded memory, and says why."""
    bomb = raw_batch(gzip_bomb(), count=1, codec=GZIP)
    tracemalloc.start()
    try:
        read = records_of("t", 0, bomb, 0, [], read_committed=False)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert read.messages == [] and read.position == 0
    assert "inflate to more than" in read.corrupt.reason
    assert peak < 100 * MIB, f"decoding the bomb peaked at {peak / MIB:.0f} MiB"


def test_inflation_bound_follows_the_setting():
    body = record(0, b"x" * (2 * MIB))
    data = raw_batch(gzip.compress(body), count=1, codec=GZIP)
    assert records_of("t", 0, data, 0, [], False, max_inflated_bytes=MIB).corrupt is not None
    assert [m.value for m in records_of("t", 0, data, 0, [], False, max_inflated_bytes=3 * MIB).messages] == [
        b"x" * (2 * MIB)]


def test_bad_crc_stops_reading_at_the_batch_with_its_offsets():
    good, bad = bytearray(batch([b"a", b"b"])), bytearray(batch([b"c"], base_offset=2))
    bad[-1] ^= 0xFF
    read = records_of("t", 0, bytes(good + bad), 0, [], read_committed=False)
    assert [m.value for m in read.messages] == [b"a", b"b"] and read.position == 2
    assert (read.corrupt.base_offset, read.corrupt.last_offset) == (2, 2) and "CRC" in read.corrupt.reason


@pytest.mark.parametrize("bad", list(BAD_BATCHES))
def test_corrupt_batch_raises_with_its_offsets_until_the_consumer_seeks_past(broker, topic, poisoned, bad):
    last = poisoned(BAD_BATCHES[bad]())
    with Consumer(broker.bootstrap) as consumer:
        consumer.assign([(topic, 0)])
        assert _poll_values(consumer, 2) == [b"good-0", b"good-1"]
        for _ in range(2):  # it does not go away by itself, and nothing after it is delivered
            with pytest.raises(CorruptRecordBatch) as raised:
                wait_for(lambda: consumer.poll(timeout_s=0.5), what="the corrupt batch")
            error = raised.value
            assert (error.topic, error.partition, error.base_offset, error.last_offset) == (topic, 0, 2, last)
            assert f"{topic}-0 at offsets 2..{last}" in str(error)
        assert consumer.position(topic, 0) == 2
        consumer.seek(topic, 0, error.last_offset + 1)
        assert _poll_values(consumer, 1) == [b"good-after"]


@pytest.mark.parametrize("bad", list(BAD_BATCHES))
def test_skip_mode_moves_past_the_corrupt_batch_counted_and_logged(broker, topic, poisoned, bad, caplog):
    last = poisoned(BAD_BATCHES[bad]())
    caplog.set_level(logging.WARNING, logger="twophase.client")
    with Consumer(broker.bootstrap, on_corrupt="skip") as consumer:
        consumer.assign([(topic, 0)])
        assert _poll_values(consumer, 3) == [b"good-0", b"good-1", b"good-after"]
        assert consumer.corrupt_batches_skipped == 1
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(f"{topic}-0 at offsets 2..{last}" in w and "skipped" in w for w in warnings), warnings


def test_on_corrupt_must_be_raise_or_skip():
    with pytest.raises(ValueError, match="on_corrupt"):
        Consumer("127.0.0.1:1", on_corrupt="ignore")


LAST_OFFSET_DELTA = 23  # where a batch's lastOffsetDelta (int32, under the CRC) lies


def _flip_last_offset_delta(partition_dir: str, base_offset: int) -> None:
    """Flip the high byte of the lastOffsetDelta of the batch at ``base_offset`` in the partition's files, as
    a disk might: its CRC no longer holds and its header claims some 16 million offsets more."""
    [path] = glob.glob(os.path.join(partition_dir, "*.log"))
    with open(path, "rb") as f:
        raw = f.read()
    [pos] = [pos for pos, header in iter_batches(raw) if header.base_offset == base_offset]
    with open(path, "r+b") as f:
        f.seek(pos + LAST_OFFSET_DELTA)
        f.write(bytes([raw[pos + LAST_OFFSET_DELTA] ^ 0x01]))


def test_skip_mode_does_not_trust_the_offsets_of_a_batch_whose_crc_failed(broker, topic, poisoned, caplog):
    """Review finding 13: the skip goes to the next intact batch, not to the damaged header's last offset
    (there, 16 million offsets on: out of range, reset to the start, read again in a loop)."""
    poisoned(batch([b"damaged-2", b"damaged-3"]))  # stored intact, then damaged where the broker serves it
    _flip_last_offset_delta(os.path.join(broker.data_dir, f"{topic}-0"), 2)
    caplog.set_level(logging.WARNING, logger="twophase.client")
    with Consumer(broker.bootstrap, on_corrupt="skip") as consumer:
        consumer.assign([(topic, 0)])
        assert _poll_values(consumer, 3) == [b"good-0", b"good-1", b"good-after"]
        assert consumer.corrupt_batches_skipped == 1 and consumer.position(topic, 0) == 5
        # The broker, trusting the damaged header too, serves it again ahead of what comes later: skipped
        # again, not counted again, nothing read twice.
        with Producer(broker.bootstrap) as producer:
            producer.send(topic, value=b"later", partition=0)
            producer.flush()
        assert _poll_values(consumer, 1) == [b"later"]
        assert consumer.corrupt_batches_skipped == 1
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("CRC mismatch" in w and "reading on from offset 4" in w for w in warnings), warnings


def test_a_batch_whose_crc_failed_is_skipped_to_the_next_batch_or_one_offset_on():
    good, bad, after = batch([b"a", b"b"]), bytearray(batch([b"c", b"d"], base_offset=2)), batch([b"e"], base_offset=4)
    bad[LAST_OFFSET_DELTA] ^= 0x01
    read = records_of("t", 0, bytes(good + bad + after), 0, [], False, skip_corrupt=True)
    assert [m.value for m in read.messages] == [b"a", b"b", b"e"] and read.position == 5
    assert [(c.base_offset, c.next_offset) for c in read.skipped] == [(2, 4)]
    # Nothing after it in the response, or what follows is not intact: one offset on, and the next fetch goes on.
    for data in (good + bad, good + bad + after[:-1] + bytes([after[-1] ^ 0xFF])):
        read = records_of("t", 0, bytes(data), 0, [], False, skip_corrupt=True)
        assert [m.value for m in read.messages] == [b"a", b"b"] and read.position == 3
    assert records_of("t", 0, bytes(bad), 3, [], False, skip_corrupt=True).position == 4  # fetched from inside it
    # Raise mode stops at it, and says where to seek to accept the loss.
    read = records_of("t", 0, bytes(good + bad + after), 0, [], False)
    assert read.position == 2 and read.corrupt.next_offset == 4 and read.skipped == ()
