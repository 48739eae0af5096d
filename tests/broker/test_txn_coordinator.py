"""The transaction coordinator on its own (no sockets): state machine, errors, markers, log, recovery.

Partition logs are fakes that record markers; the group offsets are a real OffsetStore in a
temporary directory. The real partition side is exercised by test_txn_wire and test_txn_interop.
"""

from __future__ import annotations

import logging
import os
from types import SimpleNamespace

import pytest

import twophase.broker.txn.log as txn_log_module
from twophase.broker.groups import OffsetStore
from twophase.broker.txn import (
    TRANSITIONS, TransactionCoordinator, TransactionLog, TxnMetadata, TxnSettings, TxnState)
from twophase.broker.txn.coordinator import (
    CONCURRENT_TRANSACTIONS, INVALID_PRODUCER_EPOCH, INVALID_PRODUCER_ID_MAPPING, INVALID_TRANSACTION_TIMEOUT,
    INVALID_TXN_STATE, NONE, PRODUCER_FENCED, TRANSACTIONAL_ID_AUTHORIZATION_FAILED, UNKNOWN_PRODUCER_ID)
from twophase.broker.txn.hanging import open_transactions
from twophase.broker.txn.log import LOG_FILE
from twophase.broker.txn.metadata import MAX_EPOCH
from twophase.states import IllegalTransition
from twophase.wire.errors import UnknownTopicOrPartitionError

T0 = 1_700_000_000_000


class FakeProducers:
    """The transactions a fake partition holds open: producer id -> (epoch, first offset)."""

    def __init__(self):
        self.open = {}

    def open_transactions(self):
        return {producer_id: start for producer_id, (_, start) in self.open.items()}

    def entry(self, producer_id):
        held = self.open.get(producer_id)
        return None if held is None else SimpleNamespace(epoch=held[0], txn_first_offset=held[1])


class FakePartition:
    def __init__(self, name, markers):
        self.name, self.markers = name, markers
        self.fail = False
        self.producers = FakeProducers()
        self.flushed_end = 1 << 62  # every marker is fsynced at once, as under fsync "always"

    def append_marker(self, producer_id, producer_epoch, commit, coordinator_epoch, now_ms, *, flush=True):
        if self.fail:
            raise OSError("disk gone")
        self.markers.append((self.name, producer_id, producer_epoch, commit))
        self.producers.open.pop(producer_id, None)
        return len(self.markers)


class Harness:
    """A coordinator over fake partitions; ``restart()`` builds a new one on the same directories."""

    def __init__(self, tmp_path, **settings):
        self.tmp_path = tmp_path
        self.settings = TxnSettings(**settings)
        self.markers: list = []
        self.woken: list = []
        self.partitions = {(t, p): FakePartition(f"{t}-{p}", self.markers) for t in ("a", "b") for p in range(3)}
        self.next_pid = 100
        self.restart()

    def allocate(self):
        self.next_pid += 1
        return self.next_pid

    def partition(self, topic, partition):
        try:
            return self.partitions[(topic, partition)]
        except KeyError:
            raise UnknownTopicOrPartitionError(f"{topic}-{partition}") from None

    def restart(self, now_ms=T0):
        if getattr(self, "txns", None):
            self.txns.close()
        self.offsets = OffsetStore(str(self.tmp_path / "groups"))
        self.txns = TransactionCoordinator(str(self.tmp_path / "txn"), partition_log=self.partition,
                                           offsets=self.offsets, allocate_producer_id=self.allocate,
                                           data_arrived=lambda t, p: self.woken.append((t, p)),
                                           settings=self.settings)
        self.txns.recover(now_ms)
        return self.txns


@pytest.fixture
def h(tmp_path):
    harness = Harness(tmp_path, max_timeout_ms=60_000, id_expiration_ms=3_600_000)
    yield harness
    harness.txns.close()


def init(h, tid="app", timeout=10_000, now=T0, **kw):
    r = h.txns.init_producer_id(tid, timeout, now_ms=now, **kw)
    assert r.error == NONE, r
    return r.producer_id, r.producer_epoch


def state(h, tid="app"):
    return h.txns.describe(tid).state


# -- the state machine ---------------------------------------------------------------------------

