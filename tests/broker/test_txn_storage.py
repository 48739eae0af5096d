"""Partition side of transactions: markers, the last stable offset, the aborted-transactions index.

A reference consumer (Kafka's client algorithm: aborted producer ids become active at their first
offset and are cleared by their ABORT marker) reads the log the way a read_committed client does and
must see exactly the committed and non-transactional records.
"""

from __future__ import annotations

import errno
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from twophase.broker.storage import LogConfig, PartitionLog
from twophase.broker.storage.txnindex import ENTRY, AbortedTxn, txn_index_path
from twophase.wire.errors import (
    InvalidProducerEpochError,
    InvalidRecordError,
    InvalidTxnStateError,
    KafkaStorageError,
    OutOfOrderSequenceError,
    TransactionCoordinatorFencedError,
)
from twophase.wire.records import iter_batches

from .batches import batch, decode
from .conftest import logs_in

SMALL = LogConfig(segment_bytes=2048, index_interval_bytes=256)


class Producers:
    """Writes sequenced (optionally transactional) batches of one record each per producer id."""

    def __init__(self, log: PartitionLog) -> None:
        self.log = log
        self.seq: dict[int, int] = {}
        self.epoch: dict[int, int] = {}

    def write(self, pid: int, value: bytes, transactional: bool = True, epoch: int | None = None) -> int:
        epoch = self.epoch.get(pid, 0) if epoch is None else epoch
        if epoch != self.epoch.get(pid, 0):
            self.epoch[pid], self.seq[pid] = epoch, 0
        seq = self.seq.get(pid, 0)
        offset = self.log.append(batch([value], producer_id=pid, producer_epoch=epoch, base_sequence=seq,
                                       transactional=transactional), 0).base_offset
        self.seq[pid] = seq + 1
        return offset

    def end(self, pid: int, commit: bool, coordinator_epoch: int = 0, bump: bool = False) -> int:
        epoch = self.epoch.get(pid, 0) + (1 if bump else 0)
        offset = self.log.append_marker(pid, epoch, commit, coordinator_epoch, now_ms=0)
        if bump:
            self.epoch[pid], self.seq[pid] = epoch, 0
        return offset


def committed_view(log: PartitionLog, max_bytes: int = 1 << 20, start: int | None = None) -> list[bytes]:
    """Values a read_committed consumer sees, fetching ``max_bytes`` at a time up to the LSO."""
    seen: list[bytes] = []
    offset = log.log_start_offset if start is None else start
    while offset < log.last_stable_offset:
        data, end = log.read_range(offset, max_bytes, log.last_stable_offset)
        assert data and end > offset
        pending = sorted(log.aborted_transactions(offset, end), key=lambda t: t[1])
        aborted: set[int] = set()
        records = {o: v for o, _, _, v in decode(data)}
        for pos, header in iter_batches(data):
            while pending and pending[0][1] <= header.last_offset:
                aborted.add(pending.pop(0)[0])
            if header.is_control:
                if header.producer_id in aborted and _is_abort(data[pos:pos + header.size]):
                    aborted.discard(header.producer_id)
            elif not (header.is_transactional and header.producer_id in aborted):
                seen.extend(records[o] for o in range(max(offset, header.base_offset), header.last_offset + 1))
        offset = end
    return seen


def _is_abort(control: bytes) -> bool:
    from twophase.wire.records import parse_control_record

    return not parse_control_record(control).commit


def test_markers_lso_and_aborted_index_with_interleaved_producers(tmp_path):
    log = PartitionLog(str(tmp_path / "t-0"))
    w = Producers(log)
    assert log.last_stable_offset == 0 and not log.has_open_transaction(1)
    w.write(9, b"plain", transactional=False)         # 0: idempotent, no transaction
    w.write(1, b"a1")                                 # 1: producer 1 opens a transaction
    w.write(2, b"b1")                                 # 2: producer 2 too
    w.write(1, b"a2")                                 # 3
    assert log.has_open_transaction(1) and log.has_open_transaction(2)
    assert (log.last_stable_offset, log.high_watermark) == (1, 4)
    assert log.read(0, 1 << 20, log.last_stable_offset) == log.read(0, 1)  # only the batch below the LSO
    assert w.end(1, commit=False) == 4                # 4: abort producer 1
    assert not log.has_open_transaction(1)
    assert log.last_stable_offset == 2                # producer 2 still open
    w.write(1, b"a3")                                 # 5: producer 1's next transaction
    assert w.end(2, commit=True) == 6                 # 6
    assert log.last_stable_offset == 5
    assert w.end(1, commit=True) == 7                 # 7
    assert log.last_stable_offset == log.high_watermark == 8
    assert log.aborted_transactions(0, 8) == [(1, 1)]
    assert log.aborted_transactions(4, 5) == [(1, 1)]  # the marker itself is in the transaction's range
    assert log.aborted_transactions(5, 8) == [] and log.aborted_transactions(0, 1) == []
    assert log.segments[-1].txn_index.entries() == [AbortedTxn(1, 1, 4, 2)]
    assert committed_view(log) == [b"plain", b"b1", b"a3"]
    assert [v for *_, v in decode(log.read(0, 1 << 20))] == [b"plain", b"a1", b"b1", b"a2", b"a3"]
    log.close()


