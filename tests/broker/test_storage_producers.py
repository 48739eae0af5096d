"""Idempotent producer state: dedup, sequence and epoch checks, transactions hook, persistence."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from twophase.broker.storage import LogConfig, PartitionLog
from twophase.wire.errors import (
    InvalidProducerEpochError,
    InvalidTxnStateError,
    OutOfOrderSequenceError,
    TransactionCoordinatorFencedError,
)
from twophase.wire.records import control_batch

from .batches import batch, decode

PID = 1000


def pbatch(seq: int, n: int = 1, epoch: int = 0, pid: int = PID, transactional: bool = False) -> bytes:
    return batch([f"s{seq + i}".encode() for i in range(n)], producer_id=pid, producer_epoch=epoch,
                 base_sequence=seq, transactional=transactional)


@pytest.fixture
def log(tmp_path):
    partition_log = PartitionLog(str(tmp_path / "t-0"), LogConfig(segment_bytes=2048, index_interval_bytes=256))
    yield partition_log
    partition_log.close()


def test_retry_returns_original_offsets_and_is_not_stored(log):
    log.append(batch([b"other"]), 0)
    first = log.append(pbatch(0, 3), 0)
    second = log.append(pbatch(3, 2), 0)
    retry = log.append(pbatch(0, 3), 0)
    assert (first.base_offset, first.last_offset, first.duplicate) == (1, 3, False)
    assert (retry.base_offset, retry.last_offset, retry.duplicate) == (1, 3, True)
    assert log.append(pbatch(3, 2), 0) == type(second)(second.base_offset, second.last_offset, -1, True)
    assert log.high_watermark == 6
    assert len(decode(log.read(0, 1 << 20))) == 6


def test_only_last_five_batches_are_remembered(log):
    for i in range(6):
        log.append(pbatch(i), 0)
    assert log.append(pbatch(1), 0).duplicate
    with pytest.raises(OutOfOrderSequenceError):
        log.append(pbatch(0), 0)  # evicted: no longer recognisable as a retry


def test_sequence_gap_is_out_of_order(log):
    log.append(pbatch(0, 2), 0)
    with pytest.raises(OutOfOrderSequenceError) as info:
        log.append(pbatch(3), 0)
    assert info.value.code == 45
    assert log.high_watermark == 2
    log.append(pbatch(2), 0)


def test_older_epoch_is_rejected(log):
    log.append(pbatch(0, epoch=1), 0)
    with pytest.raises(InvalidProducerEpochError) as info:
        log.append(pbatch(1, epoch=0), 0)
    assert info.value.code == 47


def test_new_epoch_must_restart_at_zero(log):
    log.append(pbatch(0, 3, epoch=0), 0)
    with pytest.raises(OutOfOrderSequenceError):
        log.append(pbatch(3, epoch=1), 0)
    log.append(pbatch(0, epoch=1), 0)
    assert log.producers.entry(PID).epoch == 1


def test_unknown_producer_may_start_anywhere(log):
    # As in Kafka: its earlier state may have expired or been deleted with old segments.
    assert log.append(pbatch(42), 0).base_offset == 0
    log.append(pbatch(43), 0)


def test_sequence_wraps_at_int32_max(log):
    log.append(pbatch(2**31 - 2, 2), 0)
    assert log.producers.entry(PID).last_seq == 2**31 - 1
    log.append(pbatch(0), 0)


def test_non_idempotent_batches_skip_checks(log):
    log.append(batch([b"a"]), 0)
    log.append(batch([b"a"]), 0)
    assert log.high_watermark == 2 and log.producers.producer_ids() == []


def test_multi_batch_append_is_atomic_with_producer_checks(log):
    log.append(pbatch(0), 0)
    with pytest.raises(OutOfOrderSequenceError):
        log.append(pbatch(1) + pbatch(5), 0)  # second batch has a gap: neither is stored
    assert log.high_watermark == 1 and log.producers.entry(PID).last_seq == 0
    result = log.append(pbatch(1) + pbatch(2, 2), 0)  # sequential within one append
    assert (result.base_offset, result.last_offset) == (1, 3)
    assert log.producers.entry(PID).last_seq == 3


def test_check_single_header(log):
    from twophase.wire.records import validate_batch

    log.append(pbatch(0, 2), 0)
    dup = log.producers.check(validate_batch(pbatch(0, 2)))
    assert dup is not None and dup.duplicate and (dup.base_offset, dup.last_offset) == (0, 1)
    assert log.producers.check(validate_batch(pbatch(2))) is None
    with pytest.raises(OutOfOrderSequenceError):
        log.producers.check(validate_batch(pbatch(9)))


def test_transactions_tracked_and_closed_by_markers(log):
    other = PID + 1
    log.append(batch([b"plain"]), 0)
    log.append(pbatch(0, transactional=True), 0)
    log.append(pbatch(1, transactional=True), 0)
    log.append(pbatch(0, pid=other, transactional=True), 0)
    assert log.producers.open_transactions() == {PID: 1, other: 3}
    with pytest.raises(InvalidTxnStateError):
        log.append(pbatch(2), 0)  # non-transactional write inside an open transaction
    log.append(control_batch(PID, 0, commit=True, coordinator_epoch=3, timestamp_ms=0), 0, from_client=False)
    assert log.producers.open_transactions() == {other: 3}
    with pytest.raises(TransactionCoordinatorFencedError):  # a marker from a stale coordinator
        log.append(control_batch(PID, 0, commit=False, coordinator_epoch=2, timestamp_ms=0), 0, from_client=False)
    # Sequences continue after the marker (same epoch).
    log.append(pbatch(2, transactional=True), 0)
    assert log.producers.open_transactions() == {PID: 5, other: 3}


def test_a_coordinator_marker_is_never_refused_for_an_older_epoch(log):
    # Data claiming an epoch its producer was never given (older logs may hold such batches) must
    # not keep the coordinator's marker out: the transaction could never end.
    log.append(pbatch(0, epoch=32767, transactional=True), 0)
    assert log.producers.open_transactions() == {PID: 0}
    log.append(control_batch(PID, 1, commit=False, coordinator_epoch=0, timestamp_ms=0), 0, from_client=False)
    assert log.producers.open_transactions() == {}
    assert log.producers.entry(PID).epoch == 1  # the coordinator's epoch again: its producer may go on
    log.append(pbatch(0, epoch=1, transactional=True), 0)
    assert log.producers.open_transactions() == {PID: 2}


def test_state_survives_clean_reopen(tmp_path):
    path = str(tmp_path / "t-0")
    log = PartitionLog(path, LogConfig(segment_bytes=2048))
    for i in range(40):
        log.append(pbatch(i * 2, 2), 0)
    log.append(pbatch(0, pid=7, transactional=True), 0)
    log.close()
    assert any(n.endswith(".snapshot") for n in os.listdir(path))
    reopened = PartitionLog(path, LogConfig(segment_bytes=2048))
    retry = reopened.append(pbatch(78, 2), 0)
    assert retry.duplicate and (retry.base_offset, retry.last_offset) == (78, 79)
    with pytest.raises(OutOfOrderSequenceError):
        reopened.append(pbatch(81), 0)
    assert reopened.producers.open_transactions() == {7: 80}
    reopened.append(pbatch(80), 0)


@pytest.mark.parametrize("delete_snapshots", [False, True])
def test_state_survives_crash_without_close(tmp_path, delete_snapshots):
    path = str(tmp_path / "t-0")
    log = PartitionLog(path, LogConfig(segment_bytes=2048))
    results = [log.append(pbatch(i * 2, 2, epoch=3), 0) for i in range(40)]
    assert len(log.segments) >= 2  # snapshots were written on roll; the newest data is only in the log
    # No close(): the process dies here.
    if delete_snapshots:
        for name in os.listdir(path):
            if name.endswith(".snapshot"):
                os.unlink(os.path.join(path, name))
    reopened = PartitionLog(path, LogConfig(segment_bytes=2048))
    for i in (35, 39):
        retry = reopened.append(pbatch(i * 2, 2, epoch=3), 0)
        assert retry.duplicate and retry.base_offset == results[i].base_offset
    with pytest.raises(InvalidProducerEpochError):
        reopened.append(pbatch(80, epoch=2), 0)
    assert reopened.append(pbatch(80, epoch=3), 0).base_offset == 80


def test_corrupt_snapshot_falls_back_to_replay(tmp_path, caplog):
    path = str(tmp_path / "t-0")
    log = PartitionLog(path)
    log.append(pbatch(0, 2), 0)
    log.close()
    (snapshot,) = [n for n in os.listdir(path) if n.endswith(".snapshot")]
    with open(os.path.join(path, snapshot), "r+b") as f:
        f.seek(20)
        f.write(b"XX")
    reopened = PartitionLog(path)
    assert reopened.append(pbatch(0, 2), 0).duplicate
    assert "unreadable producer snapshot" in caplog.text


def test_snapshot_beyond_truncated_log_is_ignored(tmp_path):
    path = str(tmp_path / "t-0")
    log = PartitionLog(path)
    log.append(pbatch(0), 0)
    log.append(pbatch(1), 0)
    log.close()
    # The snapshot says offset 2, but the second batch gets lost (e.g. fsync interval + power cut).
    os.truncate(log.segments[0].path, len(pbatch(0)))
    reopened = PartitionLog(path)
    assert reopened.high_watermark == 1
    assert reopened.append(pbatch(1), 0).duplicate is False
    assert not os.path.exists(os.path.join(path, f"{2:020d}.snapshot"))


def test_expiration_forgets_idle_producers(tmp_path):
    log = PartitionLog(str(tmp_path / "t-0"), LogConfig(producer_id_expiration_ms=1000))
    log.append(pbatch(0), now_ms=0)
    log.append(pbatch(0, pid=5, transactional=True), now_ms=0)
    log.enforce_retention(now_ms=500)
    assert log.producers.producer_ids() == [5, PID]
    log.enforce_retention(now_ms=2000)
    assert log.producers.producer_ids() == [5]  # an open transaction keeps its producer


_CHILD = textwrap.dedent("""
    import sys
    from twophase.broker.storage import LogConfig, PartitionLog
    from tests.broker.batches import batch
    log = PartitionLog(sys.argv[1], LogConfig(segment_bytes=4096, flush="always"))
    seq = log.producers.entry(1).last_seq + 1 if log.producers.entry(1) else 0
    while True:
        r = log.append(batch([b"r%d" % (seq + i) for i in range(3)], producer_id=1, producer_epoch=0,
                             base_sequence=seq), 0)
        print(seq, r.base_offset, r.last_offset, flush=True)
        seq += 3