def test_every_transition_not_listed_fails_loudly():
    for source in TxnState:
        for target in TxnState:
            meta = TxnMetadata("x", 1, 0, 1000, state=source)
            if TRANSITIONS.allows(source, target):
                meta.transition(target)
                assert meta.state is target
            else:
                with pytest.raises(IllegalTransition):
                    meta.transition(target)
    assert not TRANSITIONS.targets(TxnState.DEAD)
    # A decision, once logged, can only be completed the same way.
    assert TRANSITIONS.targets(TxnState.PREPARE_COMMIT) == {TxnState.COMPLETE_COMMIT}


def test_metadata_round_trips_through_its_log_form():
    meta = TxnMetadata("x", 5, 3, 1000, state=TxnState.ONGOING, two_phase=True, txn_producer_id=5,
                       txn_producer_epoch=2, partitions={("a", 1), ("b", 0)}, groups={"g"}, start_ms=7,
                       last_update_ms=9, previous_producer_id=4, previous_producer_epoch=32766)
    assert TxnMetadata.from_dict("x", meta.to_dict()) == meta


# -- InitProducerId ------------------------------------------------------------------------------

def test_new_id_gets_a_new_producer_and_reinit_bumps_the_epoch(h):
    pid, epoch = init(h)
    assert (pid, epoch) == (101, 0)
    assert init(h) == (101, 1)
    assert init(h, "other")[0] == 102
    assert state(h) == "Empty"


def test_timeout_is_validated_except_for_two_phase(h):
    for bad in (0, -1, 60_001):
        assert h.txns.init_producer_id("app", bad, now_ms=T0).error == INVALID_TRANSACTION_TIMEOUT
    assert h.txns.init_producer_id("app", 2**31 - 1, enable_two_phase=True, now_ms=T0).error == NONE


def test_two_phase_can_be_forbidden(tmp_path):
    h = Harness(tmp_path, allow_two_phase=False)
    assert h.txns.init_producer_id("app", 1000, enable_two_phase=True, now_ms=T0).error == \
        TRANSACTIONAL_ID_AUTHORIZATION_FAILED
    assert h.txns.init_producer_id("app", 1000, now_ms=T0).error == NONE
    h.txns.close()


def reinit(h, pid, epoch, tid="app", now=T0, **kw):
    """InitProducerId from an instance holding (pid, epoch) (KIP-360): (error, producer id, epoch)."""
    r = h.txns.init_producer_id(tid, 10_000, producer_id=pid, producer_epoch=epoch, now_ms=now, **kw)
    return r.error, r.producer_id, r.producer_epoch


def log_size(h):
    return os.path.getsize(h.tmp_path / "txn" / LOG_FILE)


def test_kip360_only_the_current_instance_may_bump_its_epoch(h):
    pid, epoch = init(h)
    assert reinit(h, pid, epoch) == (NONE, pid, 1)
    assert reinit(h, pid, 1) == (NONE, pid, 2)
    assert reinit(h, pid, 0)[0] == PRODUCER_FENCED  # older than the previous epoch
    assert reinit(h, pid + 1, 2)[0] == PRODUCER_FENCED
    assert h.txns.init_producer_id("new", 1000, producer_id=5, producer_epoch=0, now_ms=T0).error == \
        INVALID_PRODUCER_ID_MAPPING


def test_a_retry_with_the_previous_epoch_gets_the_current_one_again(h):
    pid, epoch = init(h)
    assert reinit(h, pid, epoch) == (NONE, pid, epoch + 1)
    size = log_size(h)
    assert reinit(h, pid, epoch) == (NONE, pid, epoch + 1)  # the answer was lost: no second bump
    assert log_size(h) == size
    h.restart()  # the previous epoch is in the log
    assert reinit(h, pid, epoch) == (NONE, pid, epoch + 1)
    assert h.txns.add_partitions("app", pid, epoch + 1, [("a", 0)], T0) == NONE


def test_a_new_instance_or_a_timeout_forgets_the_previous_epoch(h):
    pid, epoch = init(h)
    reinit(h, pid, epoch)
    assert init(h) == (pid, epoch + 2)  # a new instance: the one that asked for epoch + 1 is fenced
    assert reinit(h, pid, epoch)[0] == PRODUCER_FENCED
    assert reinit(h, pid, epoch + 1)[0] == PRODUCER_FENCED
    assert reinit(h, pid, epoch + 2) == (NONE, pid, epoch + 3)
    h.txns.add_partitions("app", pid, epoch + 3, [("a", 0)], T0)
    h.txns.check(T0 + 10_001)  # timed out: aborted with epoch + 4, which nobody holds
    assert state(h) == "CompleteAbort"
    assert reinit(h, pid, epoch + 2)[0] == PRODUCER_FENCED
    assert reinit(h, pid, epoch + 3)[0] == PRODUCER_FENCED


