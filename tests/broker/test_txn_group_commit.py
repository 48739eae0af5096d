"""AddPartitionsToTxn's record: answered once written, fsynced by group commit in a worker thread,
and awaited by the transaction's Produce before any of its data lands in the partition.

The fsyncs of the transaction log are held (a gate in the worker thread), counted, or failed.
"""

from __future__ import annotations

import asyncio
import os
import threading

import pytest

import twophase.broker.txn.log as txn_log_module
from tests.waiting import wait_until
from twophase.broker.txn.coordinator import NONE, NOT_ENOUGH_REPLICAS
from twophase.client import Consumer, Producer

from .test_group_commit import GatedSync
from .test_txn_coordinator import T0, h, init  # noqa: F401  (h: fixture)


@pytest.fixture
def gated(monkeypatch) -> GatedSync:
    sync = GatedSync(txn_log_module._fsync)
    monkeypatch.setattr(txn_log_module, "_fsync", sync)
    return sync


def test_additions_are_answered_at_once_and_share_one_fsync_off_the_event_loop(h, gated):  # noqa: F811
    ids = {tid: init(h, tid) for tid in ("t1", "t2", "t3")}

    async def scenario() -> None:
        gated.calls = 0
        gated.gate.clear()
        assert h.txns.add_partitions("t1", *ids["t1"], [("a", 0)], T0) == NONE  # answered, not fsynced
        h.txns.sync_soon()
        first = asyncio.ensure_future(h.txns.additions_durable("t1"))
        assert await asyncio.to_thread(gated.entered.wait, 10)  # its fsync is held in the worker
        # The event loop goes on: two more additions meanwhile, their records written behind the held fsync.
        for tid, partition in (("t2", 1), ("t3", 2)):
            assert h.txns.add_partitions(tid, *ids[tid], [("a", partition)], T0) == NONE
            h.txns.sync_soon()
        later = [asyncio.ensure_future(h.txns.additions_durable(tid)) for tid in ("t2", "t3")]
        await asyncio.sleep(0)  # let them start waiting
        assert not first.done()
        gated.gate.set()
        await asyncio.gather(first, *later)

    asyncio.run(scenario())
    assert gated.calls == 2  # the held one, then one for both records written meanwhile
    h.restart()
    assert {tid: h.txns.describe(tid).partitions for tid in ids} == {
        "t1": (("a", 0),), "t2": (("a", 1),), "t3": (("a", 2),)}


def test_a_failed_fsync_of_an_addition_refuses_the_transactions_data(h, gated):  # noqa: F811
    pid, epoch = init(h)
    gated.fail = True
    assert h.txns.add_partitions("app", pid, epoch, [("a", 0)], T0) == NONE
    asyncio.run(h.txns.additions_durable("app"))  # returns: the log has failed, and says so
    assert h.txns.check_produce("app", pid, epoch, "a", 0) == NOT_ENOUGH_REPLICAS


def test_an_addition_lost_in_a_crash_lost_no_data_with_it(h, gated):  # noqa: F811
    # A machine crash before the record's fsync: the file ends where the last fsync left it.
    pid, epoch = init(h)
    synced = os.path.getsize(h.tmp_path / "txn" / txn_log_module.LOG_FILE)
    gated.gate.clear()

    async def crash_before_the_fsync() -> bool:
        assert h.txns.add_partitions("app", pid, epoch, [("a", 0)], T0) == NONE
        h.txns.sync_soon()
        produce = asyncio.ensure_future(h.txns.additions_durable("app"))
        assert await asyncio.to_thread(gated.entered.wait, 10)
        await asyncio.sleep(0)
        parked = not produce.done()
        os.truncate(h.tmp_path / "txn" / txn_log_module.LOG_FILE, synced)  # what the disk kept
        gated.gate.set()
        await produce
        return parked

    assert asyncio.run(crash_before_the_fsync())  # the data waited: nothing reached the partition
    h.restart()
    assert h.txns.describe("app").state == "Empty"
    assert h.txns.check_produce("app", pid, epoch, "a", 0) != NONE  # the producer gets an error, and aborts


def test_a_transactions_produce_waits_for_the_fsync_of_its_partitions_record(broker, topic, gated, monkeypatch):
    tid = f"tx-{topic}"
    parked = threading.Event()
    coordinator = broker.transactions
    original = coordinator.additions_durable

    async def observed(transactional_id: str) -> None:
        if coordinator._log.high_watermark < coordinator._log.log_end_offset:
            parked.set()
        await original(transactional_id)

    monkeypatch.setattr(coordinator, "additions_durable", observed)
    with Producer(broker.bootstrap, transactional_id=tid) as p:
        p.init_transactions()
        p.begin_transaction()
        gated.gate.clear()
        p.send(topic, value=b"v", partition=0)
        assert gated.entered.wait(30)  # AddPartitionsToTxn's record is being fsynced, held
        wait_until(parked.is_set, what="the transaction's Produce waiting for that fsync")
        plog = broker.call(broker.partition_log, topic, 0)
        assert broker.call(lambda: plog.log_end_offset) == 0  # nothing appended before the record is durable
        gated.gate.set()
        p.commit_transaction()
    with Consumer(broker.bootstrap, isolation_level="read_committed") as c:
        c.assign([(topic, 0)])
        assert [m.value for m in c.poll(timeout_s=10)] == [b"v"]
