"""Segment files opened only while used: a LogManager holds at most OpenFiles.capacity of them."""

from __future__ import annotations

import contextlib
import os
import resource
import threading

import pytest

from twophase.broker.storage import LogConfig, LogManager, PartitionLog
from twophase.broker.storage.open_files import OpenFiles
from twophase.wire.errors import KafkaStorageError

from .batches import batch, decode

CAPACITY = 8
PARTITIONS = 40


def segment_files_open(data_dir: str) -> int:
    """How many descriptors of this process point at a segment log file under ``data_dir``."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the listing's own descriptor, gone already
            continue
        count += target.startswith(data_dir) and target.endswith(".log")
    return count


@contextlib.contextmanager
def no_descriptor_to_spare():
    """RLIMIT_NOFILE lowered to the lowest free descriptor number: no open() succeeds; restored after."""
    lowest_free = os.dup(0)
    os.close(lowest_free)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (lowest_free, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.parametrize("flush", ["always", 1000])
def test_more_partitions_than_open_files_are_written_and_read(tmp_path, monkeypatch, flush):
    monkeypatch.setattr(OpenFiles, "default_capacity", staticmethod(lambda: CAPACITY))
    data_dir = str(tmp_path / "data")
    manager = LogManager(data_dir, LogConfig(flush=flush))
    manager.create_topic("t", PARTITIONS)
    for p in range(PARTITIONS):
        manager.partition("t", p).append(batch([f"v{p}".encode()]), 0)
        # Under an fsync interval the least recently used are fsynced early to be closed: never more open.
        assert segment_files_open(data_dir) <= CAPACITY
    for p in range(PARTITIONS):
        assert [v for *_, v in decode(manager.partition("t", p).read(0, 1 << 20))] == [f"v{p}".encode()]
        assert segment_files_open(data_dir) <= CAPACITY
    manager.close()
    assert segment_files_open(data_dir) == 0

    reopened = LogManager(data_dir, LogConfig(flush=flush))
    assert segment_files_open(data_dir) <= CAPACITY
    for p in range(PARTITIONS):
        assert [v for *_, v in decode(reopened.partition("t", p).read(0, 1 << 20))] == [f"v{p}".encode()]
    reopened.close()


def test_files_opened_in_another_thread_are_not_counted_or_closed_there(tmp_path):
    files = OpenFiles(1)
    opened_elsewhere = []

    class File:
        def __init__(self) -> None:
            self.released = False

        def idle(self) -> bool:
            return True

        def release_file(self, *, sync: bool = False) -> None:
            self.released = True
            files.closed(self)

    first, second = File(), File()
    files.used(first)
    thread = threading.Thread(target=lambda: (files.used(second), opened_elsewhere.append(files.open_count)))
    thread.start()
    thread.join()
    assert opened_elsewhere == [1] and not first.released  # a worker neither counts nor closes
    files.used(second)
    assert first.released and files.open_count == 1


def test_no_descriptor_to_reopen_a_file_is_a_storage_error_that_does_not_take_the_log_offline(tmp_path, monkeypatch):
    monkeypatch.setattr(OpenFiles, "default_capacity", staticmethod(lambda: CAPACITY))
    manager = LogManager(str(tmp_path / "data"))
    manager.create_topic("t", PARTITIONS)
    for p in range(PARTITIONS):
        manager.partition("t", p).append(batch([b"first"]), 0)
    closed_while_idle = manager.partition("t", 0)  # the least recently used: its file was closed
    with no_descriptor_to_spare():
        with pytest.raises(KafkaStorageError, match="no descriptor"):
            closed_while_idle.append(batch([b"refused"]), 0)
        with pytest.raises(KafkaStorageError, match="no descriptor"):
            closed_while_idle.read(0, 1 << 20)
    closed_while_idle.append(batch([b"second"]), 0)  # still online once descriptors are back
    assert [v for *_, v in decode(closed_while_idle.read(0, 1 << 20))] == [b"first", b"second"]
    manager.close()


def test_segments_rolled_under_an_fsync_interval_close_once_their_seal_ran(tmp_path):
    """Regression: a rolled segment's transaction index stayed "dirty" after its detached seal fsynced it,
    so no rolled segment ever became idle, the cap did not hold, and the forced fsync that followed hit a
    closed index descriptor (ValueError out of an unrelated append)."""
    data_dir = str(tmp_path)
    files = OpenFiles(3)
    config = LogConfig(flush=1000, segment_bytes=1024)
    logs = [PartitionLog(os.path.join(data_dir, f"p{i}"), config, open_files=files) for i in range(2)]
    try:
        for round_ in range(12):
            for plog in logs:
                plog.append(batch([b"x" * 700]), 0)  # every append after the first rolls a segment
                sync = plog.flush_due(round_ * 1000)  # the periodic flusher: seals of rolled segments
                if sync is not None:
                    sync()
                assert segment_files_open(data_dir) <= files.capacity
                # The seal fsynced the rolled segments: nothing is unsynced, so they close without an fsync.
                assert not any(s.txn_index.dirty for s in plog.segments[:-1])
        assert all(len(plog.segments) == 12 for plog in logs)
        assert all(len(decode(plog.read(0, 1 << 20))) == 12 for plog in logs)
    finally:
        for plog in logs:
            plog.close()


@pytest.mark.parametrize("flush", ["always", 1000])
def test_a_segment_with_an_aborted_transaction_is_idle_once_fsynced(tmp_path, flush):
    """The ABORT marker's fsync covers the transaction index entry it adds: the least recently used file
    can then be closed without an fsync on the event loop (before, a segment with an abort never was idle)."""
    files = OpenFiles(1)
    plog = PartitionLog(str(tmp_path / "p0"), LogConfig(flush=flush), open_files=files)
    other = PartitionLog(str(tmp_path / "p1"), LogConfig(flush=flush), open_files=files)
    try:
        plog.append(batch([b"a"], producer_id=1, producer_epoch=0, base_sequence=0, transactional=True), 0)
        plog.append_marker(1, 0, commit=False, coordinator_epoch=0, now_ms=0)
        active = plog.segments[-1]
        assert active.txn_index.entries() and active.idle()
        other.read(0, 1 << 20)  # another file used: this idle one is closed to keep the cap
        assert segment_files_open(str(tmp_path)) == 1
        assert plog.aborted_transactions(0, 2) == [(1, 0)]
    finally:
        plog.close()
        other.close()