def test_the_previous_epoch_after_new_work_bumps_again(h):
    pid, epoch = init(h)
    reinit(h, pid, epoch)
    h.txns.add_partitions("app", pid, epoch + 1, [("a", 0)], T0)
    # Not a lost answer (the instance used it); the only one that can send this pair holds the
    # current epoch, so it is treated as that instance: its transaction is aborted, the epoch bumped.
    assert reinit(h, pid, epoch) == (NONE, pid, epoch + 3)
    assert h.markers == [("a-0", pid, epoch + 2, False)]


def test_an_abort_that_must_be_retried_still_accepts_the_retried_request(h):
    pid, epoch = init(h)
    h.txns.add_partitions("app", pid, epoch, [("a", 0)], T0)
    h.partitions[("a", 0)].fail = True
    assert reinit(h, pid, epoch)[0] == CONCURRENT_TRANSACTIONS  # abort logged, its marker not written
    assert state(h) == "PrepareAbort"
    h.partitions[("a", 0)].fail = False
    assert reinit(h, pid, epoch) == (NONE, pid, epoch + 2)
    assert h.markers == [("a-0", pid, epoch + 1, False)]
    assert reinit(h, pid, epoch) == (NONE, pid, epoch + 2)


def write_epoch(h, epoch, tid="app"):
    """Set the logged epoch of ``tid`` while the coordinator is down (no test waits 32766 bumps)."""
    h.txns.close()
    log = TransactionLog(str(h.tmp_path / "txn"))
    meta = TxnMetadata.from_dict(tid, log.open()[tid])
    meta.producer_epoch = epoch
    log.append(tid, meta.to_dict())
    log.close()
    h.restart()


def test_an_exhausted_epoch_gets_a_new_producer_id(h):
    pid, _ = init(h)
    write_epoch(h, MAX_EPOCH - 1)
    assert reinit(h, pid, MAX_EPOCH - 2)[0] == PRODUCER_FENCED
    assert reinit(h, pid, MAX_EPOCH - 1) == (NONE, pid + 1, 0)
    assert reinit(h, pid, MAX_EPOCH - 1) == (NONE, pid + 1, 0)  # retried: the same new id, no third one
    h.restart()
    assert reinit(h, pid, MAX_EPOCH - 1) == (NONE, pid + 1, 0)
    assert reinit(h, pid + 1, 0) == (NONE, pid + 1, 1)
    assert reinit(h, pid, MAX_EPOCH - 1)[0] == PRODUCER_FENCED


def test_an_exhausted_epoch_without_a_producer_id_in_the_request(h):
    pid, _ = init(h)
    write_epoch(h, MAX_EPOCH - 1)
    assert init(h) == (pid + 1, 0)


def test_an_exhausted_epoch_with_an_open_transaction(h):
    pid, _ = init(h)
    write_epoch(h, MAX_EPOCH - 1)
    h.txns.add_partitions("app", pid, MAX_EPOCH - 1, [("a", 0)], T0)
    assert reinit(h, pid, MAX_EPOCH - 1) == (NONE, pid + 1, 1)
    # The old id's data is aborted with the one epoch left to it.
    assert h.markers == [("a-0", pid, MAX_EPOCH, False)]
    assert reinit(h, pid, MAX_EPOCH - 1) == (NONE, pid + 1, 1)


def test_records_logged_before_the_previous_epoch_existed_replay(h):
    pid, epoch = init(h)
    reinit(h, pid, epoch)
    h.txns.close()
    log = TransactionLog(str(h.tmp_path / "txn"))
    old_form = {k: v for k, v in log.open()["app"].items() if k not in ("prev_pid", "prev_epoch")}
    log.append("app", old_form)
    log.close()
    h.restart()
    d = h.txns.describe("app")
    assert (d.producer_id, d.producer_epoch, d.state) == (pid, epoch + 1, "Empty")
    assert reinit(h, pid, epoch)[0] == PRODUCER_FENCED  # no previous pair known: as before
    assert reinit(h, pid, epoch + 1) == (NONE, pid, epoch + 2)


