"""The transaction log under failure and abuse: a failed write, an oversized transaction, a damaged
file, and a client's regular expression.

- A failed write (ENOSPC) must leave memory at what the log holds, and the coordinator must take no
  work for any transaction until a restart: otherwise data lands in a partition that, after the
  restart, no transaction covers (the LSO stays below the HW for ever, and the next commit of the
  id exposes the aborted records).
- A transaction gets a clean error before its log record could outgrow what the log accepts; the log
  refuses oversized records; replay never drops intact records after one it cannot read.
- ListTransactions patterns are matched in linear time, so "(a+)+b" cannot stall the broker.

Failures are injected into the transaction log's file object (its next write raises ENOSPC).
"""

from __future__ import annotations

import dataclasses
import errno
import os
import subprocess
import sys

import pytest
from kio.schema.errors import ErrorCode

from twophase.broker.groups import OffsetStore
from twophase.broker.txn import (
    TXN_DIR,
    TransactionCoordinator,
    TransactionLog,
    TxnMetadata,
    TxnState,
)
from twophase.broker.txn import coordinator as coordinator_module
from twophase.broker.txn.coordinator import (
    COORDINATOR_NOT_AVAILABLE,
    MAX_GROUPS_PER_TXN,
    MAX_PARTITIONS_PER_TXN,
    NOT_ENOUGH_REPLICAS,
)
from twophase.broker.txn.log import (
    LOG_FILE,
    MAX_RECORD_BYTES,
    TransactionLogCorrupt,
    TransactionLogFailed,
    TransactionRecordTooLarge,
    encode_record,
)
from twophase.zkserver import free_port

from .batches import batch, decode
from .conftest import WireClient, fetch_request, produce_request, req
from .test_broker_crash import BrokerProcess
from .test_txn_wire import add_partitions, end_txn, init_pid, produce_txn

T0 = 1_700_000_000_000
READ_COMMITTED = 1


class FullDisk:
    """Stands in for the transaction log's file: the next write fails with ENOSPC, later ones pass."""

    def __init__(self, real) -> None:
        self.real, self.armed = real, True

    def write(self, data: bytes) -> int:
        if self.armed:
            self.armed = False
            raise OSError(errno.ENOSPC, "No space left on device")
        return self.real.write(data)

    def __getattr__(self, name):
        return getattr(self.real, name)


def fill_disk(txn_log: TransactionLog) -> None:
    txn_log._file = FullDisk(txn_log._file)


def read_committed(w: WireClient, topic: str, partition: int = 0):
    """(high watermark, last stable offset, values a read_committed consumer gets)."""
    fetch = dataclasses.replace(fetch_request(topic, 0, partition), isolation_level=READ_COMMITTED)
    p = w.request(fetch).responses[0].partitions[0]
    return p.high_watermark, p.last_stable_offset, [v for *_, v in decode(p.records or b"")]


def describe(w: WireClient, tid: str):
    [d] = w.request(req(65, 0, transactional_ids=(tid,))).transaction_states
    return d.transaction_state, sorted((t.topic, p) for t in d.topics for p in t.partitions)


# -- a failed log write ------------------------------------------------------------------------


def test_after_a_failed_log_write_no_data_is_taken_and_nothing_stays_open_after_a_restart(broker_factory, tmp_path,
                                                                                         topic):
    data_dir = tmp_path / "data"
    b = broker_factory(data_dir)
    w = WireClient(b.port)
    w.request(produce_request(topic, batch([b"before"])))  # creates the topic
    r = init_pid(w, "app")
    pid, epoch = r.producer_id, r.producer_epoch
    fill_disk(b.transactions._log)
    # The write that fails, then the client's retries: every path into the transaction is refused,
    # with errors clients retry, on the same connection.
    assert add_partitions(w, "app", pid, epoch, {topic: [0]}) == {(topic, 0): ErrorCode.coordinator_not_available}
    assert add_partitions(w, "app", pid, epoch, {topic: [0]}) == {(topic, 0): ErrorCode.coordinator_not_available}
    assert produce_txn(w, "app", topic, 0, pid, epoch, 0, (b"orphan",)) == ErrorCode.not_enough_replicas
    assert end_txn(w, "app", pid, epoch, False) == ErrorCode.coordinator_not_available
    assert init_pid(w, "app").error_code == ErrorCode.coordinator_not_available
    assert describe(w, "app") == ("Empty", [])  # memory is what the log holds
    b.stop()

    b = broker_factory(data_dir)  # the disk has room again
    w = WireClient(b.port)
    w.request(produce_request(topic, batch([b"later"])))
    hw, lso, values = read_committed(w, topic)
    assert (lso, values) == (hw, [b"before", b"later"])  # no transaction holds the partition back
    r = init_pid(w, "app")
    pid, epoch = r.producer_id, r.producer_epoch
    assert add_partitions(w, "app", pid, epoch, {topic: [0]}) == {(topic, 0): ErrorCode.none}
    assert produce_txn(w, "app", topic, 0, pid, epoch, 0, (b"new",)) == ErrorCode.none
    assert end_txn(w, "app", pid, epoch, True) == ErrorCode.none
    hw, lso, values = read_committed(w, topic)
    assert (lso, values) == (hw, [b"before", b"later", b"new"])