def test_marker_without_open_transaction_is_harmless(tmp_path):
    log = PartitionLog(str(tmp_path / "t-0"))
    assert log.append_marker(5, 0, commit=False, coordinator_epoch=0, now_ms=0) == 0
    assert log.last_stable_offset == 1 and log.aborted_transactions(0, 1) == []
    assert log.segments[-1].txn_index.entries() == []
    log.close()


def test_markers_are_fsynced_even_with_an_interval_flush_policy(tmp_path, monkeypatch):
    log = PartitionLog(str(tmp_path / "t-0"), LogConfig(flush=60_000))
    flushed = []
    monkeypatch.setattr(type(log.segments[-1]), "flush", lambda segment: flushed.append(segment.base_offset))
    log.append(batch([b"v"], producer_id=5, producer_epoch=0, base_sequence=0, transactional=True), now_ms=0)
    assert flushed == []  # data waits for the interval
    log.append_marker(5, 0, commit=True, coordinator_epoch=0, now_ms=0)
    assert flushed == [0]
    monkeypatch.undo()
    log.close()


def test_marker_epoch_bump_fences_older_epochs(tmp_path):
    log = PartitionLog(str(tmp_path / "t-0"))
    w = Producers(log)
    w.write(1, b"x", epoch=3)
    w.end(1, commit=False, bump=True)                 # the coordinator fenced epoch 3 with epoch 4
    with pytest.raises(InvalidProducerEpochError):
        log.append(batch([b"zombie"], producer_id=1, producer_epoch=3, base_sequence=1, transactional=True), 0)
    # (A marker is never refused for its epoch: only the coordinator writes them, and its word wins;
    # test_storage_producers.test_a_coordinator_marker_is_never_refused_for_an_older_epoch.)
    with pytest.raises(OutOfOrderSequenceError):      # the new epoch starts at sequence 0
        log.append(batch([b"y"], producer_id=1, producer_epoch=4, base_sequence=1, transactional=True), 0)
    w.write(1, b"y")
    assert log.has_open_transaction(1)
    log.close()


def test_transaction_state_rules(tmp_path):
    log = PartitionLog(str(tmp_path / "t-0"))
    w = Producers(log)
    w.write(1, b"x")
    with pytest.raises(InvalidTxnStateError):          # non-transactional write inside an open transaction
        w.write(1, b"y", transactional=False)
    w.end(1, commit=True, coordinator_epoch=5)
    with pytest.raises(TransactionCoordinatorFencedError):
        log.append_marker(1, 0, commit=False, coordinator_epoch=4, now_ms=0)
    with pytest.raises(InvalidRecordError):             # clients never write markers
        from twophase.wire.records import control_batch
        log.append(control_batch(1, 0, True, 5, 0), 0)
    w.write(1, b"z", transactional=False)               # after the marker, idempotent writes are fine again
    assert log.last_stable_offset == log.high_watermark
    log.close()


def test_long_transaction_across_segment_rolls(tmp_path):
    log = PartitionLog(str(tmp_path / "t-0"), SMALL)
    w = Producers(log)
    first = w.write(1, b"long-0")
    expected = []
    for i in range(60):                                 # short committed transactions while 1 stays open
        w.write(2, b"c%d" % i)
        w.end(2, commit=True)
        expected.append(b"c%d" % i)
        if i % 7 == 0:
            w.write(3, b"x%d" % i)
            w.end(3, commit=False)
    assert len(log.segments) > 3
    assert log.last_stable_offset == first
    assert committed_view(log) == []                    # everything waits behind the open transaction
    w.write(1, b"long-1")
    marker = w.end(1, commit=False)
    assert log.last_stable_offset == log.high_watermark
    # The long transaction's entry sits in the marker's segment, yet a fetch from offset 0 finds it.
    assert (1, first) in log.aborted_transactions(first, first + 1)
    assert log.segments[-1].txn_index.entries()[-1] == AbortedTxn(1, first, marker, marker + 1)
    assert committed_view(log) == expected
    assert committed_view(log, max_bytes=150) == expected
    log.close()
    reopened = PartitionLog(str(tmp_path / "t-0"), SMALL)
    assert committed_view(reopened, max_bytes=300) == expected
    reopened.close()