def test_reinit_aborts_the_open_transaction_and_fences_the_old_instance(h):
    pid, epoch = init(h)
    assert h.txns.add_partitions("app", pid, epoch, [("a", 0), ("b", 1)], T0) == NONE
    new_pid, new_epoch = init(h)
    assert new_pid == pid and new_epoch == epoch + 2
    # Abort markers carry a newer epoch than the old instance's data, so its later writes are refused.
    assert h.markers == [("a-0", pid, epoch + 1, False), ("b-1", pid, epoch + 1, False)]
    assert h.txns.end_txn("app", pid, epoch, True, T0) == PRODUCER_FENCED
    assert h.txns.add_partitions("app", pid, epoch, [("a", 0)], T0) == PRODUCER_FENCED
    assert h.txns.check_produce("app", pid, epoch, "a", 0) == INVALID_PRODUCER_EPOCH
    assert state(h) == "Empty"


# -- a transaction -------------------------------------------------------------------------------

def test_commit_writes_a_marker_on_every_partition_then_completes(h):
    pid, epoch = init(h)
    assert state(h) == "Empty"
    assert h.txns.check_produce("app", pid, epoch, "a", 0) == INVALID_TXN_STATE  # not added yet
    assert h.txns.add_partitions("app", pid, epoch, [("a", 0)], T0 + 1) == NONE
    assert h.txns.add_partitions("app", pid, epoch, [("b", 2), ("a", 0)], T0 + 2) == NONE
    assert state(h) == "Ongoing"
    assert h.txns.check_produce("app", pid, epoch, "b", 2) == NONE
    assert h.txns.describe("app").start_ms == T0 + 1
    assert h.txns.end_txn("app", pid, epoch, True, T0 + 3) == NONE
    assert h.markers == [("a-0", pid, epoch, True), ("b-2", pid, epoch, True)]
    assert sorted(h.woken) == [("a", 0), ("b", 2)]
    assert state(h) == "CompleteCommit"
    assert h.txns.check_produce("app", pid, epoch, "a", 0) == INVALID_TXN_STATE  # a late batch is refused


def test_retried_end_txn_succeeds_only_with_the_same_outcome(h):
    pid, epoch = init(h)
    h.txns.add_partitions("app", pid, epoch, [("a", 0)], T0)
    assert h.txns.end_txn("app", pid, epoch, False, T0) == NONE
    assert h.txns.end_txn("app", pid, epoch, False, T0) == NONE
    assert h.txns.end_txn("app", pid, epoch, True, T0) == INVALID_TXN_STATE
    assert len(h.markers) == 1
    assert h.txns.end_txn("app", pid, epoch + 1, False, T0) == PRODUCER_FENCED
    assert h.txns.end_txn("app", pid + 1, epoch, False, T0) == INVALID_PRODUCER_ID_MAPPING
    assert h.txns.end_txn("nobody", pid, epoch, False, T0) == INVALID_PRODUCER_ID_MAPPING


def test_end_txn_without_a_transaction_is_invalid(h):
    pid, epoch = init(h)
    assert h.txns.end_txn("app", pid, epoch, True, T0) == INVALID_TXN_STATE


def test_next_transaction_starts_fresh(h):
    pid, epoch = init(h)
    h.txns.add_partitions("app", pid, epoch, [("a", 0)], T0)
    h.txns.end_txn("app", pid, epoch, True, T0)
    h.txns.add_partitions("app", pid, epoch, [("b", 0)], T0 + 5)
    d = h.txns.describe("app")
    assert (d.state, d.partitions, d.start_ms) == ("Ongoing", (("b", 0),), T0 + 5)


def test_markers_that_fail_are_retried_and_block_new_work_meanwhile(h):
    pid, epoch = init(h)
    h.txns.add_partitions("app", pid, epoch, [("a", 0), ("a", 1)], T0)
    h.partitions[("a", 1)].fail = True
    assert h.txns.end_txn("app", pid, epoch, True, T0) == NONE  # the decision is durable
    assert state(h) == "PrepareCommit"
    assert h.txns.add_partitions("app", pid, epoch, [("a", 0)], T0) == CONCURRENT_TRANSACTIONS
    assert h.txns.end_txn("app", pid, epoch, True, T0) == CONCURRENT_TRANSACTIONS
    assert h.txns.end_txn("app", pid, epoch, False, T0) == INVALID_TXN_STATE
    h.partitions[("a", 1)].fail = False
    h.txns.check(T0 + 1)
    assert state(h) == "CompleteCommit"
    assert ("a-1", pid, epoch, True) in h.markers