class FakePartition:
    flushed_end = 1  # its marker (offset 0) is fsynced

    def append_marker(self, producer_id, producer_epoch, commit, coordinator_epoch, now_ms, *, flush=True):
        return 0


def coordinator(tmp_path) -> TransactionCoordinator:
    pids = iter(range(100, 10_000))
    c = TransactionCoordinator(str(tmp_path / TXN_DIR), partition_log=lambda t, p: FakePartition(),
                               offsets=OffsetStore(str(tmp_path / "groups")), allocate_producer_id=lambda: next(pids),
                               data_arrived=lambda t, p: None)
    c.recover(T0)
    return c


def _open(c, tid, **kw):
    r = c.init_producer_id(tid, 10_000, now_ms=T0, **kw)
    assert c.add_partitions(tid, r.producer_id, r.producer_epoch, [("a", 0)], T0) == 0
    return r


def _empty(c, tid):
    return c.init_producer_id(tid, 10_000, now_ms=T0)


class Unfinished(FakePartition):
    def append_marker(self, *args, **kwargs):
        raise OSError(errno.EIO, "marker write failed")


# Each case: (set up state, the operation whose log write fails). Every state transition is covered.
TRANSITIONS = {
    "init a new id": (lambda c, tid: None, lambda c, r: c.init_producer_id("app", 10_000, now_ms=T0)),
    "init bumps an idle id": (_empty, lambda c, r: c.init_producer_id("app", 10_000, now_ms=T0)),
    "init aborts the open transaction": (_open, lambda c, r: c.init_producer_id("app", 10_000, now_ms=T0)),
    "init keeps a prepared transaction": (
        lambda c, tid: _open(c, tid, enable_two_phase=True),
        lambda c, r: c.init_producer_id("app", 10_000, enable_two_phase=True, keep_prepared=True, now_ms=T0)),
    "add partitions begins a transaction": (
        _empty, lambda c, r: c.add_partitions("app", r.producer_id, r.producer_epoch, [("a", 0)], T0)),
    "add partitions to the open transaction": (
        _open, lambda c, r: c.add_partitions("app", r.producer_id, r.producer_epoch, [("a", 1)], T0)),
    "add offsets": (_open, lambda c, r: c.add_offsets("app", r.producer_id, r.producer_epoch, "g", T0)),
    "end txn prepares": (_open, lambda c, r: c.end_txn("app", r.producer_id, r.producer_epoch, True, T0)),
    "timeout aborts": (_open, lambda c, r: c.check(T0 + 10**6)),
    "expiration forgets": (_empty, lambda c, r: c.check(T0 + 10**12)),
}


@pytest.mark.parametrize("case", TRANSITIONS)
def test_a_failed_log_write_leaves_memory_at_what_the_log_holds(tmp_path, case):
    setup, operation = TRANSITIONS[case]
    c = coordinator(tmp_path)
    r = setup(c, "app")
    fill_disk(c._log)
    if case in ("timeout aborts", "expiration forgets"):
        with pytest.raises(TransactionLogFailed):  # the broker's periodic check logs it
            operation(c, r)
    else:  # a request: answered, its connection kept
        answer = operation(c, r)
        assert getattr(answer, "error", answer) == COORDINATOR_NOT_AVAILABLE
    replayed = TransactionLog(str(tmp_path / TXN_DIR)).open()
    assert {tid: m.to_dict() for tid, m in c._txns.items()} == replayed
    if r is not None:
        pid, epoch = r.producer_id, r.producer_epoch
        assert c.add_partitions("app", pid, epoch, [("a", 0)], T0) == COORDINATOR_NOT_AVAILABLE
        assert c.add_offsets("app", pid, epoch, "g", T0) == COORDINATOR_NOT_AVAILABLE
        assert c.check_produce("app", pid, epoch, "a", 0) == NOT_ENOUGH_REPLICAS
        assert c.end_txn("app", pid, epoch, False, T0) == COORDINATOR_NOT_AVAILABLE
    c.close()