def _build_mixed_log(path: str, seed: int, config: LogConfig = SMALL) -> tuple[PartitionLog, list[bytes]]:
    """Random interleaving of 4 transactional producers and one idempotent one; returns the committed values."""
    rng = random.Random(seed)
    log = PartitionLog(path, config)
    w = Producers(log)
    pending: dict[int, list[bytes]] = {}
    committed: list[bytes] = []
    order: list[tuple[int, bytes]] = []  # offset order of data, to list committed values by offset
    outcome: dict[bytes, bool] = {}
    for i in range(300):
        pid = rng.choice([1, 2, 3, 4, 9])
        if pid == 9:
            value = b"plain-%d" % i
            offset = w.write(9, value, transactional=False)
            order.append((offset, value))
            outcome[value] = True
        elif pid in pending and rng.random() < 0.3:
            commit = rng.random() < 0.5
            w.end(pid, commit)
            for value in pending.pop(pid):
                outcome[value] = commit
        else:
            value = b"p%d-%d" % (pid, i)
            offset = w.write(pid, value)
            pending.setdefault(pid, []).append(value)
            order.append((offset, value))
    for pid in list(pending):
        w.end(pid, commit=False)
        for value in pending.pop(pid):
            outcome[value] = False
    committed = [v for _, v in sorted(order) if outcome[v]]
    return log, committed


@pytest.mark.parametrize("seed", range(4))
def test_random_interleaving_reads_exactly_the_committed_records(tmp_path, seed):
    path = str(tmp_path / "t-0")
    log, committed = _build_mixed_log(path, seed)
    assert len(log.segments) > 3
    for max_bytes in (1, 200, 1 << 20):
        assert committed_view(log, max_bytes) == committed
    log.close()
    reopened = PartitionLog(path, SMALL)
    assert committed_view(reopened, 333) == committed


def _brute_force_aborted(log: PartitionLog) -> list[AbortedTxn]:
    return [t for s in log.segments for t in s.txn_index.entries()]


@pytest.mark.parametrize("damage", ["crash", "missing", "garbage", "torn", "no_snapshot"])
def test_index_recovered_after_crash_or_damage(tmp_path, damage, caplog):
    path = str(tmp_path / "t-0")
    log, committed = _build_mixed_log(path, seed=7)
    entries = _brute_force_aborted(log)
    lso = log.last_stable_offset
    assert len(entries) > 5
    # No close(): a kill -9. Then damage one index file.
    victim = log.segments[1] if damage in ("missing", "garbage") else log.segments[-1]
    index_file = txn_index_path(path, victim.base_offset)
    if damage == "missing":
        os.unlink(index_file)
    elif damage == "garbage":
        with open(index_file, "r+b") as f:
            f.write(ENTRY.pack(0, 1, 50, -5, 0) + b"\xff" * 3)
    elif damage == "torn":
        assert victim.txn_index.entries(), "the seed must abort something in the active segment"
        os.truncate(index_file, os.path.getsize(index_file) - 5)
    elif damage == "no_snapshot":
        for name in os.listdir(path):
            if name.endswith(".snapshot"):
                os.unlink(os.path.join(path, name))
    reopened = PartitionLog(path, SMALL)
    assert _brute_force_aborted(reopened) == entries
    assert reopened.last_stable_offset == lso
    assert committed_view(reopened, 250) == committed
    if damage in ("missing", "garbage"):
        assert "replaying the whole log" in caplog.text
    reopened.close()
    # And what recovery wrote is durable: a clean reopen finds the same.
    again = PartitionLog(path, SMALL)
    assert _brute_force_aborted(again) == entries
    again.close()