def test_a_deleted_partition_does_not_block_completion(h):
    pid, epoch = init(h)
    h.txns.add_partitions("app", pid, epoch, [("a", 0), ("a", 1)], T0)
    del h.partitions[("a", 1)]
    assert h.txns.end_txn("app", pid, epoch, True, T0) == NONE
    assert state(h) == "CompleteCommit" and h.markers == [("a-0", pid, epoch, True)]


# -- transactional offsets -----------------------------------------------------------------------

def test_offsets_become_visible_only_on_commit(h):
    pid, epoch = init(h)
    assert h.txns.txn_offset_commit("app", pid, epoch, "g", {("a", 0): (5, -1, "")}, T0) == INVALID_TXN_STATE
    assert h.txns.add_offsets("app", pid, epoch, "g", T0) == NONE
    assert h.txns.txn_offset_commit("app", pid, epoch, "g", {("a", 0): (5, -1, "m")}, T0) == NONE
    assert h.offsets.get("g", "a", 0) is None and h.offsets.has_pending("g", "a", 0)
    h.txns.end_txn("app", pid, epoch, True, T0)
    assert h.offsets.get("g", "a", 0).offset == 5 and not h.offsets.has_pending("g", "a", 0)
    h.txns.add_offsets("app", pid, epoch, "g", T0)
    h.txns.txn_offset_commit("app", pid, epoch, "g", {("a", 0): (9, -1, "")}, T0)
    h.txns.end_txn("app", pid, epoch, False, T0)
    assert h.offsets.get("g", "a", 0).offset == 5 and not h.offsets.has_pending("g", "a", 0)


def test_pending_offsets_survive_a_restart_and_commit_afterwards(h):
    pid, epoch = init(h)
    h.txns.add_offsets("app", pid, epoch, "g", T0)
    h.txns.txn_offset_commit("app", pid, epoch, "g", {("b", 1): (7, -1, None)}, T0)
    h.restart()
    assert h.offsets.has_pending("g", "b", 1)
    assert h.txns.end_txn("app", pid, epoch, True, T0) == NONE
    h.restart()
    assert h.offsets.get("g", "b", 1).offset == 7 and not h.offsets.has_pending("g", "b", 1)


# -- timeouts, 2PC, expiration ---------------------------------------------------------------------

def test_a_timed_out_transaction_is_aborted_and_its_producer_fenced(h):
    pid, epoch = init(h, timeout=1_000)
    h.txns.add_partitions("app", pid, epoch, [("a", 0)], T0)
    h.txns.check(T0 + 1_000)
    assert state(h) == "Ongoing"
    h.txns.check(T0 + 1_001)
    assert state(h) == "CompleteAbort"
    assert h.markers == [("a-0", pid, epoch + 1, False)]
    assert h.txns.end_txn("app", pid, epoch, True, T0) == PRODUCER_FENCED


def test_timeout_clock_resumes_after_a_restart(h):
    pid, epoch = init(h, timeout=1_000)
    h.txns.add_partitions("app", pid, epoch, [("a", 0)], T0)
    h.restart(now_ms=T0 + 500)
    assert state(h) == "Ongoing"
    h.txns.check(T0 + 1_001)
    assert state(h) == "CompleteAbort"


