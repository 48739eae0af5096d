"""Edges of a partition log's life: retention racing the flusher's seals, fetches between the high
watermark and the log end, and DeleteTopics naming a topic twice over.

Each is checked on ``PartitionLog`` directly and, where a client sees it, against a real broker.
"""

from __future__ import annotations

import errno
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Self

import pytest
from kio.schema.errors import ErrorCode

from tests.waiting import wait_until
from twophase.broker.storage import LogConfig, PartitionLog
from twophase.wire.errors import InvalidProducerEpochError, OffsetOutOfRangeError

from .batches import batch, decode
from .conftest import (
    MS,
    WireClient,
    create_topics_request,
    fetch_request,
    only_partition,
    produce_request,
    req,
    sub,
)
from .test_group_commit import gated  # noqa: F401  (a fixture: a held fsync)
from .test_storage_log import open_deleted_segments

HOUR_MS = 3_600_000
SEALED_LATER = LogConfig(flush=1000, segment_bytes=1024, retention_ms=HOUR_MS)  # seals left to the flusher


def fill_segments(log: PartitionLog, count: int, timestamp: int = 1000) -> None:
    """Append 200-byte batches until ``count`` segments exist (each roll queues a seal)."""
    while len(log.segments) < count:
        log.append(batch([b"x" * 200], timestamp=timestamp), 0)


def stray_files(log: PartitionLog) -> list[str]:
    """Index files of segments that are gone, and producer snapshots below the log start."""
    names = os.listdir(log.directory)
    live = {int(n.split(".")[0]) for n in names if n.endswith(".log")}
    return sorted(n for n in names
                  if (n.endswith(".index") and int(n.split(".")[0]) not in live)
                  or (n.endswith(".snapshot") and int(n.split(".")[0]) < log.log_start_offset))


# -- retention and the flusher's seals --------------------------------------------------------------


def test_retention_discards_the_queued_seals_of_the_segments_it_deletes(tmp_path):
    log = PartitionLog(str(tmp_path / "t-0"), SEALED_LATER, now_ms=0)
    fill_segments(log, 3)
    assert log.enforce_retention(10 * HOUR_MS) == 3  # the active segment expired too: rolled, then deleted
    log.flush_due(10 * HOUR_MS)()
    assert stray_files(log) == []
    assert open_deleted_segments(tmp_path) == []
    log.close()


def test_a_seal_handed_to_the_flusher_writes_nothing_for_a_segment_retention_deleted(tmp_path):
    log = PartitionLog(str(tmp_path / "t-0"), SEALED_LATER, now_ms=0)
    fill_segments(log, 3)
    sync = log.flush_due(0)
    log.enforce_retention(10 * HOUR_MS)
    sync()
    assert stray_files(log) == []
    assert open_deleted_segments(tmp_path) == []


def test_producers_whose_data_retention_deleted_are_still_known_after_a_crash(tmp_path):
    log = PartitionLog(str(tmp_path / "t-0"), SEALED_LATER, now_ms=0)
    for seq in range(3):
        log.append(batch([b"x" * 200], producer_id=7, producer_epoch=1, base_sequence=seq, timestamp=1000), 0)
    log.flush()
    log.enforce_retention(10 * HOUR_MS)  # every segment expired: rolled, its seal queued, then deleted
    log.flush_due(10 * HOUR_MS)()  # the flusher's turn: the snapshot at the new log start is kept
    recovered = PartitionLog(log.directory, SEALED_LATER, now_ms=10 * HOUR_MS)  # no close: a crash
    with pytest.raises(InvalidProducerEpochError):  # a zombie of the older epoch stays fenced
        recovered.append(batch([b"z"], producer_id=7, producer_epoch=0, base_sequence=3), 10 * HOUR_MS)
    retry = recovered.append(batch([b"x" * 200], producer_id=7, producer_epoch=1, base_sequence=2), 10 * HOUR_MS)
    assert retry.duplicate  # a retry of the last batch is acknowledged, not stored again
    assert stray_files(recovered) == []
    recovered.close()


