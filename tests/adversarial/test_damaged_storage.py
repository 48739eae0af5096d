"""A damaged disk: index files emptied or cut, a flipped byte in a closed segment.

Each test writes through a real broker with real clients, stops it, damages the files in its data
directory the way a disk or an operator might, starts a broker again on that directory and reads with
twophase.client and confluent_kafka. Completion of reading is an event: the last committed record is
END, and a reader has seen everything once it has seen END (records arrive in offset order).
"""

from __future__ import annotations

import glob
import logging
import os
import uuid

import pytest
from confluent_kafka import OFFSET_BEGINNING, TopicPartition
from confluent_kafka import Consumer as ConfluentConsumer
from confluent_kafka import KafkaError as ConfluentError

from tests.adversarial.reading import END, read_until_end, values_until_end
from tests.broker.batches import batch, batch_offsets
from tests.waiting import wait_for, wait_until
from twophase.broker.storage import LogConfig, PartitionLog
from twophase.broker.storage.txnindex import ENTRY
from twophase.client import Admin, Consumer, CorruptRecordBatch, Producer
from twophase.wire.errors import CorruptRecordError
from twophase.wire.records import HEADER_SIZE, iter_batches

SMALL_SEGMENTS = {"segment.bytes": "1024"}  # the smallest allowed: a few transactions per segment


def partition_dir(broker, topic: str) -> str:
    return os.path.join(broker.data_dir, f"{topic}-0")


def write_transactions(bootstrap: str, topic: str, rounds: int) -> set[bytes]:
    """Per round one committed and one aborted transaction of three records each, then a committed END;
    returns the committed values (END aside)."""
    committed: set[bytes] = set()
    with Producer(bootstrap, transactional_id=f"txn-{uuid.uuid4().hex[:8]}") as producer:
        producer.init_transactions()
        for i in range(rounds):
            for outcome in ("committed", "aborted"):
                producer.begin_transaction()
                values = [f"{outcome}-{i}-{j}".encode() for j in range(3)]
                for value in values:
                    producer.send(topic, value, partition=0)
                if outcome == "committed":
                    producer.commit_transaction()
                    committed.update(values)
                else:
                    producer.abort_transaction()
        producer.begin_transaction()
        producer.send(topic, END, partition=0)
        producer.commit_transaction()
    return committed


def read_twophase(bootstrap: str, topic: str) -> list[bytes]:
    """Every value before END, read_committed, with twophase.client."""
    return read_until_end(bootstrap, topic, isolation_level="read_committed")


def read_confluent(bootstrap: str, topic: str) -> list[bytes]:
    """Every value before END, read_committed, with confluent_kafka (librdkafka)."""
    values: list[bytes] = []
    consumer = ConfluentConsumer({"bootstrap.servers": bootstrap, "group.id": f"g-{uuid.uuid4().hex[:8]}",
                                  "enable.auto.commit": False, "isolation.level": "read_committed"})
    try:
        consumer.assign([TopicPartition(topic, 0, OFFSET_BEGINNING)])

        def saw_end() -> bool:
            m = consumer.poll(0.5)
            if m is None or m.error():
                return False
            if m.value() == END:
                return True
            values.append(m.value())
            return False

        wait_until(saw_end, timeout=60, what="END through confluent_kafka")
    finally:
        consumer.close()
    return values