""")


def test_retry_across_kill_9_gets_no_duplicate(tmp_path):
    """A real process appends with fsync=always and is SIGKILLed; every acknowledged batch is there once."""
    path = str(tmp_path / "t-0")
    env = {**os.environ, "PYTHONPATH": os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", "")}
    acked: dict[int, tuple[int, int]] = {}
    for _ in range(3):
        child = subprocess.Popen([sys.executable, "-c", _CHILD, path], stdout=subprocess.PIPE, text=True, env=env)
        for _ in range(200):
            seq, base, last = map(int, child.stdout.readline().split())
            acked[seq] = (base, last)
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
        child.stdout.close()
    log = PartitionLog(path, LogConfig(segment_bytes=4096))
    values = [v for _, _, _, v in decode(log.read(0, 1 << 30))]
    assert len(values) == len(set(values))
    assert values == [b"r%d" % i for i in range(len(values))]  # no gap, no duplicate
    for seq, (base, last) in acked.items():
        assert (base, last) == (seq, seq + 2)
    # The producer missed the acks of the newest batches (acknowledged or not) and retries them:
    # the original offsets come back and nothing is stored twice.
    hw = log.high_watermark
    for seq in range(hw - 15, hw, 3):
        retry = log.append(batch([b"r%d" % (seq + i) for i in range(3)], producer_id=1, producer_epoch=0,
                                 base_sequence=seq), 0)
        assert retry.duplicate and (retry.base_offset, retry.last_offset) == (seq, seq + 2)
    assert log.high_watermark == hw