def test_a_two_phase_transaction_never_times_out_and_can_be_taken_over(h):
    pid, epoch = init(h, timeout=1_000, enable_two_phase=True)
    h.txns.add_partitions("app", pid, epoch, [("a", 0), ("b", 0)], T0)
    h.restart(now_ms=T0 + 10_000_000)
    h.txns.check(T0 + 10_000_000)
    assert state(h) == "Ongoing" and h.markers == []
    # A new instance keeps the prepared transaction: new epoch, and the pair the data was written with.
    r = h.txns.init_producer_id("app", 1_000, enable_two_phase=True, keep_prepared=True, now_ms=T0 + 10_000_001)
    assert (r.error, r.producer_id, r.producer_epoch) == (NONE, pid, epoch + 1)
    assert (r.ongoing_producer_id, r.ongoing_producer_epoch) == (pid, epoch)
    assert state(h) == "Ongoing" and h.markers == []
    # It may only end it; the old instance is fenced.
    assert h.txns.add_partitions("app", pid, epoch + 1, [("a", 1)], T0) == INVALID_TXN_STATE
    assert h.txns.check_produce("app", pid, epoch + 1, "a", 0) == INVALID_TXN_STATE
    assert h.txns.end_txn("app", pid, epoch, True, T0) == PRODUCER_FENCED
    assert h.txns.end_txn("app", pid, epoch + 1, True, T0) == NONE
    assert h.markers == [("a-0", pid, epoch + 1, True), ("b-0", pid, epoch + 1, True)]
    assert h.txns.end_txn("app", pid, epoch + 1, True, T0) == NONE  # a retry from another process


def test_keep_prepared_without_a_transaction_reports_none_ongoing(h):
    init(h, enable_two_phase=True)
    r = h.txns.init_producer_id("app", 1_000, enable_two_phase=True, keep_prepared=True, now_ms=T0)
    assert (r.error, r.ongoing_producer_id, r.ongoing_producer_epoch) == (NONE, -1, -1)


def test_a_take_over_after_the_commit_keeps_the_outcome_describable(h):
    """A second completer of one prepared transaction arrives after the first committed it."""
    pid, epoch = init(h, enable_two_phase=True)
    h.txns.add_partitions("app", pid, epoch, [("a", 0)], T0)
    first = h.txns.init_producer_id("app", 1_000, enable_two_phase=True, keep_prepared=True, now_ms=T0)
    assert h.txns.end_txn("app", pid, first.producer_epoch, True, T0) == NONE
    second = h.txns.init_producer_id("app", 1_000, enable_two_phase=True, keep_prepared=True, now_ms=T0)
    assert (second.ongoing_producer_id, second.ongoing_producer_epoch) == (-1, -1)
    assert state(h) == "CompleteCommit" and h.txns.describe("app").producer_id == pid
    h.restart(now_ms=T0)
    assert state(h) == "CompleteCommit"
    # An ordinary new instance starts afresh.
    init(h, enable_two_phase=True)
    assert state(h) == "Empty"


def test_a_retried_take_over_gets_the_same_answer(h):
    pid, epoch = init(h, enable_two_phase=True)
    h.txns.add_partitions("app", pid, epoch, [("a", 0)], T0)
    take_over = {"enable_two_phase": True, "keep_prepared": True}
    first = h.txns.init_producer_id("app", 1_000, producer_id=pid, producer_epoch=epoch, now_ms=T0, **take_over)
    again = h.txns.init_producer_id("app", 1_000, producer_id=pid, producer_epoch=epoch, now_ms=T0, **take_over)
    assert first == again
    assert (again.producer_epoch, again.ongoing_producer_id, again.ongoing_producer_epoch) == (epoch + 1, pid, epoch)
    # A take-over by a new instance (no producer id) fences the one that asked before.
    fresh = h.txns.init_producer_id("app", 1_000, now_ms=T0, **take_over)
    assert (fresh.producer_epoch, fresh.ongoing_producer_epoch) == (epoch + 2, epoch)
    assert reinit(h, pid, epoch, **take_over)[0] == PRODUCER_FENCED
    assert reinit(h, pid, epoch + 1, **take_over)[0] == PRODUCER_FENCED
    assert h.txns.end_txn("app", pid, epoch + 2, True, T0) == NONE
    assert h.markers == [("a-0", pid, epoch + 2, True)]


def test_init_without_keep_prepared_aborts_a_prepared_transaction(h):
    pid, epoch = init(h, enable_two_phase=True)
    h.txns.add_partitions("app", pid, epoch, [("a", 0)], T0)
    init(h, enable_two_phase=True)
    assert h.markers == [("a-0", pid, epoch + 1, False)]


