"""Under an fsync interval a commit fsyncs no partition: its markers wait for the periodic flush, as the
data does, and the transaction log keeps them until then so that recovery can write again the ones a
crash of the machine lost.

A real TransactionCoordinator over real PartitionLogs (flush every 60 s, so nothing is flushed behind
the test's back). A machine crash is simulated by cutting each partition's files back to a batch
boundary (recovery keeps a prefix of the log, see storage/log.py) and, where the case says so, the
transaction log back to its last fsynced record; then everything is opened again, as at a restart.
"""

from __future__ import annotations

import logging
import os

import pytest

from twophase.broker.groups import OffsetStore
from twophase.broker.storage import LogConfig, PartitionLog
from twophase.broker.storage import segment as segment_module
from twophase.broker.storage import txnindex as txnindex_module
from twophase.broker.txn import (
    TXN_DIR,
    TransactionCoordinator,
    TransactionLog,
    TxnSettings,
    TxnState,
)
from twophase.broker.txn import coordinator as coordinator_module
from twophase.broker.txn import log as txn_log_module
from twophase.broker.txn.coordinator import NONE
from twophase.broker.txn.log import LOG_FILE
from twophase.wire.errors import UnknownTopicOrPartitionError

from .batches import batch
from .test_txn_storage import committed_view

T0 = 1_700_000_000_000
INTERVAL = LogConfig(flush=60_000)
PARTITIONS = [("t", 0), ("t", 1)]


class Node:
    """Partition logs and a coordinator on ``tmp_path``; ``crash`` drops them without closing, ``start``
    opens them again (recovery included)."""

    def __init__(self, tmp_path, settings: TxnSettings | None = None):
        self.tmp_path = tmp_path
        self.settings = settings
        self.sequences: dict[tuple[str, int], int] = {}
        self.start()

    def start(self) -> None:
        self.logs = {(t, p): PartitionLog(str(self.tmp_path / f"{t}-{p}"), INTERVAL) for t, p in PARTITIONS}
        self.txns = TransactionCoordinator(str(self.tmp_path / TXN_DIR), partition_log=self.partition,
                                           offsets=OffsetStore(str(self.tmp_path / "groups")),
                                           allocate_producer_id=lambda: 7, data_arrived=lambda t, p: None,
                                           settings=self.settings)
        self.txns.recover(T0)

    def partition(self, topic, partition):
        try:
            return self.logs[(topic, partition)]
        except KeyError:
            raise UnknownTopicOrPartitionError(f"{topic}-{partition}") from None

    def init(self):
        r = self.txns.init_producer_id("app", 60_000, now_ms=T0)
        assert r.error == NONE
        return r.producer_id, r.producer_epoch

    def transaction(self, pid, epoch, values: dict[tuple[str, int], bytes], commit: bool | None) -> dict:
        """Add the partitions, write one value to each, and end the transaction (None: leave it open);
        the offset each marker got."""
        assert self.txns.add_partitions("app", pid, epoch, list(values), T0) == NONE
        for key, value in values.items():
            sequence = self.sequences.get(key, 0)
            self.logs[key].append(batch([value], producer_id=pid, producer_epoch=epoch, base_sequence=sequence,
                                      transactional=True), T0)
            self.sequences[key] = sequence + 1
        markers = {key: self.logs[key].log_end_offset for key in values}
        if commit is not None:
            assert self.txns.end_txn("app", pid, epoch, commit, T0) == NONE
        return markers

    def crash(self, cut: dict[tuple[str, int], int], lose_last_txn_record: bool = False) -> None:
        """A machine crash: each partition in ``cut`` keeps only the offsets below the given one; the
        transaction log its fsynced records (the last one lost too, if asked)."""
        txn_log = str(self.tmp_path / TXN_DIR / LOG_FILE)
        for key, offset in cut.items():
            segment = self.logs[key].segments[-1]
            os.truncate(segment.path, segment.find_position(offset))
        self.txns._log._file.close()  # the process is gone: nothing more reaches the file
        if lose_last_txn_record:
            os.truncate(txn_log, os.path.getsize(txn_log) - len(_last_record(txn_log)))
        for plog in self.logs.values():  # no close(): neither an fsync nor a producer snapshot
            for segment in plog.segments:
                segment.close(sync=False)
        self.start()

    def stop(self) -> None:
        self.txns.close()
        for plog in self.logs.values():
            plog.close()