def test_emptied_and_cut_transaction_indexes_are_rebuilt(broker_factory, tmp_path, topic, caplog):
    """Item 4: a closed segment's .txnindex emptied, another cut mid-entry; after a restart no aborted record
    reaches a read_committed reader, every committed one does, and the broker says it rebuilt them."""
    data_dir = tmp_path / "data"
    broker = broker_factory(data_dir=data_dir)
    with Admin(broker.bootstrap) as admin:
        admin.create_topics({topic: 1}, configs=SMALL_SEGMENTS)
    committed = write_transactions(broker.bootstrap, topic, rounds=20)
    directory = partition_dir(broker, topic)
    broker.stop()

    indexes = sorted(glob.glob(os.path.join(directory, "*.txnindex")))[:-1]  # closed segments only
    with_aborts = [path for path in indexes if os.path.getsize(path) >= 2 * ENTRY.size]
    assert len(with_aborts) >= 2, "the transactions must have rolled segments holding ABORT markers"
    emptied, cut = with_aborts[0], with_aborts[-1]
    os.truncate(emptied, 0)
    os.truncate(cut, ENTRY.size + ENTRY.size // 2)  # one whole entry, then half of the next

    caplog.set_level(logging.WARNING, logger="twophase.broker.storage")
    broker = broker_factory(data_dir=data_dir)
    rebuilt = {r.getMessage().split(":")[0] for r in caplog.records if "will be rebuilt" in r.getMessage()}
    assert {emptied, cut} <= rebuilt

    for read in (read_twophase, read_confluent):
        values = read(broker.bootstrap, topic)
        assert not [v for v in values if v.startswith(b"aborted")], read.__name__
        assert sorted(values) == sorted(committed), read.__name__
        assert len(values) == len(committed), read.__name__  # each once


# -- a flipped byte in a closed segment ----------------------------------------------------------------

# Where in a batch the flipped byte lies: its records (under the CRC), the CRC itself, the length and the
# base offset (framing, outside the CRC), the magic byte.
FLIPS = {"record": HEADER_SIZE + 2, "crc": 17, "length": 11, "base_offset": 7, "magic": 16}


def flip_in_closed_segment(directory: str, where: str, segment: int = 1) -> int:
    """Flip one byte of the middle batch of the ``segment``-th segment; returns that batch's base offset."""
    path = sorted(glob.glob(os.path.join(directory, "*.log")))[segment]
    with open(path, "rb") as f:
        raw = f.read()
    batches = list(iter_batches(raw))
    pos, header = batches[len(batches) // 2]
    at = pos + FLIPS[where]
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(bytes([raw[at] ^ 0x01]))
    return header.base_offset


def read_until_refused(plog: PartitionLog, max_bytes: int) -> tuple[list[int], int]:
    """Read from offset 0 as a consumer does; (every offset returned, the offset refused)."""
    offsets: list[int] = []
    offset = 0
    while True:
        try:
            data, end = plog.read_range(offset, max_bytes)
        except CorruptRecordError:
            return offsets, offset
        assert data, f"nothing returned at {offset} below the high watermark {plog.high_watermark}"
        for base, last in batch_offsets(data):
            offsets.extend(range(base, last + 1))
        offset = end


def closed_segments_with_a_flip(tmp_path, where: str, index_interval: int) -> tuple[str, LogConfig, int]:
    """60 batches of 3 records in 1 KiB segments, closed, then a byte flipped (``where``) in a closed
    segment: (partition directory, its config, the damaged batch's base offset)."""
    directory = str(tmp_path / "t-0")
    config = LogConfig(segment_bytes=1024, index_interval_bytes=index_interval)
    plog = PartitionLog(directory, config)
    for i in range(60):
        plog.append(batch([b"v%03d-%d" % (i, j) for j in range(3)]), now_ms=0)
    plog.close()
    return directory, config, flip_in_closed_segment(directory, where)


@pytest.mark.parametrize("snapshots", [True, False], ids=["snapshot", "full-replay"])
@pytest.mark.parametrize("index_interval", [0, 4096], ids=["indexed", "unindexed"])
@pytest.mark.parametrize("where", sorted(FLIPS))
def test_a_flipped_byte_in_a_closed_segment_is_refused_not_served(tmp_path, where, index_interval, snapshots,
                                                                   caplog):
    """Item 10, in storage: whatever byte of a batch flips, the batches before it are served once, its offset
    is refused with CORRUPT_MESSAGE, the next segment stays readable, and an ERROR names the place; also when
    recovery replays the whole log (no producer snapshot) through the damaged segment."""
    directory, config, damaged = closed_segments_with_a_flip(tmp_path, where, index_interval)
    if not snapshots:
        for path in glob.glob(os.path.join(directory, "*.snapshot")):
            os.unlink(path)

    caplog.set_level(logging.ERROR, logger="twophase.broker.storage")
    plog = PartitionLog(directory, config)
    for max_bytes in (1, 300, 1 << 20):
        offsets, refused = read_until_refused(plog, max_bytes)
        assert offsets == list(range(damaged)) and refused == damaged
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert any(f"damaged batch at offset {damaged} " in m and "00000000000000000" in m for m in errors), errors
    later = plog.segments[2].base_offset
    data, _ = plog.read_range(later, 1 << 20)
    assert batch_offsets(data)[0][0] == later
    plog.close()


def produce_numbered(bootstrap: str, topic: str, rounds: int, per_round: int) -> list[bytes]:
    """``rounds`` acknowledged batches of ``per_round`` records, then END; returns the values in order."""
    values = []
    with Producer(bootstrap) as producer:
        for i in range(rounds):
            for j in range(per_round):
                values.append(b"r%04d" % (i * per_round + j))
                producer.send(topic, values[-1], partition=0)
            producer.flush()
        producer.send(topic, END, partition=0)
        producer.flush()
    return values


def stopped_with_a_flipped_byte(broker_factory, tmp_path, topic: str) -> tuple:
    """A real broker wrote 400 numbered records (and END) in 2 KiB segments, was stopped, and a byte of
    a record in its second segment flipped: (data dir, partition dir, values written, damaged offset)."""
    data_dir = tmp_path / "data"
    broker = broker_factory(data_dir=data_dir)
    with Admin(broker.bootstrap) as admin:
        admin.create_topics({topic: 1}, configs={"segment.bytes": "2048"})
    written = produce_numbered(broker.bootstrap, topic, rounds=40, per_round=10)
    directory = partition_dir(broker, topic)
    broker.stop()
    return data_dir, directory, written, flip_in_closed_segment(directory, "record")


def test_a_flipped_byte_in_a_closed_segment_gives_consumers_a_clear_error(broker_factory, tmp_path, topic, caplog):
    """Item 10 with real clients: after a byte flips in a closed segment of a real broker's data directory,
    twophase.client and confluent_kafka read the records before the damage exactly once, then get
    CORRUPT_MESSAGE at the damaged offset (no silent loop re-consuming records), and the broker logs an
    ERROR naming the partition, segment and offset."""
    data_dir, directory, written, damaged = stopped_with_a_flipped_byte(broker_factory, tmp_path, topic)
    assert 0 < damaged < len(written)

    caplog.set_level(logging.ERROR, logger="twophase.broker.storage")
    broker = broker_factory(data_dir=data_dir)

    with Consumer(broker.bootstrap) as consumer:
        consumer.assign([(topic, 0)])
        got: list[bytes] = []

        def refused() -> bool:
            try:
                got.extend(m.value for m in consumer.poll(timeout_s=0.5))
            except CorruptRecordBatch as refusal:
                assert (refusal.topic, refusal.partition, refusal.base_offset) == (topic, 0, damaged)
                return True
            return False

        wait_until(refused, timeout=60, what="CORRUPT_MESSAGE through twophase.client")
        assert got == written[:damaged]
        assert consumer.position(topic, 0) == damaged

    consumer = ConfluentConsumer({"bootstrap.servers": broker.bootstrap, "group.id": f"g-{uuid.uuid4().hex[:8]}",
                                  "enable.auto.commit": False, "fetch.error.backoff.ms": 10})
    try:
        consumer.assign([TopicPartition(topic, 0, OFFSET_BEGINNING)])
        got = []
        errors: list[int] = []

        def refused_twice() -> bool:
            m = consumer.poll(0.5)
            if m is not None and m.error():
                errors.append(m.error().code())
            elif m is not None:
                got.append(m.value())
            return len(errors) >= 2  # refused again on the retry, and nothing delivered in between
        wait_for(refused_twice, timeout=60, what="CORRUPT_MESSAGE twice through confluent_kafka")
        assert errors == [ConfluentError.INVALID_MSG] * 2  # librdkafka's name for CORRUPT_MESSAGE
        assert got == written[:damaged]
    finally:
        consumer.close()

    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert any(f"{topic}-0" in m and ".log" in m and f"damaged batch at offset {damaged} " in m for m in errors)


def test_skip_mode_reads_on_past_what_the_broker_refuses_as_damaged(broker_factory, tmp_path, topic, caplog):
    """Review finding 3 (client part): with on_corrupt="skip", a consumer whose fetch the broker answers
    CORRUPT_MESSAGE (a flipped byte in a closed segment) skips the refused offsets, counted and logged once
    per damaged run, and reads on: every record before the damage once, every record the broker serves
    after it (the next segment's at least) once, in order."""
    data_dir, directory, written, damaged = stopped_with_a_flipped_byte(broker_factory, tmp_path, topic)
    next_segment = int(os.path.basename(sorted(glob.glob(os.path.join(directory, "*.log")))[2]).split(".")[0])
    assert 0 < damaged < next_segment < len(written)

    broker = broker_factory(data_dir=data_dir)
    caplog.set_level(logging.WARNING, logger="twophase.client")
    with Consumer(broker.bootstrap, on_corrupt="skip") as consumer:
        consumer.assign([(topic, 0)])
        got = values_until_end(consumer, 60, "END through twophase.client, skipping the damage")
        skipped = consumer.corrupt_batches_skipped
    assert got[:damaged] == written[:damaged]
    assert got[len(got) - (len(written) - next_segment):] == written[next_segment:]
    assert got == [value for value in written if value in set(got)]  # in order, each once
    assert written[damaged] not in got
    assert skipped == 1
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    started = [w for w in warnings if "the broker refuses offset" in w]
    assert len(started) == 1 and f"{topic}-0: the broker refuses offset {damaged} as damaged" in started[0], warnings
    assert any(f"{topic}-0: skipped offsets {damaged}.." in w for w in warnings), warnings


def test_a_damaged_segment_whose_transaction_index_is_gone_is_never_sealed_as_complete(tmp_path, caplog):
    """A closed segment with broken framing and an emptied .txnindex: recovery re-derives the aborted
    transactions up to the damage, and neither it nor a clean close claims the index complete beyond, so
    the next start replays again instead of trusting it."""
    directory = str(tmp_path / "t-0")
    config = LogConfig(segment_bytes=1024)
    plog = PartitionLog(directory, config)
    aborted: list[tuple[int, int]] = []  # (first offset, marker offset) of each aborted transaction
    for i in range(40):
        first = plog.append(batch([b"a%d" % i], producer_id=1, producer_epoch=0, base_sequence=i,
                                  transactional=True), 0).base_offset
        aborted.append((first, plog.append_marker(1, 0, commit=False, coordinator_epoch=0, now_ms=0)))
    plog.close()
    damaged = flip_in_closed_segment(directory, "base_offset")
    os.truncate(sorted(glob.glob(os.path.join(directory, "*.txnindex")))[1], 0)

    caplog.set_level(logging.WARNING, logger="twophase.broker.storage")
    for _ in range(2):  # the second start follows a clean close of the first
        caplog.clear()
        plog = PartitionLog(directory, config)
        assert "replaying the whole log" in caplog.text
        found = {first for _, first in plog.aborted_transactions(0, damaged)}
        # Every transaction aborted before the damage; the one whose marker was lost may be listed too (the
        # next ABORT of its producer ends it), nothing else.
        assert {first for first, marker in aborted if marker < damaged} <= found
        assert found <= {first for first, _ in aborted if first < damaged}
        plog.close()


@pytest.mark.parametrize("where", sorted(FLIPS))
def test_a_flipped_byte_in_the_active_segment_deletes_no_acknowledged_batch(tmp_path, where, caplog):
    """Review finding 5: a flipped byte in the middle of the active segment is damage, not a torn tail.
    Recovery keeps every batch after it (the file is not cut, the log end offset stays), serves the batches
    before it, refuses its offset with CORRUPT_MESSAGE (and the batches after it are served if only its CRC
    fails), and new appends are served.
    Before, recovery truncated the segment at the flipped batch, deleting acknowledged batches."""
    directory = str(tmp_path / "t-0")
    config = LogConfig(segment_bytes=1 << 20)
    plog = PartitionLog(directory, config)
    for i in range(20):
        plog.append(batch([b"v%03d-%d" % (i, j) for j in range(3)]), now_ms=0)
    end, size = plog.log_end_offset, plog.segments[-1].size
    plog.close()
    damaged = flip_in_closed_segment(directory, where, segment=0)  # the only, active, segment

    caplog.set_level(logging.ERROR, logger="twophase.broker.storage")
    plog = PartitionLog(directory, config)
    try:
        assert plog.log_end_offset == end and os.path.getsize(plog.segments[-1].path) == size
        offsets, refused = read_until_refused(plog, 1 << 20)
        assert offsets == list(range(damaged)) and refused == damaged
        assert any(f"damaged batch at offset {damaged} " in r.getMessage() for r in caplog.records)
        if where in ("record", "crc"):  # its framing holds: it alone is refused (finding 3)
            data, _ = plog.read_range(damaged + 3, 1 << 20)
            assert batch_offsets(data) == [(o, o + 2) for o in range(damaged + 3, end, 3)]
        assert plog.append(batch([b"after"]), now_ms=0).base_offset == end
        data, _ = plog.read_range(end, 1 << 20)
        assert batch_offsets(data) == [(end, end)]
    finally:
        plog.close()


@pytest.mark.parametrize("index_interval", [0, 4096], ids=["indexed", "unindexed"])
@pytest.mark.parametrize("where", ["record", "crc"])
def test_a_batch_failing_only_its_crc_is_refused_alone_and_the_batches_after_it_are_served(
        tmp_path, where, index_interval, caplog):
    """Review finding 3 (broker part): when only a batch's CRC fails and its framing holds (the next batch
    starts at its end with the offset after its last), only its offsets answer CORRUPT_MESSAGE; a consumer
    that skips them reads every later batch of the segment. Before, every offset from it to the end of its
    segment was refused, so skipping one offset per fetch crawled through the whole segment."""
    directory, config, damaged = closed_segments_with_a_flip(tmp_path, where, index_interval)

    caplog.set_level(logging.ERROR, logger="twophase.broker.storage")
    plog = PartitionLog(directory, config)
    try:
        for max_bytes in (1, 300, 1 << 20):
            offsets, refused = read_until_refused(plog, max_bytes)
            assert offsets == list(range(damaged)) and refused == damaged
        for offset in range(damaged, damaged + 3):  # the damaged batch's three records
            with pytest.raises(CorruptRecordError, match=f"offset {damaged + 3} on is served"):
                plog.read_range(offset, 1 << 20)
        # A consumer skipping the batch reads on to the end of the log; nothing is returned twice.
        offsets, end = [], damaged + 3
        while end < plog.high_watermark:
            data, end = plog.read_range(end, 300)
            offsets.extend(o for base, last in batch_offsets(data) for o in range(base, last + 1))
        assert offsets == list(range(damaged + 3, plog.high_watermark))
        assert any(f"damaged batch at offset {damaged} (offsets {damaged}-{damaged + 2}," in r.getMessage()
                   for r in caplog.records)
    finally:
        plog.close()
