"""A full disk: the broker's data directory on a small tmpfs that a filler file fills up, or an fsync that
fails for want of space.

Produce answers KAFKA_STORAGE_ERROR at once (per partition) while there is no space, leaves nothing
half-written behind, and works again once space is back, without a restart; a consumer then reads
every acknowledged record once and nothing that was refused.
"""

from __future__ import annotations

import errno
import logging
import os
import subprocess
import time
from collections.abc import Iterator

import pytest
from confluent_kafka import Producer as ConfluentProducer

from tests.adversarial.reading import END, read_until_end
from tests.broker.batches import batch, decode
from tests.broker.conftest import WireClient, only_partition, produce_request
from tests.waiting import wait_until
from twophase.broker.storage import LogConfig, PartitionLog
from twophase.broker.storage import segment as segment_module
from twophase.client import Admin

KAFKA_STORAGE_ERROR = 56
VALUE_BYTES = 16 * 1024  # more than a page: a write cannot fit in what the last page of a file has left


@pytest.fixture
def small_disk(tmp_path) -> Iterator[str]:
    """A 4 MiB tmpfs mounted for the test (skipped where mounting is not permitted)."""
    mountpoint = tmp_path / "disk"
    mountpoint.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mountpoint)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield str(mountpoint)
    finally:
        subprocess.run(["umount", "-l", str(mountpoint)], check=True)


def fill(directory: str) -> str:
    """Write a filler file until the disk is full; returns its path."""
    path = os.path.join(directory, "filler")
    with open(path, "wb", buffering=0) as f:
        with pytest.raises(OSError) as full:
            while True:
                f.write(b"\0" * 4096)
    assert full.value.errno == errno.ENOSPC
    return path


def test_disk_full_answers_storage_error_at_once_and_recovers_when_space_returns(
        small_disk, broker_factory, topic, caplog):
    caplog.set_level(logging.INFO, logger="twophase.broker")
    broker = broker_factory(data_dir=os.path.join(small_disk, "data"))
    with Admin(broker.bootstrap) as admin:
        admin.create_topics({topic: 1})
    acked: list[bytes] = []
    failed: list[str] = []

    def delivered(err, msg) -> None:
        if err is None:
            acked.append(msg.value())
        else:
            failed.append(str(err))

    producer = ConfluentProducer({"bootstrap.servers": broker.bootstrap, "enable.idempotence": True,
                                  "linger.ms": 0, "message.timeout.ms": 120_000})
    producer.produce(topic, b"before".ljust(VALUE_BYTES, b"."), partition=0, on_delivery=delivered)
    assert producer.flush(30) == 0 and len(acked) == 1  # the producer id is taken before the disk fills

    filler = fill(small_disk)
    refused = batch([b"refused".ljust(VALUE_BYTES, b".")])
    with WireClient(broker.port) as wire:
        answer = only_partition(wire.request(produce_request(topic, refused)))
        assert answer.error_code == KAFKA_STORAGE_ERROR  # at once, for this partition
        # The librdkafka producer is refused too, and retries.
        for i in range(5):
            producer.produce(topic, b"during-%d" % i + b".".rjust(VALUE_BYTES, b"."), partition=0,
                             on_delivery=delivered)
        producer.poll(0)
        wait_until(lambda: sum("refused" in r.getMessage() for r in caplog.records) >= 2,
                   what="the producer's batch refused too")
        assert len(acked) == 1 and not failed

        os.unlink(filler)  # space returns: no restart
        assert producer.flush(60) == 0
        assert not failed and len(acked) == 6
        answer = only_partition(wire.request(produce_request(topic, batch([END]))))
        assert answer.error_code == 0
    del producer  # librdkafka's descriptors go with the last reference (it has no close())
    assert "space is back" in caplog.text

    assert read_until_end(broker.bootstrap, topic) == acked  # each acknowledged record once, in order; no refused one