def test_open_transaction_and_coordinator_epoch_survive_restart(tmp_path):
    path = str(tmp_path / "t-0")
    log = PartitionLog(path, SMALL)
    w = Producers(log)
    w.write(1, b"done")
    w.end(1, commit=True, coordinator_epoch=7)
    first = w.write(1, b"open")
    for i in range(40):
        w.write(2, b"n%d" % i, transactional=False)
    assert len(log.segments) > 1
    for crash in (True, False):
        if not crash:
            log.close()
        log = PartitionLog(path, SMALL)  # the first reopen follows a "crash": no close()
        assert log.has_open_transaction(1) and log.last_stable_offset == first
        with pytest.raises(TransactionCoordinatorFencedError):
            log.append_marker(1, 0, commit=True, coordinator_epoch=6, now_ms=0)
    w.log = log
    w.end(1, commit=False, coordinator_epoch=7)
    assert log.aborted_transactions(0, log.high_watermark) == [(1, first)]
    log.close()


def test_retention_deletes_index_with_its_segment(tmp_path):
    path = str(tmp_path / "t-0")
    log = PartitionLog(path, LogConfig(segment_bytes=2048, index_interval_bytes=256, retention_bytes=4096))
    w = Producers(log)
    for i in range(80):
        w.write(1, b"v%d" % i)
        w.end(1, commit=False)
    before = log.segments
    assert len(before) > 3
    deleted = log.enforce_retention(now_ms=0)
    assert deleted > 0
    gone = before[:deleted]
    assert all(not os.path.exists(txn_index_path(path, s.base_offset)) for s in gone)
    start = log.log_start_offset
    assert log.aborted_transactions(0, start) == []
    assert all(first >= start for _, first in log.aborted_transactions(start, log.high_watermark))
    assert len(log.aborted_transactions(start, log.high_watermark)) == sum(len(s.txn_index) for s in log.segments)
    log.close()
    assert sorted(n for n in os.listdir(path) if n.endswith(".txnindex")) == sorted(
        os.path.basename(txn_index_path(path, s.base_offset)) for s in log.segments)


def test_lso_not_below_log_start(tmp_path):
    log = PartitionLog(str(tmp_path / "t-0"), LogConfig(segment_bytes=2048, retention_ms=1000))
    w = Producers(log)
    w.write(1, b"old")
    log.roll()
    log.enforce_retention(now_ms=10_000_000)  # the open transaction's first batch is gone
    assert log.has_open_transaction(1)
    assert log.last_stable_offset == log.log_start_offset == log.high_watermark


def test_offset_of_max_timestamp(tmp_path):
    log = PartitionLog(str(tmp_path / "t-0"), SMALL)
    assert log.offset_of_max_timestamp() is None
    for i in range(30):
        log.append(batch([b"a" * 50, b"b"], timestamps=[5000 + i, 9000 if i == 11 else 100]), 0)
    found = log.offset_of_max_timestamp()
    assert (found.offset, found.timestamp) == (23, 9000)
    log.close()


def test_read_range_reports_the_end_of_the_returned_batches(tmp_path):
    log = PartitionLog(str(tmp_path / "t-0"), SMALL)
    for i in range(40):
        log.append(batch([b"x" * 30, b"y"]), 0)
    assert len(log.segments) > 1
    for offset in (0, 3, 17, 60):
        for max_bytes in (1, 100, 3000, 1 << 20):
            data, end = log.read_range(offset, max_bytes)
            assert end == max(o for o, *_ in decode(data)) + 1
            data, end = log.read_range(offset, max_bytes, upper_offset=offset - offset % 2)
            assert (data, end) == (b"", offset)
    assert log.read_range(80, 100) == (b"", 80)
    log.close()


# -- property test ---------------------------------------------------------------------------------

op = st.one_of(
    st.tuples(st.just("write"), st.integers(1, 3)),
    st.tuples(st.just("end"), st.integers(1, 3), st.booleans()),
    st.tuples(st.just("plain"), st.just(9)),
    st.tuples(st.just("roll"), st.just(0)),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(op, min_size=1, max_size=60), st.lists(st.tuples(st.integers(0, 80), st.integers(0, 80)), max_size=8),
       st.integers(1, 400))