def test_idle_ids_expire_and_are_compacted_out_of_the_log(tmp_path):
    h = Harness(tmp_path, id_expiration_ms=1_000)
    h.txns._log.compact_min_records = 4
    pid, epoch = init(h, "busy")
    h.txns.add_partitions("busy", pid, epoch, [("a", 0)], T0)
    for i in range(6):
        init(h, f"idle-{i}")
    h.txns.check(T0 + 1_001)
    assert h.txns.describe("idle-0") is None and state(h, "busy") == "Ongoing"
    assert h.txns.list_transactions()[2] == [("busy", pid, "Ongoing")]
    h.restart(now_ms=T0 + 1_002)
    assert h.txns.describe("idle-5") is None and state(h, "busy") == "Ongoing"
    data = (tmp_path / "txn" / LOG_FILE).read_bytes()
    assert all(f"idle-{i}".encode() not in data for i in range(5))  # at most a tombstone appended since
    h.txns.close()


def test_list_filters(h):
    pid, epoch = init(h, "app-1")
    h.txns.add_partitions("app-1", pid, epoch, [("a", 0)], T0)
    init(h, "app-2")
    assert [t for t, _, _ in h.txns.list_transactions(now_ms=T0)[2]] == ["app-1", "app-2"]
    assert h.txns.list_transactions(states=["Ongoing", "Bogus"], now_ms=T0)[1:] == (
        ["Bogus"], [("app-1", pid, "Ongoing")])
    assert h.txns.list_transactions(producer_ids=[pid], now_ms=T0)[2] == [("app-1", pid, "Ongoing")]
    assert h.txns.list_transactions(pattern="app-[2]", now_ms=T0)[2][0][0] == "app-2"
    assert h.txns.list_transactions(pattern="(", now_ms=T0)[0] == 128
    assert h.txns.list_transactions(pattern="(" * 5_000 + ")" * 5_000, now_ms=T0)[0] == 128  # too long/deep
    assert h.txns.list_transactions(states=["Ongoing"], min_duration_ms=10, now_ms=T0 + 5)[2] == []
    assert len(h.txns.list_transactions(states=["Ongoing"], min_duration_ms=10, now_ms=T0 + 11)[2]) == 1


# -- the durable log and recovery ------------------------------------------------------------------

def test_recovery_finishes_a_logged_decision(h):
    pid, epoch = init(h)
    h.txns.add_partitions("app", pid, epoch, [("a", 0), ("a", 2)], T0)
    h.txns.add_offsets("app", pid, epoch, "g", T0)
    h.txns.txn_offset_commit("app", pid, epoch, "g", {("a", 0): (3, -1, "")}, T0)
    h.partitions[("a", 2)].fail = True  # as if the broker died after the first marker
    h.txns.end_txn("app", pid, epoch, True, T0)
    assert state(h) == "PrepareCommit" and h.offsets.get("g", "a", 0) is None
    h.restart()  # the partition still fails: the decision and its pending offsets are kept
    assert state(h) == "PrepareCommit" and h.offsets.has_pending("g", "a", 0)
    h.partitions[("a", 2)].fail = False
    h.markers.clear()
    h.restart()
    assert state(h) == "CompleteCommit"
    assert h.markers == [("a-0", pid, epoch, True), ("a-2", pid, epoch, True)]
    assert h.offsets.get("g", "a", 0).offset == 3


def test_replay_keeps_the_last_record_per_id_and_truncates_a_torn_tail(h, caplog):
    pid, epoch = init(h)
    h.txns.add_partitions("app", pid, epoch, [("b", 1)], T0)
    h.txns.close()
    path = h.tmp_path / "txn" / LOG_FILE
    intact = path.read_bytes()
    with open(path, "ab") as f:
        f.write(intact[:-1][-30:])  # half a record
    h.restart()
    assert state(h) == "Ongoing" and h.txns.describe("app").partitions == (("b", 1),)
    assert "truncating" in caplog.text
    assert path.read_bytes() == intact
    h.txns.end_txn("app", pid, epoch, True, T0)  # appends go after the good records
    h.restart()
    assert state(h) == "CompleteCommit"


def test_a_corrupt_record_ends_the_replay(tmp_path):
    log = TransactionLog(str(tmp_path))
    log.open()
    log.append("x", {"v": 1})
    log.append("x", {"v": 2})
    log.close()
    data = bytearray((tmp_path / LOG_FILE).read_bytes())
    data[-2] ^= 0xFF  # flip a byte of the last record's payload: its CRC no longer matches
    (tmp_path / LOG_FILE).write_bytes(bytes(data))
    reopened = TransactionLog(str(tmp_path))
    assert reopened.open() == {"x": {"v": 1}}
    reopened.close()
    assert os.path.getsize(tmp_path / LOG_FILE) < len(data)