def test_a_failed_complete_record_leaves_the_decision_to_recovery(tmp_path):
    c = coordinator(tmp_path)
    r = _open(c, "app")
    c._partition_log = lambda t, p: Unfinished()
    assert c.end_txn("app", r.producer_id, r.producer_epoch, True, T0) == 0  # decided; markers retried later
    c._partition_log = lambda t, p: FakePartition()
    fill_disk(c._log)
    with pytest.raises(TransactionLogFailed):
        c.check(T0)  # markers written now, CompleteCommit not logged
    assert c.describe("app").state == TxnState.PREPARE_COMMIT.value
    c.close()
    c = coordinator(tmp_path)  # recovery rewrites the markers and completes
    assert c.describe("app").state == TxnState.COMPLETE_COMMIT.value
    c.close()


# -- size bounds -------------------------------------------------------------------------------


def test_a_transaction_past_the_partition_cap_is_abortable_and_every_id_survives_a_restart(broker_factory, tmp_path,
                                                                                           topic, monkeypatch):
    monkeypatch.setattr(coordinator_module, "MAX_PARTITIONS_PER_TXN", 2)
    data_dir = tmp_path / "data"
    b = broker_factory(data_dir, default_partitions=3)
    w = WireClient(b.port)
    w.request(produce_request(topic, batch([b"before"])))
    big, small = init_pid(w, "big"), init_pid(w, "small")
    assert add_partitions(w, "big", big.producer_id, big.producer_epoch, {topic: [0, 1]}) == {
        (topic, 0): ErrorCode.none, (topic, 1): ErrorCode.none}
    assert add_partitions(w, "big", big.producer_id, big.producer_epoch, {topic: [2]}) == {
        (topic, 2): ErrorCode.transaction_abortable}
    assert add_partitions(w, "small", small.producer_id, small.producer_epoch, {topic: [2]}) == {
        (topic, 2): ErrorCode.none}
    assert produce_txn(w, "big", topic, 2, big.producer_id, big.producer_epoch, 0) == ErrorCode.invalid_txn_state
    b.stop()

    b = broker_factory(data_dir, default_partitions=3)
    w = WireClient(b.port)
    assert describe(w, "big") == ("Ongoing", [(topic, 0), (topic, 1)])
    assert describe(w, "small") == ("Ongoing", [(topic, 2)])
    assert end_txn(w, "big", big.producer_id, big.producer_epoch, False) == ErrorCode.none  # what the client does
    assert end_txn(w, "small", small.producer_id, small.producer_epoch, True) == ErrorCode.none
    for partition in range(3):
        hw, lso, _ = read_committed(w, topic, partition)
        assert lso == hw


def test_the_largest_transaction_the_caps_allow_fits_in_one_record():
    huge = "\x00" * 32_767  # the longest Kafka string, each character escaped to 6 bytes in JSON
    meta = TxnMetadata(huge, 1, 0, 60_000, state=TxnState.ONGOING,
                       partitions={("t" * 249, p) for p in range(2**31 - MAX_PARTITIONS_PER_TXN, 2**31)},
                       groups={huge[:-i] for i in range(1, MAX_GROUPS_PER_TXN + 1)})
    assert len(encode_record(huge, meta.to_dict())) < MAX_RECORD_BYTES


def test_the_log_refuses_an_oversized_record_and_stays_usable(tmp_path):
    txn_log = TransactionLog(str(tmp_path))
    txn_log.open()
    txn_log.append("before", {"v": 1})
    with pytest.raises(TransactionRecordTooLarge):
        txn_log.append("big", {"v": "x" * MAX_RECORD_BYTES})
    assert txn_log.failed is None
    txn_log.append("after", {"v": 2})
    txn_log.close()
    assert TransactionLog(str(tmp_path)).open() == {"before": {"v": 1}, "after": {"v": 2}}


def test_replay_keeps_intact_records_after_an_oversized_one_an_older_version_wrote(tmp_path):
    big = {"v": "x" * MAX_RECORD_BYTES}
    (tmp_path / LOG_FILE).write_bytes(encode_record("a", {"v": 1}) + encode_record("big", big)
                                      + encode_record("b", {"v": 2}))
    assert TransactionLog(str(tmp_path)).open() == {"a": {"v": 1}, "big": big, "b": {"v": 2}}