def _last_record(path: str) -> bytes:
    """The last record of the transaction log file."""
    with open(path, "rb") as f:
        data = f.read()
    pos, last = 0, b""
    while pos < len(data):
        end = pos + 8 + int.from_bytes(data[pos:pos + 4], "big")
        pos, last = end, data[pos:end]
    return last


@pytest.fixture
def node(request, tmp_path):
    n = Node(tmp_path, getattr(request, "param", None))
    yield n
    n.stop()


@pytest.fixture
def fsyncs(monkeypatch):
    """The path of every file fsynced from now on (the storage modules' fdatasync aliases included)."""
    synced: list[str] = []

    def recording(real):
        def sync(fd):
            synced.append(os.readlink(f"/proc/self/fd/{fd}"))
            real(fd)
        return sync

    monkeypatch.setattr(os, "fsync", recording(os.fsync))
    monkeypatch.setattr(segment_module, "_fdatasync", recording(segment_module._fdatasync))
    monkeypatch.setattr(txnindex_module, "_fdatasync", recording(txnindex_module._fdatasync))
    monkeypatch.setattr(txn_log_module, "_fsync", recording(txn_log_module._fsync))
    return synced


def logged_unsynced(node) -> list:
    """The unsynced markers the transaction log holds for "app" (read by a second reader of the file)."""
    return TransactionLog(str(node.tmp_path / TXN_DIR)).open()["app"].get("unsynced", [])


def test_a_commit_fsyncs_the_decision_only(node, fsyncs):
    pid, epoch = node.init()
    assert node.txns.add_partitions("app", pid, epoch, PARTITIONS, T0) == NONE
    for key in PARTITIONS:
        node.logs[key].append(batch([b"v"], producer_id=pid, producer_epoch=epoch, base_sequence=0,
                                    transactional=True), T0)
    fsyncs.clear()
    assert node.txns.end_txn("app", pid, epoch, True, T0) == NONE
    # PrepareCommit, and nothing else: no partition, CompleteCommit only written.
    assert fsyncs == [os.path.realpath(node.tmp_path / TXN_DIR / LOG_FILE)]
    assert node.txns.describe("app").state == TxnState.COMPLETE_COMMIT.value
    assert all(committed_view(node.logs[key]) == [b"v"] for key in PARTITIONS)
    assert [m[:2] for m in logged_unsynced(node)] == [["t", 0], ["t", 1]]


def test_the_periodic_flush_settles_the_markers_and_the_next_record_forgets_them(node):
    pid, epoch = node.init()
    node.transaction(pid, epoch, {("t", 0): b"a", ("t", 1): b"b"}, commit=True)
    node.logs[("t", 0)].flush_due(T0)()  # the flusher, for t-0 only
    assert node.txns.add_partitions("app", pid, epoch, [("t", 0)], T0) == NONE
    assert [m[:2] for m in logged_unsynced(node)] == [["t", 1]]


def test_consecutive_markers_with_the_same_outcome_are_one_entry(node):
    pid, epoch = node.init()
    for value in (b"a", b"b", b"c"):
        last = node.transaction(pid, epoch, {("t", 0): value}, commit=True)
    node.transaction(pid, epoch, {("t", 0): b"d"}, commit=False)
    assert logged_unsynced(node) == [["t", 0, pid, epoch, True, last[("t", 0)]],
                                     ["t", 0, pid, epoch, False, last[("t", 0)] + 2]]