def test_a_partition_offline_after_a_failed_fsync_comes_back_without_a_restart(
        broker_factory, topic, monkeypatch, caplog):
    """A failed fsync (ENOSPC, as thin-provisioned or network storage reports a full disk) takes the partition
    offline: produce answers KAFKA_STORAGE_ERROR at once. Once fsyncs succeed again a later produce brings it
    back, cut back to what was acknowledged: the batch whose fsync failed is nowhere."""
    caplog.set_level(logging.WARNING, logger="twophase.broker.storage")
    broker = broker_factory()
    with Admin(broker.bootstrap) as admin:
        admin.create_topics({topic: 1})
    real_fdatasync = segment_module._fdatasync
    disk_full = True

    def fdatasync(fd: int) -> None:
        if disk_full:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_fdatasync(fd)

    with WireClient(broker.port) as wire:
        def produce(value: bytes) -> int:
            return only_partition(wire.request(produce_request(topic, batch([value])))).error_code

        assert produce(b"acked") == 0
        monkeypatch.setattr(segment_module, "_fdatasync", fdatasync)
        assert produce(b"written, fsync failed") == KAFKA_STORAGE_ERROR
        assert produce(b"refused, offline") == KAFKA_STORAGE_ERROR  # at once: nothing is written
        disk_full = False
        wait_until(lambda: produce(b"after") == 0, what="the partition back online")  # no restart
        assert produce(END) == 0
    assert "back online" in caplog.text and "dropping" in caplog.text
    reopened = broker.logs.partition(topic, 0)
    assert reopened._open_files is broker.logs._open_files  # its segment files count against the broker's cap
    assert read_until_end(broker.bootstrap, topic) == [b"acked", b"after"]


@pytest.mark.parametrize("flush", ["always", "1000"])
def test_a_full_disk_at_a_segment_roll_only_refuses_the_append(small_disk, broker_factory, topic, caplog, flush):
    """Review finding 7: an append that must roll a segment when the disk is full (no space for the new
    segment's files, its transaction index, the old one's index or the producer snapshot) is refused with
    KAFKA_STORAGE_ERROR and undone; the partition stays online (before, it went offline), and the next
    append after space returns succeeds at once and rolls."""
    caplog.set_level(logging.INFO, logger="twophase.broker")
    broker = broker_factory(data_dir=os.path.join(small_disk, "data"))
    with Admin(broker.bootstrap) as admin:
        admin.create_topics({topic: 1}, configs={"segment.bytes": "1024", "flush.ms": flush})
    directory = os.path.join(small_disk, "data", f"{topic}-0")
    now = int(time.time() * 1000)  # retention must not take the first segment once rolled
    with WireClient(broker.port) as wire:
        first = batch([b"first".ljust(VALUE_BYTES, b".")], timestamp=now)
        assert only_partition(wire.request(produce_request(topic, first))).error_code == 0
        filler = fill(small_disk)
        refused = batch([b"refused".ljust(VALUE_BYTES, b".")], timestamp=now)  # larger than a segment: rolls first
        assert only_partition(wire.request(produce_request(topic, refused))).error_code == KAFKA_STORAGE_ERROR
        assert len([n for n in os.listdir(directory) if n.endswith(".log")]) == 1  # the new segment undone
        os.unlink(filler)
        answer = only_partition(wire.request(produce_request(topic, batch([END], timestamp=now))))
        assert answer.error_code == 0  # at once: the partition never went offline
    assert "offline" not in caplog.text
    assert len([n for n in os.listdir(directory) if n.endswith(".log")]) == 2
    assert read_until_end(broker.bootstrap, topic) == [b"first".ljust(VALUE_BYTES, b".")]


def test_no_space_for_an_offset_index_file_leaves_the_segment_without_one(tmp_path, monkeypatch, caplog):
    """Review finding 7: the flusher's seal of a rolled segment finds no space for its index file: the
    segment goes on without one (a WARNING; the next start CRC-checks and indexes it) instead of the log
    going offline."""
    config = LogConfig(flush=1000, segment_bytes=1024)
    plog = PartitionLog(str(tmp_path / "t-0"), config)
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        if os.readlink(f"/proc/self/fd/{fd}").endswith(".index"):
            raise OSError(errno.ENOSPC, "No space left on device")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    while len(plog.segments) < 3:
        plog.append(batch([b"x" * 300]), now_ms=0)
    plog.flush_due(0)()  # the flusher: seals of the rolled segments
    monkeypatch.undo()
    assert not plog.offline and "no space for its index file" in caplog.text
    assert not [n for n in os.listdir(plog.directory) if n.endswith(".index")]
    written = len(decode(plog.read(0, 1 << 20)))
    end = plog.log_end_offset
    plog.close()
    reopened = PartitionLog(plog.directory, config)
    try:
        assert reopened.log_end_offset == end and len(decode(reopened.read(0, 1 << 20))) == written
    finally:
        reopened.close()