def test_a_failed_log_write_takes_the_coordinator_offline_until_a_restart(h, monkeypatch):
    """Memory may already be ahead of the log (PrepareCommit in memory, Ongoing on disk): refuse everything."""
    pid, epoch = init(h)
    h.txns.add_partitions("app", pid, epoch, [("a", 0)], T0)

    def disk_full(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(txn_log_module, "_fsync", disk_full)
    assert h.txns.end_txn("app", pid, epoch, True, T0) == 15  # answered, not a dropped connection
    monkeypatch.undo()
    assert h.txns.end_txn("app", pid, epoch, True, T0) == 15  # COORDINATOR_NOT_AVAILABLE
    assert h.txns.init_producer_id("other", 1_000, now_ms=T0).error == 15
    h.txns.check(T0 + 10**9)
    assert h.markers == []  # nothing acted on the undurable decision
    h.restart()  # the record reached the file (only its fsync failed): recovery finishes the decision
    assert state(h) == "CompleteCommit" and h.markers == [("a-0", pid, epoch, True)]
    assert h.txns.end_txn("app", pid, epoch, True, T0) == NONE  # the producer's retry


# -- producer ids in plain (non-transactional) batches ---------------------------------------------

def test_plain_batches_take_only_idempotent_producer_ids(h):
    pid, _ = init(h)
    idempotent = h.allocate()
    assert h.txns.check_idempotent_produce(idempotent, 0) == NONE
    assert h.txns.check_idempotent_produce(idempotent, 1) == NONE  # the Java producer's own bump (KIP-360)
    assert h.txns.check_idempotent_produce(pid, 0) == INVALID_PRODUCER_ID_MAPPING  # a transactional id's
    assert h.txns.check_idempotent_produce(-5, 0) == UNKNOWN_PRODUCER_ID
    h.restart()  # ownership comes back from the transaction log
    assert h.txns.check_idempotent_produce(pid, 0) == INVALID_PRODUCER_ID_MAPPING


def test_an_id_keeps_its_producer_ids_through_an_epoch_roll_over_while_its_transaction_is_open(h):
    pid, _ = init(h)
    write_epoch(h, MAX_EPOCH - 1)
    assert h.txns.add_partitions("app", pid, MAX_EPOCH - 1, [("a", 0)], T0) == NONE
    new_pid, _ = init(h, keep_prepared=True, enable_two_phase=True)  # a take-over keeps the open transaction
    assert new_pid != pid
    for owned in (pid, new_pid):  # the open transaction's and the current instance's
        assert h.txns.check_idempotent_produce(owned, 0) == INVALID_PRODUCER_ID_MAPPING


# -- hanging transactions found at start ---------------------------------------------------------

def test_only_a_producer_id_nobody_owns_has_its_open_transaction_aborted_at_start(h, caplog):
    pid, epoch = init(h)
    for partitions in ([("a", 0), ("a", 1)], [("a", 1)]):  # T1 on a-0 and a-1, then T2 on a-1 only
        assert h.txns.add_partitions("app", pid, epoch, partitions, T0) == NONE
        assert h.txns.end_txn("app", pid, epoch, True, T0) == NONE
    # After a restart a-0 still holds T1 open (its COMMIT marker was lost to damage), and a-2 a
    # transaction of a producer id this coordinator never issued (its transaction log was lost).
    h.partitions[("a", 0)].producers.open[pid] = (epoch, 5)
    h.partitions[("a", 2)].producers.open[999] = (3, 7)
    h.markers.clear()
    h.restart()
    with caplog.at_level(logging.WARNING, "twophase.broker.txn"):
        h.txns.resolve_open_transactions(open_transactions(h.partitions), T0)
        h.txns.check(T0 + h.settings.max_timeout_ms + 1)
    assert h.markers == [("a-2", 999, 3, False)]  # the unknown one is aborted once the timeout has passed
    assert h.partitions[("a", 0)].producers.open == {pid: (epoch, 5)}  # T1 may have committed: left alone
    [error] = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert f"a-0: open transaction of producer {pid} epoch {epoch} from offset 5 belongs to transactional id 'app'" \
        in error
    assert f"twophase txns find-hanging / abort --topic a --partition 0 --producer-id {pid}" in error