def test_lso_and_aborted_ranges_match_a_model(ops, ranges, max_bytes):
    with tempfile.TemporaryDirectory() as tmp, logs_in(tmp) as open_log:
        log = open_log(SMALL)
        w = Producers(log)
        open_first: dict[int, int] = {}
        pending: dict[int, list[tuple[int, bytes]]] = {}
        aborted: list[tuple[int, int, int]] = []  # (pid, first, marker)
        data: list[tuple[int, bytes, bool]] = []  # (offset, value, visible once complete)
        for i, (kind, pid, *commit) in enumerate(ops):
            if kind == "roll":
                log.roll()
            elif kind == "plain":
                data.append((w.write(pid, b"n%d" % i, transactional=False), b"n%d" % i, True))
            elif kind == "write":
                offset = w.write(pid, b"t%d" % i)
                open_first.setdefault(pid, offset)
                pending.setdefault(pid, []).append((offset, b"t%d" % i))
            else:
                marker = w.end(pid, commit[0])
                if pid in open_first and not commit[0]:
                    aborted.append((pid, open_first[pid], marker))
                for offset, value in pending.pop(pid, []):
                    data.append((offset, value, commit[0]))
                open_first.pop(pid, None)
        lso = min(open_first.values(), default=log.high_watermark)
        expected = [v for o, v, ok in sorted(data) if ok and o < lso]

        def check(partition_log: PartitionLog) -> None:
            assert partition_log.last_stable_offset == lso
            for start, end in ranges:
                # [first, marker] overlaps [start, end); an empty range overlaps nothing.
                assert sorted(partition_log.aborted_transactions(start, end)) == sorted(
                    (p, f) for p, f, m in aborted if start < end and m >= start and f < end)
            assert committed_view(partition_log, max_bytes) == expected

        check(log)
        check(open_log(SMALL))  # after a crash (no close)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.integers(1, 6), min_size=1, max_size=40),
       st.one_of(st.just(0), st.integers(1, 300), st.just(1 << 20)), st.data())
def test_read_range_matches_a_flat_model(batch_sizes, index_interval, data):
    """Whole batches from the one holding the offset, below the upper offset, within max_bytes (one at least)."""
    with tempfile.TemporaryDirectory() as tmp, logs_in(tmp) as open_log:
        log = open_log(LogConfig(segment_bytes=2048, index_interval_bytes=index_interval))
        batches = []  # (base, last, size)
        for i, n in enumerate(batch_sizes):
            raw = batch([b"r%d-%d" % (i, j) * (1 + j) for j in range(n)])
            result = log.append(raw, 0)
            batches.append((result.base_offset, result.last_offset, len(raw)))
        for _ in range(10):
            offset = data.draw(st.integers(0, log.high_watermark))
            upper = data.draw(st.one_of(st.none(), st.integers(0, log.high_watermark + 2)))
            # Budgets ending exactly at, just before and just after batch boundaries, and random ones.
            ends = [sum(size for _, last, size in batches[:k] if last >= offset) for k in range(1, len(batches) + 1)]
            max_bytes = max(1, data.draw(st.one_of(st.integers(1, 1500),
                                                   st.sampled_from(ends).map(lambda e: e + data.draw(
                                                       st.integers(-1, 1))))))
            expected, total = [], 0
            for base, last, size in batches:
                if last < offset or (upper is not None and base >= upper):
                    continue
                if expected and total + size > max_bytes:
                    break
                expected.append((base, last))
                total += size
            got, end = log.read_range(offset, max_bytes, upper)
            assert [(b, e) for b, e in _batch_ranges(got)] == expected
            assert end == (expected[-1][1] + 1 if expected else offset)


def _batch_ranges(data: bytes) -> list[tuple[int, int]]:
    return [(h.base_offset, h.last_offset) for _, h in iter_batches(data)]


_CHILD = textwrap.dedent("""
    import sys
    from twophase.broker.storage import LogConfig, PartitionLog
    from tests.broker.batches import batch
    log = PartitionLog(sys.argv[1], LogConfig(segment_bytes=4096, flush="always"))
    seq = {pid: (log.producers.entry(pid).last_seq + 1 if log.producers.entry(pid) else 0) for pid in (1, 2, 3)}
    i = 0
    while True:
        pid = 1 + i % 3
        if log.has_open_transaction(pid) and i % 2:
            commit = i % 4 == 1
            offset = log.append_marker(pid, 0, commit=commit, coordinator_epoch=0, now_ms=0)
            print("commit" if commit else "abort", pid, offset, flush=True)
        else:
            log.append(batch([b"v%d" % i], producer_id=pid, producer_epoch=0, base_sequence=seq[pid],
                             transactional=True), 0)
            seq[pid] += 1
        i += 1
""")