class ContendedLock:
    """A lock that tells when someone had to wait for it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.contended = threading.Event()

    def __enter__(self) -> Self:
        if not self._lock.acquire(blocking=False):
            self.contended.set()
            self._lock.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self._lock.release()


def test_retention_waits_for_a_running_seal_of_the_segment_it_deletes(tmp_path, gated):  # noqa: F811
    log = PartitionLog(str(tmp_path / "t-0"), SEALED_LATER, now_ms=0)
    fill_segments(log, 2)
    lock = log._seal_lock = ContendedLock()
    sync = log.flush_due(0)
    gated.gate.clear()
    gated.entered.clear()
    with ThreadPoolExecutor(2) as pool:
        try:
            flusher = pool.submit(sync)
            assert gated.entered.wait(30)  # the seal of segment 0 is in its fsync
            retention = pool.submit(log.enforce_retention, 10 * HOUR_MS)
            assert lock.contended.wait(30), "retention deleted the segment under a running seal"
        finally:
            gated.gate.set()
        flusher.result(30)
        assert retention.result(30) == 2
    # The seal finished first, so its snapshot exists: below the log start now, which recovery ignores.
    assert [n for n in stray_files(log) if n.endswith(".index")] == []


def test_recovery_ignores_a_producer_snapshot_below_the_log_start(tmp_path):
    """The snapshot holds a transaction open whose marker retention deleted: trusting it would pin the LSO."""
    log = PartitionLog(str(tmp_path / "t-0"), SEALED_LATER, now_ms=0)
    log.append(batch([b"t" * 200], producer_id=7, producer_epoch=0, base_sequence=0, transactional=True), 0)
    log.roll()
    log.flush_due(0)()  # the seal writes the snapshot at offset 1: producer 7's transaction open
    log.append_marker(7, 0, commit=True, coordinator_epoch=0, now_ms=0)
    log.roll()  # its seal (the snapshot at 2, transaction ended) stays queued
    log.append(batch([b"new"], timestamp=10 * HOUR_MS), 0)
    log.enforce_retention(10 * HOUR_MS)
    assert log.log_start_offset == 2
    assert log.last_stable_offset == log.high_watermark == 3
    reopened = PartitionLog(log.directory, SEALED_LATER)  # no close (it writes a snapshot): a crash
    assert reopened.log_start_offset == 2
    assert reopened.last_stable_offset == reopened.high_watermark == 3


# -- fetching between the high watermark and the log end -------------------------------------------


def test_an_offset_between_the_high_watermark_and_the_log_end_reads_nothing_rather_than_out_of_range(tmp_path):
    log = PartitionLog(str(tmp_path / "t-0"), LogConfig(flush="always"), now_ms=0)
    log.append(batch([b"t"], producer_id=7, producer_epoch=0, base_sequence=0, transactional=True), 0)
    log.append(batch([b"a"]), 0)
    log.append(batch([b"b"]), 0, defer_fsync=True)  # appended, its fsync pending
    assert (log.last_stable_offset, log.high_watermark, log.log_end_offset) == (0, 2, 3)
    for offset in (2, 3):
        assert log.read_range(offset, 1 << 20) == (b"", offset)
    for offset in (1, 2, 3):  # read_committed: nothing from the LSO on
        assert log.read_range(offset, 1 << 20, upper_offset=log.last_stable_offset) == (b"", offset)
    for offset in (-1, 4):
        with pytest.raises(OffsetOutOfRangeError):
            log.read_range(offset, 1 << 20)
    log.flush()
    assert [v for *_, v in decode(log.read(2, 1 << 20))] == [b"b"]


def test_a_fetch_above_the_high_watermark_waits_for_the_fsync(broker_factory, gated, topic):  # noqa: F811
    broker = broker_factory(fsync="always")
    with WireClient(broker.port) as client:
        assert only_partition(client.request(produce_request(topic, batch([b"warm-up"])))).error_code == 0

    def fetch_parked() -> bool:
        return broker.call(lambda: (topic, 0) in broker._waiters)

    gated.gate.clear()
    gated.entered.clear()
    with ThreadPoolExecutor(2) as pool, WireClient(broker.port, timeout=60) as reader:
        try:
            produced = pool.submit(produce_two_batches, broker.port, topic)  # offsets 1 and 2, fsync held
            assert gated.entered.wait(30)
            plog = broker.call(broker.partition_log, topic, 0)
            assert broker.call(lambda: (plog.high_watermark, plog.log_end_offset)) == (1, 3)
            for offset, code in ((2, 0), (3, 0), (4, ErrorCode.offset_out_of_range)):
                partition = only_partition(reader.request(fetch_request(topic, offset)))
                assert (partition.error_code, partition.records or b"") == (code, b""), offset
            fetched = pool.submit(reader.request, fetch_request(topic, 2, max_wait_ms=120_000))
            wait_until(lambda: fetch_parked() or fetched.done(), 30, 0.01, "the fetch parked")
            assert not fetched.done(), only_partition(fetched.result())
        finally:
            gated.gate.set()  # the fsync makes offsets 1 and 2 visible and wakes the parked fetch
        assert produced.result(30).error_code == 0
        partition = only_partition(fetched.result(30))
    assert (partition.error_code, partition.high_watermark) == (0, 3)
    assert [(offset, value) for offset, _, _, value in decode(partition.records)] == [(2, b"b")]


def test_a_partition_past_the_fetch_budget_above_its_high_watermark_is_not_out_of_range(
        broker_factory, gated, topic):  # noqa: F811
    broker = broker_factory(fsync="always")
    with WireClient(broker.port) as client:
        client.request(create_topics_request((topic, 2, 1, None)))
        for partition in (0, 1):
            assert only_partition(client.request(produce_request(topic, batch([b"w"]), partition))).error_code == 0
    gated.gate.clear()
    gated.entered.clear()
    with ThreadPoolExecutor(1) as pool, WireClient(broker.port) as reader:
        try:
            produced = pool.submit(produce_two_batches, broker.port, topic, 1)  # partition 1: HW 1, log end 3
            assert gated.entered.wait(30)
            # The first partition's batch uses up max_bytes: the second is only checked, not read.
            parts = tuple(sub(1, 12, "FetchPartition", partition=p, current_leader_epoch=-1, fetch_offset=offset,
                              last_fetched_epoch=-1, log_start_offset=-1, partition_max_bytes=1 << 20)
                          for p, offset in ((0, 0), (1, 2)))
            response = reader.request(req(
                1, 12, replica_id=-1, max_wait=0 * MS, min_bytes=1, max_bytes=1, isolation_level=0, session_id=0,
                session_epoch=-1, topics=(sub(1, 12, "FetchTopic", topic=topic, partitions=parts),),
                forgotten_topics_data=(), rack_id=""))
        finally:
            gated.gate.set()
        assert produced.result(30).error_code == 0
    [first, second] = response.responses[0].partitions
    assert (first.error_code, len(decode(first.records))) == (0, 1)
    assert (second.error_code, second.records or b"") == (0, b"")


def produce_two_batches(port: int, topic: str, partition: int = 0):
    with WireClient(port, timeout=30) as client:
        return only_partition(client.request(produce_request(topic, batch([b"a"]) + batch([b"b"]), partition)))


# -- DeleteTopics v6: a name or an id, never both --------------------------------------------------


def delete_topics_v6(client: WireClient, *states: tuple[str | None, object]):
    topics = tuple(sub(20, 6, "DeleteTopicState", name=name, topic_id=topic_id) for name, topic_id in states)
    return client.request(req(20, 6, topics=topics, timeout=10_000 * MS)).responses


def test_delete_topics_with_a_name_and_a_stale_id_deletes_nothing(broker, topic):
    with WireClient(broker.port) as client:
        client.request(create_topics_request((topic, 1, 1, None)))
        stale = broker.call(broker.topics)[topic].topic_id
        [deleted] = delete_topics_v6(client, (topic, None))
        assert deleted.error_code == ErrorCode.none
        client.request(create_topics_request((topic, 1, 1, None)))  # recreated: a new id
        current = broker.call(broker.topics)[topic].topic_id
        assert current != stale
        answers = delete_topics_v6(client, (topic, stale), (topic, current), (None, None))
        assert [(a.name, a.topic_id, a.error_code) for a in answers] == [
            (topic, stale, ErrorCode.invalid_request),
            (topic, current, ErrorCode.invalid_request),
            (None, None, ErrorCode.invalid_request),
        ]
        assert answers[0].error_message == "You may not specify both topic name and topic id."
    assert broker.call(broker.topics)[topic].topic_id == current


# -- a failed open releases its descriptors -----------------------------------------------------------


def open_descriptors() -> set[str]:
    return {os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
            if os.path.exists(f"/proc/self/fd/{fd}")}


def test_a_log_that_fails_to_open_part_way_keeps_no_descriptor(tmp_path, monkeypatch):
    import twophase.broker.storage.segment as segment_module

    log = PartitionLog(str(tmp_path / "t-0"), SEALED_LATER, now_ms=0)
    fill_segments(log, 3)
    log.close()
    before = open_descriptors()

    def no_descriptors(*args, **kwargs):
        raise OSError(errno.EMFILE, "Too many open files")

    real_load = segment_module.TransactionIndex.load
    loads = iter(range(100))

    def load_once_then_fail(*args, **kwargs):  # each segment's last step: the second segment fails
        if next(loads):
            no_descriptors()
        return real_load(*args, **kwargs)

    monkeypatch.setattr(segment_module.TransactionIndex, "load", load_once_then_fail)
    with pytest.raises(OSError):
        PartitionLog(str(tmp_path / "t-0"), SEALED_LATER, now_ms=0)
    monkeypatch.setattr(segment_module.TransactionIndex, "create", no_descriptors)
    with pytest.raises(OSError):
        PartitionLog(str(tmp_path / "t-1"), SEALED_LATER, now_ms=0)  # a new log: its first segment
    assert open_descriptors() - before == set()