@pytest.mark.parametrize("lose_complete", [False, True], ids=["complete-kept", "complete-lost"])
def test_recovery_writes_again_the_markers_a_crash_lost(node, caplog, lose_complete):
    pid, epoch = node.init()
    markers = node.transaction(pid, epoch, {("t", 0): b"a", ("t", 1): b"b"}, commit=True)
    node.crash(markers, lose_last_txn_record=lose_complete)
    assert node.txns.describe("app").state == TxnState.COMPLETE_COMMIT.value
    assert committed_view(node.logs[("t", 0)]) == [b"a"] and committed_view(node.logs[("t", 1)]) == [b"b"]
    assert all(not node.logs[key].producers.open_transactions() for key in PARTITIONS)


def test_a_lost_marker_keeps_its_outcome_when_the_id_moved_on(node, caplog):
    pid, epoch = node.init()
    markers = node.transaction(pid, epoch, {("t", 0): b"committed"}, commit=True)
    node.transaction(pid, epoch, {("t", 1): b"open"}, commit=None)  # the next one, on another partition
    caplog.set_level(logging.WARNING, "twophase.broker.txn")
    node.crash(markers)
    assert "the COMMIT marker of producer" in caplog.text and "lost in a crash" in caplog.text
    assert committed_view(node.logs[("t", 0)]) == [b"committed"]
    assert node.txns.describe("app").state == TxnState.ONGOING.value
    assert node.txns.end_txn("app", pid, epoch, False, T0) == NONE
    assert committed_view(node.logs[("t", 1)]) == []


@pytest.mark.parametrize("survivors", [0, 1], ids=["both-lost", "commit-kept"])
def test_a_commit_then_an_abort_on_one_partition_each_keep_their_outcome(node, survivors):
    pid, epoch = node.init()
    first = node.transaction(pid, epoch, {("t", 0): b"committed"}, commit=True)[("t", 0)]
    second = node.transaction(pid, epoch, {("t", 0): b"aborted"}, commit=False)[("t", 0)]
    node.crash({("t", 0): first if survivors == 0 else second})
    assert committed_view(node.logs[("t", 0)]) == [b"committed"]
    assert not node.logs[("t", 0)].producers.open_transactions()


def test_an_id_with_too_many_unsynced_markers_has_their_partitions_fsynced(node, monkeypatch, fsyncs):
    monkeypatch.setattr(coordinator_module, "MAX_UNSYNCED", 1)
    pid, epoch = node.init()
    node.transaction(pid, epoch, {("t", 0): b"a"}, commit=True)
    assert len(logged_unsynced(node)) == 1 and not any("/t-0/" in f for f in fsyncs)
    node.transaction(pid, epoch, {("t", 0): b"b"}, commit=False)  # a second entry: one too many
    assert any("/t-0/" in f for f in fsyncs)
    assert logged_unsynced(node) == []


@pytest.mark.parametrize("node", [TxnSettings(id_expiration_ms=1)], indirect=True)
def test_an_id_expires_only_once_its_markers_are_fsynced(node):
    pid, epoch = node.init()
    node.transaction(pid, epoch, {("t", 0): b"a"}, commit=True)
    node.txns.check(T0 + 10)
    assert node.txns.describe("app") is not None  # its tombstone would forget the unsynced marker
    node.logs[("t", 0)].flush_due(T0)()
    node.txns.check(T0 + 10)
    assert node.txns.describe("app") is None


def test_a_recreated_partition_drops_the_entries_of_the_old_one(node, tmp_path):
    pid, epoch = node.init()
    node.transaction(pid, epoch, {("t", 0): b"a", ("t", 1): b"b"}, commit=True)
    old = node.logs[("t", 0)]
    node.logs[("t", 0)] = PartitionLog(str(tmp_path / "t-0-recreated"), INTERVAL)  # deleted, created again
    old.close()
    assert node.txns.add_partitions("app", pid, epoch, [("t", 1)], T0) == NONE
    assert [m[:2] for m in logged_unsynced(node)] == [["t", 1]]
