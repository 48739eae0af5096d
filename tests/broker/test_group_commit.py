"""The broker's fsyncs: group commit under fsync "always" (off the event loop, shared by concurrent
produce requests, an acknowledgement only after the fsync, nothing visible to readers before it),
its failures, and a topic's own flush interval.

The disk is the real one; only ``_fdatasync`` is wrapped, to count calls or to hold one back at a gate.
"""

from __future__ import annotations

import asyncio
import errno
import struct
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

import twophase.broker.storage.segment as segment_module
from tests.waiting import wait_until
from twophase.broker.group_commit import GroupCommit
from twophase.broker.storage import LogConfig, PartitionLog
from twophase.wire.codec import encode_request
from twophase.wire.errors import KafkaStorageError
from twophase.wire.records import iter_batches

from .batches import batch
from .conftest import (
    WireClient,
    create_topics_request,
    fetch_request,
    metadata_request,
    only_partition,
    produce_request,
)

KAFKA_STORAGE_ERROR = 56


class GatedSync:
    """Wraps the real fdatasync: counts calls and, while closed, holds each one until opened."""

    def __init__(self, real) -> None:
        self.real = real
        self.calls = 0
        self.entered = threading.Event()
        self.gate = threading.Event()
        self.gate.set()
        self.fail = False
        self.one_per_opening = False  # close the gate behind each fsync let through

    def __call__(self, fd: int) -> None:
        self.calls += 1
        self.entered.set()
        assert self.gate.wait(30), "gate never opened"
        if self.one_per_opening:
            self.gate.clear()
        if self.fail:
            raise OSError(errno.EIO, "injected fsync failure")
        self.real(fd)


@pytest.fixture
def gated(monkeypatch) -> GatedSync:
    sync = GatedSync(segment_module._fdatasync)
    monkeypatch.setattr(segment_module, "_fdatasync", sync)
    return sync


def produce(port: int, topic: str, value: bytes):
    with WireClient(port, timeout=30) as client:
        return only_partition(client.request(produce_request(topic, batch([value]))))


def fetched_values(port: int, topic: str) -> tuple[int, int]:
    """(high watermark, records) a read_uncommitted fetch from offset 0 returns."""
    with WireClient(port) as client:
        partition = only_partition(client.request(fetch_request(topic, 0)))
    assert partition.error_code == 0, partition.error_code
    records = sum(header.record_count for _, header in iter_batches(partition.records or b""))
    return partition.high_watermark, records


def test_an_unsynced_batch_is_neither_acknowledged_nor_visible(broker_factory, gated, topic):
    broker = broker_factory(fsync="always")
    assert produce(broker.port, topic, b"first").error_code == 0
    gated.gate.clear()
    gated.entered.clear()
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(produce, broker.port, topic, b"second")
        assert gated.entered.wait(30)  # appended, its fsync running in a worker thread
        # The event loop is free meanwhile, and readers still see only the first record.
        assert fetched_values(broker.port, topic) == (1, 1)
        assert not pending.done()
        gated.gate.set()
        assert pending.result(30).error_code == 0
    assert fetched_values(broker.port, topic) == (2, 2)


def test_concurrent_produce_requests_share_fsyncs(broker_factory, gated, topic):
    broker = broker_factory(fsync="always")
    assert produce(broker.port, topic, b"warm-up").error_code == 0
    gated.calls = 0
    gated.gate.clear()
    gated.entered.clear()
    requests = 12
    with ThreadPoolExecutor(requests) as pool:
        first = pool.submit(produce, broker.port, topic, b"v0")
        assert gated.entered.wait(30)  # the first fsync is held: the others append meanwhile
        rest = [pool.submit(produce, broker.port, topic, b"v%d" % i) for i in range(1, requests)]
        plog = broker.call(broker.partition_log, topic, 0)
        wait_until(lambda: broker.call(lambda: plog.log_end_offset) == 1 + requests, 30, 0.01,
                   "every request appended behind the held fsync")
        assert not first.done()
        gated.gate.set()
        results = [first.result(30)] + [f.result(30) for f in rest]
    assert all(r.error_code == 0 for r in results)
    assert sorted(r.base_offset for r in results) == list(range(1, 1 + requests))
    assert gated.calls == 2, f"{requests} requests took {gated.calls} fsyncs"  # the held one, then one for all
    assert fetched_values(broker.port, topic) == (1 + requests, 1 + requests)