def test_replay_refuses_to_drop_intact_records_after_a_damaged_one(tmp_path):
    records = [encode_record(tid, {"v": i}) for i, tid in enumerate("abc")]
    damaged = bytearray(b"".join(records))
    damaged[len(records[0]) + len(records[1]) - 2] ^= 0xFF  # inside b's payload
    (tmp_path / LOG_FILE).write_bytes(bytes(damaged))
    with pytest.raises(TransactionLogCorrupt, match="intact one"):
        TransactionLog(str(tmp_path)).open()
    assert (tmp_path / LOG_FILE).read_bytes() == damaged  # nothing truncated


def test_a_broker_whose_disk_filled_up_stops_cleanly_and_restarts(broker_factory, tmp_path):
    """A real ENOSPC from the kernel (/dev/full behind the log's own file object): the refused record must
    not linger in a buffer that the broker's stop would flush again, fail on, and stop half-way."""
    data_dir = tmp_path / "data"
    b = broker_factory(data_dir)
    with WireClient(b.port) as w:
        assert init_pid(w, "kept").error_code == ErrorCode.none
        full = os.open("/dev/full", os.O_WRONLY)
        os.dup2(full, b.transactions._log._file.fileno())
        os.close(full)
        assert init_pid(w, "refused").error_code == ErrorCode.coordinator_not_available
    b.stop()  # raised ENOSPC from the buffered record before, leaving the data directory locked
    b = broker_factory(data_dir)
    with WireClient(b.port) as w:
        assert describe(w, "kept")[0] == "Empty"
        assert init_pid(w, "refused").error_code == ErrorCode.none  # a new id, logged now


def test_the_cli_reports_a_damaged_log_and_exits_2(tmp_path):
    records = [encode_record(tid, {"v": i}) for i, tid in enumerate("abc")]
    damaged = bytearray(b"".join(records))
    damaged[len(records[0]) + 2] ^= 0xFF
    (tmp_path / "data" / TXN_DIR).mkdir(parents=True)
    (tmp_path / "data" / TXN_DIR / LOG_FILE).write_bytes(bytes(damaged))
    ran = subprocess.run([sys.executable, "-m", "twophase.broker.cli", "--data-dir", str(tmp_path / "data"),
                          "--port", "0"], capture_output=True, text=True, timeout=60)
    assert ran.returncode == 2, ran.stderr
    assert "refusing to truncate" in ran.stderr and "Traceback" not in ran.stderr


def test_replay_truncates_a_torn_tail_padded_with_zeros(tmp_path):
    """A crash mid-append can leave the file extended with zeros after the last whole record."""
    whole = encode_record("a", {"v": 1})
    (tmp_path / LOG_FILE).write_bytes(whole + encode_record("b", {"v": 2})[:7] + b"\0" * 4096)
    txn_log = TransactionLog(str(tmp_path))
    assert txn_log.open() == {"a": {"v": 1}}
    txn_log.close()
    assert os.path.getsize(tmp_path / LOG_FILE) == len(whole)


# -- ListTransactions patterns -----------------------------------------------------------------


def list_request(pattern: str):
    return req(66, 2, state_filters=(), producer_id_filters=(), duration_filter=-1, transactional_id_pattern=pattern)


def test_pattern_errors_are_answered(broker, wire):
    w = wire()
    init_pid(w, "app-1")
    init_pid(w, "other")
    assert [s.transactional_id for s in w.request(list_request("app-[0-9]+")).transaction_states] == ["app-1"]
    for bad in ("(", "(?=a)", r"(a)\1", "x{1001}", "a" * 1_001):  # RE2 has no lookaround or backreferences
        r = w.request(list_request(bad))
        assert (r.error_code, r.transaction_states) == (ErrorCode.invalid_regular_expression, ())


def test_a_backtracking_pattern_cannot_stall_the_broker(tmp_path):
    """A subprocess broker: an in-process one would share this interpreter's GIL with the test."""
    b = BrokerProcess(str(tmp_path / "data"), free_port(), str(tmp_path))
    b.start()
    try:
        setup = WireClient(b.port)
        assert init_pid(setup, "a" * 40).error_code == ErrorCode.none  # 2**40 steps for a backtracking engine
        lister, other = WireClient(b.port, timeout=10), WireClient(b.port, timeout=10)
        listing = lister.send(list_request("(a+)+b"))
        assert init_pid(other, "unrelated").error_code == ErrorCode.none  # answered within the socket timeout
        answer = lister.recv(type(list_request("")), listing)
        assert (answer.error_code, answer.transaction_states) == (ErrorCode.none, ())
    finally:
        b.stop()
        b.kill()