def test_index_after_sigkill_equals_a_full_rebuild(tmp_path):
    """A real process writing transactions is SIGKILLed twice; the recovered index equals one rebuilt from
    the log alone (no index files, no snapshots), and every acknowledged abort is in it."""
    path = str(tmp_path / "t-0")
    env = {**os.environ, "PYTHONPATH": os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", "")}
    markers = []
    for _ in range(2):
        child = subprocess.Popen([sys.executable, "-c", _CHILD, path], stdout=subprocess.PIPE, text=True, env=env)
        for _ in range(150):
            kind, pid, offset = child.stdout.readline().split()
            markers.append((kind, int(pid), int(offset)))
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
        child.stdout.close()
    recovered = PartitionLog(path, LogConfig(segment_bytes=4096))
    assert len(recovered.segments) > 2
    reference_dir = str(tmp_path / "reference")
    shutil.copytree(path, reference_dir)
    for name in os.listdir(reference_dir):
        if name.endswith((".txnindex", ".snapshot")):
            os.unlink(os.path.join(reference_dir, name))
    reference = PartitionLog(reference_dir, LogConfig(segment_bytes=4096))
    entries = _brute_force_aborted(recovered)
    assert entries == _brute_force_aborted(reference)
    assert recovered.last_stable_offset == reference.last_stable_offset
    aborts = {(pid, offset) for kind, pid, offset in markers if kind == "abort"}
    assert len(aborts) > 50 and aborts <= {(t.producer_id, t.last_offset) for t in entries}
    assert committed_view(recovered, 500) == committed_view(reference, 500)
    recovered.close()
    reference.close()


def test_index_entries_beyond_a_truncated_log_are_dropped(tmp_path, caplog):
    """The marker was lost with the log's torn tail but its index entry survived: the entry goes, and the
    rest of the index is trusted (no whole-log replay)."""
    path = str(tmp_path / "t-0")
    log = PartitionLog(path, SMALL)
    w = Producers(log)
    w.write(1, b"a")
    w.end(1, commit=False)
    log.close()  # the snapshot now sits in the middle of the active segment
    log = PartitionLog(path, SMALL)
    w.log = log
    w.write(1, b"b")
    size_before_marker = log.segments[-1].size
    marker = w.end(1, commit=False)
    assert [t.last_offset for t in _brute_force_aborted(log)] == [1, marker]
    os.truncate(log.segments[-1].path, size_before_marker)  # the marker's batch is lost, its entry is not
    reopened = PartitionLog(path, SMALL)
    assert [t.last_offset for t in _brute_force_aborted(reopened)] == [1]
    assert reopened.has_open_transaction(1) and reopened.last_stable_offset == marker - 1
    assert "beyond the log end" in caplog.text and "replaying the whole log" not in caplog.text
    reopened.close()


def test_no_space_for_an_abort_index_entry_refuses_the_marker_and_keeps_the_log_online(tmp_path, monkeypatch, caplog):
    """Review finding 7: the index entry is written before the ABORT marker, so no space for it refuses the
    marker (KAFKA_STORAGE_ERROR, disk full) with nothing written; before, the log went offline with the
    marker written and its entry missing."""
    log = PartitionLog(str(tmp_path / "t-0"))
    log.append(batch([b"x"], producer_id=2, producer_epoch=0, base_sequence=0, transactional=True), 0)
    log.append_marker(2, 0, commit=False, coordinator_epoch=0, now_ms=0)
    before = log.segments[-1].txn_index.entries()
    log.append(batch([b"a"], producer_id=1, producer_epoch=0, base_sequence=0, transactional=True), 0)
    full = True
    real_pwrite = os.pwrite

    def pwrite(fd: int, data: bytes, offset: int) -> int:
        if full:
            real_pwrite(fd, data[:10], offset)  # part of it, as a full disk may take
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", pwrite)
    with pytest.raises(KafkaStorageError, match="disk full"):
        log.append_marker(1, 0, commit=False, coordinator_epoch=0, now_ms=0)
    assert not log.offline and log.log_end_offset == 3 and log.has_open_transaction(1)
    assert log.segments[-1].txn_index.entries() == before  # the earlier entry kept, the new one undone
    full = False
    assert log.append_marker(1, 0, commit=False, coordinator_epoch=0, now_ms=0) == 3
    assert log.aborted_transactions(0, 4) == [(2, 0), (1, 2)]
    log.close()
    monkeypatch.undo()
    caplog.set_level(logging.WARNING)
    reopened = PartitionLog(log.directory)
    assert "rebuilt" not in caplog.text  # the file matches its seal
    assert reopened.aborted_transactions(0, 4) == [(2, 0), (1, 2)]
    reopened.close()