def test_a_failed_fsync_is_an_error_to_the_producer_and_takes_only_that_log_offline(broker_factory, gated, topic):
    broker = broker_factory(fsync="always")
    assert produce(broker.port, topic, b"kept").error_code == 0
    gated.fail = True
    assert produce(broker.port, topic, b"lost").error_code == KAFKA_STORAGE_ERROR
    with WireClient(broker.port) as client:  # the log is offline, the broker is not
        assert only_partition(client.request(fetch_request(topic, 0))).error_code == KAFKA_STORAGE_ERROR
    gated.fail = False
    assert produce(broker.port, f"{topic}-other", b"elsewhere").error_code == 0


def test_a_connections_in_flight_produce_requests_share_an_fsync_and_are_answered_in_order(
        broker_factory, gated, topic):
    broker = broker_factory(fsync="always")
    assert produce(broker.port, topic, b"warm-up").error_code == 0
    plog = broker.call(broker.partition_log, topic, 0)
    gated.calls = 0
    gated.gate.clear()
    with WireClient(broker.port, timeout=30) as client:
        # Five Produce requests back to back, as a client with max.in.flight 5 sends them, then
        # a request of another kind, which must wait for all five.
        produces = [produce_request(topic, batch([b"v%d" % i])) for i in range(5)]
        ids = [client.send(request) for request in produces]
        metadata_id = client.send(metadata_request(12, [topic]))
        wait_until(lambda: broker.call(lambda: plog.log_end_offset) == 6, 30, 0.01,
                   "all five appended while the first fsync is held")
        gated.gate.set()
        # recv() checks the correlation id: the answers come in request order.
        answers = [only_partition(client.recv(type(request), cid)) for request, cid in zip(produces, ids)]
        assert client.recv(type(metadata_request(12, [topic])), metadata_id).topics[0].name == topic
    assert [a.error_code for a in answers] == [0] * 5
    assert [a.base_offset for a in answers] == [1, 2, 3, 4, 5]
    assert gated.calls == 2  # the held one, then one for the other four


# -- GroupCommit on its own, over a real PartitionLog ----------------------------------------------


def durable_after_append(tmp_path, value: bytes = b"v"):
    """Append under fsync "always" with the fsync deferred, then await GroupCommit.durable()."""
    plog = PartitionLog(str(tmp_path / "t-0"), LogConfig(flush="always"))
    result = plog.append(batch([value]), 0, defer_fsync=True)
    assert plog.high_watermark == result.base_offset  # appended, not yet visible
    asyncio.run(GroupCommit().durable(plog, result.last_offset + 1, lambda: None))
    return plog


def test_durable_moves_the_high_watermark_after_the_fsync(tmp_path, gated):
    plog = durable_after_append(tmp_path)
    assert (plog.high_watermark, gated.calls) == (1, 1)


def test_any_failure_of_the_worker_takes_the_log_offline(tmp_path, monkeypatch):
    def broken(fd):
        raise RuntimeError("executor gone")

    monkeypatch.setattr(segment_module, "_fdatasync", broken)
    plog = PartitionLog(str(tmp_path / "t-0"), LogConfig(flush="always"))
    result = plog.append(batch([b"v"]), 0, defer_fsync=True)
    with pytest.raises(KafkaStorageError):
        asyncio.run(GroupCommit().durable(plog, result.last_offset + 1, lambda: None))
    # Offline: neither visible nor acknowledged on a retry, which would otherwise find it "synced".
    assert plog.high_watermark == 0
    with pytest.raises(KafkaStorageError):
        plog.append(batch([b"v"]), 0, defer_fsync=True)


def test_without_a_spare_descriptor_the_fsync_runs_on_the_event_loop(tmp_path, gated, monkeypatch):
    def no_descriptors(fd):
        raise OSError(errno.EMFILE, "Too many open files")

    monkeypatch.setattr(segment_module.os, "dup", no_descriptors)
    plog = durable_after_append(tmp_path)
    assert (plog.high_watermark, gated.calls) == (1, 1)


def test_a_topic_flush_interval_is_kept_under_a_broker_that_fsyncs_always(broker_factory, gated, topic):
    broker = broker_factory(fsync="always")
    with WireClient(broker.port) as client:
        created = client.request(create_topics_request((topic, 1, 1, {"flush.ms": "100"})))
        assert created.topics[0].error_code == 0
    gated.calls = 0
    assert produce(broker.port, topic, b"v").error_code == 0  # answered without waiting for an fsync
    wait_until(lambda: gated.calls >= 1, 10, 0.01, "the topic's periodic fsync")


def test_nothing_after_a_request_that_closes_the_connection_is_handled(broker_factory, topic):
    broker = broker_factory(fsync="always")
    assert produce(broker.port, topic, b"warm-up").error_code == 0
    plog = broker.call(broker.partition_log, topic, 0)
    produce_v0 = struct.pack(">hhih", 0, 0, 2, -1)  # Produce v0 (v3+ is spoken): closes the connection
    with WireClient(broker.port) as client:
        client.send_raw(encode_request(1, produce_request(topic, batch([b"before"])))
                        + struct.pack(">i", len(produce_v0)) + produce_v0
                        + encode_request(3, produce_request(topic, batch([b"after"]))))
        assert only_partition(client.recv(type(produce_request(topic, b"")), 1)).error_code == 0
        assert client.is_closed()
    assert broker.call(lambda: (plog.log_end_offset, plog.high_watermark)) == (2, 2)


def test_data_appended_during_an_fsync_becomes_durable_and_wakes_readers_without_anyone_waiting(tmp_path, gated):
    # Its producer may be gone (a connection reset): the data must not wait for the next produce,
    # and parked fetches must not wait for their max wait to see it.
    visible_at: list[int] = []

    async def scenario() -> tuple[int, int]:
        group_commit = GroupCommit()
        plog = PartitionLog(str(tmp_path / "t-0"), LogConfig(flush="always"))
        first = plog.append(batch([b"a"]), 0, defer_fsync=True)
        gated.gate.clear()
        on_visible = lambda: visible_at.append(plog.high_watermark)  # noqa: E731
        waiter = asyncio.ensure_future(group_commit.durable(plog, first.last_offset + 1, on_visible))
        assert await asyncio.to_thread(gated.entered.wait, 10)  # its fsync is held in the worker
        unwaited = plog.append(batch([b"b"]), 0, defer_fsync=True)
        gated.gate.set()
        await waiter
        await group_commit.drain()
        return plog.high_watermark, unwaited.last_offset + 1

    high_watermark, end = asyncio.run(scenario())
    assert high_watermark == end
    assert visible_at == [1, 2]  # after the held fsync, and after the one chained for the unwaited batch


def test_a_parked_fetch_wakes_for_a_batch_whose_producer_went_away(broker_factory, gated, topic):
    broker = broker_factory(fsync="always")
    assert produce(broker.port, topic, b"warm-up").error_code == 0
    plog = broker.call(broker.partition_log, topic, 0)

    def fetch_parked() -> bool:
        return broker.call(lambda: (topic, 0) in broker._waiters)

    gated.one_per_opening = True
    gated.gate.clear()
    gated.entered.clear()
    with ThreadPoolExecutor(2) as pool:
        waited = pool.submit(produce, broker.port, topic, b"a")
        assert gated.entered.wait(30)  # "a" is held in its fsync
        with WireClient(broker.port) as gone:  # "b" is appended meanwhile; its producer does not wait
            gone.send(produce_request(topic, batch([b"b"])))
        wait_until(lambda: broker.call(lambda: plog.log_end_offset) == 3, 30, 0.01, "b appended")
        # A long poll that only both batches satisfy, with a max wait far beyond this test's patience.
        min_bytes = len(batch([b"a"])) + 1
        with WireClient(broker.port, timeout=60) as reader:
            fetched = pool.submit(reader.request, fetch_request(topic, 1, max_wait_ms=120_000, min_bytes=min_bytes))
            wait_until(fetch_parked, 30, 0.01, "the fetch parked")
            gated.entered.clear()
            gated.gate.set()  # the fsync of "a" only; the one chained for "b" is held next
            assert waited.result(30).error_code == 0 and gated.entered.wait(30)
            wait_until(fetch_parked, 30, 0.01, "the fetch parked again, seeing only a")
            gated.one_per_opening = False
            gated.gate.set()  # nobody waits for this fsync but the parked fetch
            partition = only_partition(fetched.result(20))
    assert partition.error_code == 0 and partition.high_watermark == 3
    assert sum(header.record_count for _, header in iter_batches(partition.records)) == 2
