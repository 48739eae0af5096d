"""A partition log: a directory of segments with offset assignment, rolling, retention, flushing and recovery.

Example::

    log = PartitionLog("/data/orders-0", LogConfig(segment_bytes=1 << 20))
    result = log.append(produce_records, now_ms)    # validates every batch; all or nothing
    data = log.read(result.base_offset, max_bytes=1 << 20)
    log.high_watermark, log.log_start_offset
    sync = log.flush_due(now_ms)                    # with an fsync interval instead of "always":
    sync()                                          # in a worker thread; log.flush_failed(exc) if it raised
    log.enforce_retention(now_ms)
    log.close()

A failed write or fsync takes the log offline (KAFKA_STORAGE_ERROR). After a back-off its owner may open it
again, as a restart would, and use the new log instead (the old one is closed)::

    if log.offline and (reopened := log.reopen()) is not None:
        log = reopened

Transactions (KIP-98): the coordinator ends a producer's transaction with a marker; the last stable
offset (LSO) is the first offset of the earliest open transaction, else the high watermark; aborted
transactions are kept per segment in ``<base>.txnindex`` for read_committed fetches::

    offset = log.append_marker(producer_id, producer_epoch, commit=False, coordinator_epoch=0, now_ms=now)
    data, end = log.read_range(offset, 1 << 20, upper_offset=log.last_stable_offset)
    log.aborted_transactions(offset, end)           # [(producer_id, first_offset)] overlapping the range

Calls are synchronous, quick (no waiting besides fsync) and not thread-safe: the broker calls them from
its single asyncio event-loop thread. Every ``now_ms`` is wall-clock milliseconds since the epoch
(``time.time() * 1000``): retention compares it with record timestamps.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from bisect import bisect_right
from collections.abc import Callable, Iterator

from twophase.durable import fsync_dir, unlink_quietly
from twophase.wire.errors import (
    CorruptRecordError,
    InvalidRecordError,
    KafkaStorageError,
    MessageTooLargeError,
    OffsetOutOfRangeError,
)
from twophase.wire.records import (
    INT32_MAX,
    NO_PARTITION_LEADER_EPOCH,
    BatchHeader,
    ControlRecord,
    control_batch,
    iter_batches,
    parse_control_record,
)

from .config import LogConfig
from .errors import DiskFullError, is_disk_full, raise_if_disk_full
from .open_files import OpenFiles
from .producers import ProducerStateManager
from .results import AppendResult, TimestampOffset
from .segment import DetachedSeal, Segment, index_path
from .txnindex import SUFFIX as TXN_INDEX_SUFFIX
from .txnindex import AbortedTxn

log = logging.getLogger(__name__)

REOPEN_BACKOFF_S = 1.0  # before an offline log is first opened again; doubled after each failed try
REOPEN_BACKOFF_MAX_S = 60.0


def _now_ms() -> int:
    return int(time.time() * 1000)


class PartitionLog:
    """The durable log of one topic-partition, stored in ``directory``."""

    def __init__(
        self,
        directory: str,
        config: LogConfig | None = None,
        *,
        now_ms: int | None = None,
        leader_epoch: int = NO_PARTITION_LEADER_EPOCH,
        open_files: OpenFiles | None = None,
    ) -> None:
        self.directory = directory
        self.config = config or LogConfig()
        self._open_files = open_files  # limits the segment files kept open (see open_files.py)
        # Stamped into every stored batch; -1 matches a Metadata leader epoch of -1, which makes
        # clients skip OffsetForLeaderEpoch validation.
        self.leader_epoch = leader_epoch
        self._failed: BaseException | None = None
        self._disk_full = False  # the last append found no space (logged once per episode)
        self._group_fsync_pending = False  # a sync from begin_fsync has not reported back yet
        self._reopen_at = 0.0  # time.monotonic() from which reopen() may try
        self._reopen_backoff = REOPEN_BACKOFF_S
        self._closed = False
        now = _now_ms() if now_ms is None else now_ms
        os.makedirs(directory, exist_ok=True)
        self._segments = self._open_segments()
        self._durable_end = self.log_end_offset  # recovery kept what is on disk
        self._flusher_end = 0  # the end of what the periodic flush fsynced (set in its worker thread)
        self.producers = ProducerStateManager(directory)
        self._last_abort_marker = -1  # offset of the newest ABORT marker in the index, -1 if none
        try:
            self._recover_producers(now)
        except BaseException:
            _close_all(self._segments)
            raise
        self._last_flush_ms: int | None = None
        self._pending_seals: list[_RollSeal] = []  # rolled segments to seal (fsync interval)
        self._unfinished_seals: dict[int, _RollSeal] = {}  # by segment base: queued or handed to the flusher
        self._directory_unsynced = False  # a segment was created since the directory's last fsync
        self._seal_lock = threading.Lock()  # a detached seal's file work against deleting the files

    # -- opening and recovery ----------------------------------------------------------------------

    def _open_segments(self) -> list[Segment]:
        names = os.listdir(self.directory)
        bases = sorted(int(n[:-4]) for n in names if n.endswith(".log") and n[:-4].isdigit())
        for name in names:
            stem = name.split(".")[0]
            index = name.endswith((".index", TXN_INDEX_SUFFIX))
            if name.endswith(".tmp") or (index and stem.isdigit() and int(stem) not in bases):
                unlink_quietly(os.path.join(self.directory, name))
        if not bases:
            segment = Segment.create(self.directory, 0, self.config.index_interval_bytes, self._open_files)
            fsync_dir(self.directory)
            return [segment]
        interval = self.config.index_interval_bytes
        # A segment's index file is written once its log is fsynced (seal). Without one (the active
        # segment, or one rolled shortly before a crash under an fsync interval) it may hold a torn
        # write, so every batch is CRC-checked.
        unsealed = {b for b in bases[:-1] if not os.path.exists(index_path(self.directory, b))}
        segments: list[Segment] = []
        try:
            for b in bases:
                segments.append(Segment.open(self.directory, b, interval, recover=b == bases[-1] or b in unsealed,
                                             open_files=self._open_files))
        except BaseException:
            _close_all(segments)  # say EMFILE part-way: no descriptor outlives the failed open
            raise
        for segment in segments[:-1]:
            if segment.base_offset in unsealed:
                segment.seal()  # checked and fsynced now: its index spares the next start the CRC scan
        for i in range(len(segments) - 1):
            if segments[i].damage is not None and segments[i].next_offset < segments[i + 1].base_offset:
                segments[i].next_offset = segments[i + 1].base_offset  # its damaged part runs to its end
            if segments[i].next_offset != segments[i + 1].base_offset:  # cut short by recovery
                for later in segments[i + 1:]:
                    log.warning("%s: dropping segment %d, it no longer follows on offset %d",
                                self.directory, later.base_offset, segments[i].next_offset)
                    later.delete()
                fsync_dir(self.directory)
                return segments[: i + 1]
        return segments

    def _recover_producers(self, now_ms: int) -> None:
        """Producer state and aborted-transaction indexes: the newest snapshot, then replay of the log after it.

        The replay re-derives the index entries of the markers it passes. An index that is missing or
        damaged below the replay start can only be rebuilt with the producer state of that point, so
        then the whole log is replayed.
        """
        snapshot = self.producers.load_snapshot(max_offset=self.high_watermark)
        if snapshot is not None and snapshot < self.log_start_offset:
            # Retention deleted batches after it (say, the marker ending a transaction it holds open), and
            # they cannot be replayed: its state is wrong, not just old. Kafka drops such snapshots too.
            log.warning("%s: producer snapshot at %d is below the log start %d: not used",
                        self.directory, snapshot, self.log_start_offset)
            self.producers.clear()
            snapshot = None
        start = self.log_start_offset if snapshot is None else snapshot
        damaged = [s.base_offset for s in self._segments
                   if s.txn_index.trusted_until < min(start, s.next_offset)]
        if damaged:
            log.warning("%s: aborted-transaction index of segment(s) %s incomplete: replaying the whole log",
                        self.directory, damaged)
            self.producers.clear()
            start = self.log_start_offset
        # A damaged segment whose sealed index is intact keeps it: the replay cannot re-derive what lies
        # past the damage.
        kept = {s.base_offset for s in self._segments
                if s.damage is not None and s.txn_index.trusted_until >= s.next_offset}
        for segment in self._segments:
            if segment.base_offset not in kept:
                segment.txn_index.truncate_from(start)
        replayed = 0
        for segment, header in self._iter_headers(start):
            marker = self._marker(segment, header) if header.is_control else None
            aborted = self.producers.replay(header, marker, now_ms)
            if aborted is not None and segment.base_offset not in kept:
                segment.txn_index.append(aborted)
            replayed += 1
        skipped = [s.base_offset for s in self._segments
                   if (s.damage is not None or s.bad_batches) and s.next_offset > start]
        if skipped:
            log.error("%s: the replay from offset %d skipped the damaged part of segment(s) %s: producer state "
                      "(sequences, open transactions) may miss what it held", self.directory, start, skipped)
        for segment in self._segments[:-1]:
            if segment.damage is None or segment.base_offset in kept:
                segment.txn_index.seal(segment.next_offset)  # sealed: fsync what the replay added
            else:
                segment.txn_index.close()  # re-derived up to the damage only: its seal claims no more
        self._last_abort_marker = max((s.txn_index.last_marker for s in self._segments), default=-1)
        if replayed:
            log.info("%s: replayed %d batches into producer state from offset %d", self.directory, replayed, start)

    def _iter_headers(self, from_offset: int) -> Iterator[tuple[Segment, BatchHeader]]:
        for segment in self._segments:
            if segment.next_offset > from_offset:
                for header in segment.iter_headers(max(from_offset, segment.base_offset)):
                    yield segment, header

    @staticmethod
    def _marker(segment: Segment, header: BatchHeader) -> ControlRecord | None:
        try:
            return parse_control_record(segment.read(header.base_offset, header.size))
        except (CorruptRecordError, OSError) as exc:  # a bad marker must not stop recovery of everything else
            log.warning("%s: unreadable control record at offset %d: %s", segment.path, header.base_offset, exc)
            return None

    # -- properties --------------------------------------------------------------------------------

    @property
    def log_start_offset(self) -> int:
        """The first offset still in the log (the base of the oldest segment)."""
        return self._segments[0].base_offset

    @property
    def high_watermark(self) -> int:
        """The end of what readers see. A single replica has nothing to wait for but the disk: under fsync
        "always" it is the end of what is fsynced (see ``append(defer_fsync=True)``), else the log end."""
        return self._durable_end if self.config.flush == "always" else self._segments[-1].next_offset

    @property
    def flushed_end(self) -> int:
        """Every offset below this one is fsynced (by an append under "always", a flush, a seal, or the
        periodic flush). A marker at or above it may be lost in a crash of the machine."""
        return max(self._durable_end, self._flusher_end)

    @property
    def log_end_offset(self) -> int:
        """The offset the next appended record gets (fsynced or not)."""
        return self._segments[-1].next_offset

    @property
    def last_stable_offset(self) -> int:
        """First offset of the earliest open transaction (not below the log start), else the high watermark."""
        first = self.producers.first_unstable_offset()
        if first is None:
            return self.high_watermark
        return min(max(first, self.log_start_offset), self.high_watermark)

    def has_open_transaction(self, producer_id: int) -> bool:
        """Whether ``producer_id`` has a transaction open on this partition."""
        return self.producers.has_open_transaction(producer_id)

    @property
    def size_bytes(self) -> int:
        """The size of all segments' log files, in bytes."""
        return sum(s.size for s in self._segments)

    @property
    def segments(self) -> list[Segment]:
        """A copy of the list of segments, oldest first."""
        return list(self._segments)

    def _check_usable(self) -> None:
        if self._closed:
            raise KafkaStorageError(f"log {self.directory} is closed")
        if self._failed is not None:
            raise KafkaStorageError(f"log {self.directory} failed earlier: {self._failed}")

    # -- appending ---------------------------------------------------------------------------------

    def append(
        self, records: bytes | bytearray | memoryview, now_ms: int, *, from_client: bool = True,
        defer_fsync: bool = False,
    ) -> AppendResult:
        """Validate and append every batch in ``records`` (all or none) and assign their offsets.

        ``from_client=False`` is for the transaction coordinator's control batches (markers). A retried
        idempotent batch returns its original offsets with ``duplicate=True`` and is not stored again.

        Under fsync "always" the batches are fsynced before this returns, unless ``defer_fsync``: then
        they stay invisible to readers until an fsync covers them (``begin_fsync``/``fsync_done``, or any
        later inline one), so many appends can share one fsync (group commit).
        """
        self._check_usable()
        # Not copied: the segment writes each batch's new offset and epoch beside a view of the rest.
        view = memoryview(records)
        batches = list(iter_batches(view))
        if not batches:
            raise InvalidRecordError("no record batches")
        next_offset = self.log_end_offset
        assigned: list[tuple[int, BatchHeader]] = []
        markers: list[ControlRecord | None] = []
        for pos, header in batches:
            if header.size > self.config.max_message_bytes:
                raise MessageTooLargeError(
                    f"batch of {header.size} bytes exceeds max_message_bytes {self.config.max_message_bytes}")
            _check_batch(header, from_client)
            is_marker = header.is_control
            markers.append(parse_control_record(view[pos : pos + header.size]) if is_marker else None)
            header = dataclasses.replace(header, base_offset=next_offset, leader_epoch=self.leader_epoch)
            assigned.append((pos, header))
            next_offset = header.last_offset + 1
        prepared = self.producers.prepare([h for _, h in assigned], markers, now_ms, from_client=from_client)
        if prepared.duplicate is not None:
            return prepared.duplicate
        try:
            active = self._segments[-1]
            # A damaged active segment is not served from its damage on: new batches go to a clean one.
            if not active.is_empty and (
                active.size + len(view) > self.config.segment_bytes or next_offset - 1 - active.base_offset > INT32_MAX
                or active.damage is not None
            ):
                self._roll()
                self.enforce_retention(now_ms)
            self._append_with_markers(view, assigned, prepared.aborted)
            if self.config.flush == "always" and not defer_fsync:
                self._segments[-1].flush()
                self._durable_end = next_offset
        except DiskFullError as exc:
            # Undone, so the log is as before and stays online: the next append tries again, and succeeds
            # once space returns. Until then every append answers KAFKA_STORAGE_ERROR at once.
            if not self._disk_full:
                log.warning("%s: disk full, appends answer KAFKA_STORAGE_ERROR until space returns: %s",
                            self.directory, exc)
                self._disk_full = True
            raise KafkaStorageError(f"disk full: {exc}") from exc
        except OSError as exc:
            self._take_offline(exc, "write")
            raise KafkaStorageError(f"write failed: {exc}") from exc
        if self._disk_full:
            log.info("%s: space is back, appends succeed again", self.directory)
            self._disk_full = False
        self.producers.commit(prepared)
        return AppendResult(assigned[0][1].base_offset, next_offset - 1)

    def _append_with_markers(self, view: memoryview, assigned: list[tuple[int, BatchHeader]],
                             aborted: list[AbortedTxn]) -> None:
        """Append the batches to the active segment, and the aborted transactions their ABORT markers end to
        its transaction index: the index first, so that no space for it refuses the append (DiskFullError)
        before the markers are written; the entries are undone if the batches cannot be written."""
        active = self._segments[-1]
        index = active.txn_index
        crc, trusted_until = index.checkpoint
        try:
            for i, txn in enumerate(aborted):
                index.append(txn)
        except OSError as exc:
            index.drop_last(i, crc=crc, trusted_until=trusted_until)
            raise_if_disk_full(exc, index.path)
            raise
        try:
            active.append(view, assigned)
        except BaseException:
            index.drop_last(len(aborted), crc=crc, trusted_until=trusted_until)
            raise
        if aborted:
            self._last_abort_marker = aborted[-1].last_offset

    def append_marker(
        self, producer_id: int, producer_epoch: int, commit: bool, coordinator_epoch: int, now_ms: int,
        *, flush: bool = True,
    ) -> int:
        """Write a COMMIT or ABORT marker ending ``producer_id``'s transaction here; returns its offset.

        An ABORT of an open transaction is recorded in the aborted-transactions index. A marker for a
        producer with no open transaction is stored and changes nothing else. Like Kafka, a marker with
        an epoch older than the producer's raises InvalidProducerEpochError and one from an older
        coordinator epoch TransactionCoordinatorFencedError.

        Under fsync "always" a marker is fsynced like any append. Under an fsync interval it is fsynced
        now too, unless ``flush=False``: then the periodic flush covers it (``flushed_end`` says when),
        and the caller must be able to write it again if a crash loses it (the transaction coordinator
        logs it as unsynced). An fsync here covers all the partition's unflushed data, up to an interval
        of it, on the event loop: the cost of a commit was mostly that.
        """
        marker = control_batch(producer_id, producer_epoch, commit, coordinator_epoch, now_ms)
        offset = self.append(marker, now_ms, from_client=False).base_offset
        if flush and self.config.flush != "always":
            self.flush()
        return offset

    def _roll(self) -> None:
        """Start a new active segment. Its files are created first, and no space for them, or for sealing the
        old one, raises DiskFullError with the new one removed: the old one stays active, as it was."""
        old = self._segments[-1]
        segment = Segment.create(self.directory, old.next_offset, self.config.index_interval_bytes,
                                 self._open_files)
        try:
            self._seal_rolled(old)
        except BaseException as exc:
            if not is_disk_full(exc):
                segment.close(sync=False)  # the log goes offline; recovery finds the empty segment
                raise
            segment.delete()
            raise DiskFullError(exc.errno, f"{old.path}: no space to seal it: {exc.strerror}") from exc
        self._segments.append(segment)
        log.info("%s: rolled new segment at offset %d", self.directory, segment.base_offset)

    def _seal_rolled(self, old: Segment) -> None:
        seal = None
        if self.config.flush != "always":
            try:
                seal = old.seal_detached()
            except OSError as exc:  # no descriptor to spare for the flusher: seal it here
                if is_disk_full(exc):
                    raise
                log.warning("%s: %s; sealing on the caller's thread", self.directory, exc)
        if seal is None:
            old.seal()
            if not self._unfinished_seals:  # an older segment's seal still pending: not all below is synced
                self._durable_end = old.next_offset
            self.producers.write_snapshot(old.next_offset)
            fsync_dir(self.directory)
        else:
            # Up to a flush interval of data is unsynced, and with it pending, the fsyncs of a roll (the
            # log, its index, the producer snapshot, the directory) take tens of ms: every connection
            # would wait. The periodic flusher does them off the event loop instead (flush_due).
            roll_seal = _RollSeal(self, old.base_offset, old.next_offset, seal,
                                  self.producers.snapshot_writer(old.next_offset))
            self._pending_seals.append(roll_seal)
            self._unfinished_seals[old.base_offset] = roll_seal
            self._directory_unsynced = True

    def roll(self) -> None:
        """Start a new segment now (no-op when the active segment is empty)."""
        self._check_usable()
        if not self._segments[-1].is_empty:
            self._roll()

    # -- flushing and retention --------------------------------------------------------------------

    def flush(self) -> None:
        """Fsync everything appended so far, here and now; what the flusher has not done yet included."""
        self._check_usable()
        self._run_pending_seals()
        for segment in self._segments[:-1]:
            segment.flush()  # only one whose detached fsync has not succeeded yet does anything
        if self._directory_unsynced:
            fsync_dir(self.directory)
            self._directory_unsynced = False
        self._segments[-1].flush()
        self._durable_end = self.log_end_offset

    def _run_pending_seals(self) -> None:
        while self._pending_seals:
            self._pending_seals.pop(0).run()

    def _discard_pending_seals(self) -> None:
        for seal in self._pending_seals:
            seal.discard()
        self._pending_seals = []
        self._unfinished_seals = {}

    def begin_fsync(self) -> tuple[int, Callable[[], None]] | None:
        """For group commit under fsync "always": (offset, sync) where ``sync`` fsyncs every offset below
        ``offset`` and may run in any thread; None if all is fsynced already. Report success with
        ``fsync_done(offset)`` and a failure with ``flush_failed``. One at a time per log.
        """
        self._check_usable()
        end = self.log_end_offset
        if self._durable_end >= end:
            return None
        sync = self._segments[-1].detach_flush()
        if sync is None:  # a roll or an inline flush synced it meanwhile
            self._durable_end = end
            return None
        self._group_fsync_pending = True
        return end, sync

    def fsync_done(self, offset: int) -> None:
        """A sync from ``begin_fsync`` finished: offsets below ``offset`` are durable, so readers see them."""
        self._durable_end = max(self._durable_end, offset)
        self._group_fsync_pending = False

    def flush_due(self, now_ms: int) -> Callable[[], None] | None:
        """An fsync of the segments rolled since the last call and, if the flush interval has elapsed, of
        what is unsynced in the active one; to run in any thread. None if there is nothing to do.

        The broker runs it in a worker thread, so that a slow fsync does not stall the event loop (Kafka's
        log flusher is a background thread too). A roll, close or retention meanwhile does no harm (see
        ``Segment.detach_flush``). If it raises, pass the error to ``flush_failed``.
        """
        interval = self.config.flush_interval_ms
        if interval is None or self._closed or self._failed:
            return None
        active = None
        end = self.log_end_offset  # what this sync covers if it syncs the active segment (seals before it)
        if self._last_flush_ms is None or now_ms - self._last_flush_ms >= interval:
            active = self._segments[-1].detach_flush()  # first: if it fails, the queued seals stay queued
            self._last_flush_ms = now_ms
        seals, self._pending_seals = self._pending_seals, []
        if active is None and not seals:
            return None

        def sync() -> None:
            for i, seal in enumerate(seals):
                try:
                    seal.run_detached()
                except BaseException:
                    for unrun in seals[i + 1:]:  # the log goes offline: release what will not run
                        unrun.discard()
                    if active is not None:
                        active.discard()
                    raise
            if active is not None:
                active()
                # Only the flusher writes it (one sync at a time), the event loop only reads it.
                self._flusher_end = end

        return sync

    def flush_failed(self, exc: Exception) -> None:
        """A detached fsync failed: the kernel may have dropped the unsynced pages, so the log goes offline."""
        self._group_fsync_pending = False
        self._take_offline(exc, "fsync")

    def _take_offline(self, exc: Exception, what: str) -> None:
        # Like Kafka taking a log dir offline: refuse further work until reopened (recovery repairs it).
        self._failed = exc
        self._discard_pending_seals()
        self._reopen_at = time.monotonic() + self._reopen_backoff
        log.error("%s: %s failed, log is offline until reopened: %s", self.directory, what, exc)

    @property
    def offline(self) -> bool:
        """Whether a failed write or fsync took the log offline: it answers KAFKA_STORAGE_ERROR until reopened."""
        return self._failed is not None

    def reopen(self) -> PartitionLog | None:
        """This offline log opened again as a restart would, for the caller to use from now on (this one is
        closed); None while its back-off lasts or an fsync started before the failure has not reported back
        (its producers may yet be acknowledged). A try that fails is logged, and doubles the back-off.

        Under fsync "always" the log is first cut back to its fsynced end: nothing after it was acknowledged,
        and nothing half-written or unacknowledged may become visible. Recovery then checks the tail, the
        indexes and the producer state, as at start.
        """
        now = time.monotonic()
        if self._failed is None or now < self._reopen_at or self._group_fsync_pending:
            return None
        try:
            if not self._closed:
                if self.config.flush == "always":
                    self._cut_back_to(self._durable_end)
                self._closed = True
                self._discard_pending_seals()
                _close_all(self._segments)  # without an fsync: recovery decides what the files hold
            reopened = PartitionLog(self.directory, self.config, leader_epoch=self.leader_epoch,
                                    open_files=self._open_files)
        except Exception as exc:
            self._reopen_at = now + self._reopen_backoff
            log.error("%s: still offline, opening it again failed (next try in %gs): %s",
                      self.directory, self._reopen_backoff, exc)
            self._reopen_backoff = min(2 * self._reopen_backoff, REOPEN_BACKOFF_MAX_S)
            return None
        self._reopen_at = float("inf")  # replaced: never opened again through this one
        log.warning("%s: back online after it failed (%s); log end offset %d",
                    self.directory, self._failed, reopened.log_end_offset)
        return reopened

    def _cut_back_to(self, offset: int) -> None:
        """Remove every batch from ``offset`` on (a batch boundary) from the files."""
        for segment in self._segments:
            if segment.next_offset > offset:
                at = 0 if segment.base_offset >= offset else segment.find_position(offset)
                log.warning("%s: dropping %d unacknowledged bytes from offset %d", segment.path,
                            segment.size - at, max(offset, segment.base_offset))
                os.truncate(segment.path, at)  # by path: this descriptor may carry the failed fsync's error

    def enforce_retention(self, now_ms: int) -> int:
        """Delete whole old segments beyond retention_ms / retention_bytes; returns how many were deleted."""
        self._check_usable()
        deleted = 0
        retention_ms = self.config.retention_ms
        if retention_ms >= 0:
            while now_ms - self._segments[0].largest_timestamp() > retention_ms:
                if len(self._segments) == 1:
                    if self._segments[0].is_empty:
                        break
                    try:
                        self._roll()  # the active segment expired too: keep an empty one at the log end
                    except DiskFullError as exc:
                        log.warning("%s: retention postponed, no space to roll: %s", self.directory, exc)
                        break
                self._delete_oldest("retention.ms")
                deleted += 1
        retention_bytes = self.config.retention_bytes
        if retention_bytes >= 0:
            total = self.size_bytes
            while len(self._segments) > 1 and total - self._segments[0].size >= retention_bytes:
                total -= self._segments[0].size
                self._delete_oldest("retention.bytes")
                deleted += 1
        self.producers.expire(now_ms, self.config.producer_id_expiration_ms)
        return deleted

    def _delete_oldest(self, reason: str) -> None:
        segment = self._segments.pop(0)
        seal = self._unfinished_seals.get(segment.base_offset)
        if seal is None:
            segment.delete()
        else:
            # Its seal, queued or in the flusher, must not fsync or index deleted data (see drop_segment).
            # The lock is taken only then, so a running seal of another segment does not stall retention.
            with self._seal_lock:
                seal.drop_segment()
                segment.delete()
        log.info("%s: deleted segment %d (%s); log start offset now %d",
                 self.directory, segment.base_offset, reason, self.log_start_offset)

    # -- reading -----------------------------------------------------------------------------------

    def read(self, offset: int, max_bytes: int, upper_offset: int | None = None) -> bytes:
        """Whole batches from the one holding ``offset``: up to ``max_bytes``, but at least one batch.

        ``upper_offset`` (e.g. the LSO for read_committed) excludes batches starting at or above it.
        Raises OffsetOutOfRangeError outside [log_start_offset, log_end_offset] (``check_fetch_offset``);
        returns b"" from the high watermark on.
        """
        return self.read_range(offset, max_bytes, upper_offset)[0]

    def read_range(self, offset: int, max_bytes: int, upper_offset: int | None = None) -> tuple[bytes, int]:
        """Like read(), plus the offset after the last batch returned (``offset`` when none is)."""
        self._check_usable()
        self.check_fetch_offset(offset)
        high_watermark = self.high_watermark
        if offset >= high_watermark:
            return b"", offset  # the high watermark is an append's end: no batch from here on is visible
        if high_watermark < self.log_end_offset and (upper_offset is None or upper_offset > high_watermark):
            upper_offset = high_watermark  # appended but not yet fsynced: not for readers
        chunks: list[bytes] = []
        remaining = max_bytes
        end = offset
        for segment in self._segments[self._segment_index(offset) :]:
            data, complete, next_offset = segment.read_chunk(offset, remaining, upper_offset, min_one=not chunks)
            if data:
                chunks.append(data)
                remaining -= len(data)
                end = next_offset
            # Stop where this segment stopped early, so the result never skips offsets, and where the
            # upper offset lies (later segments start above it).
            if not complete or remaining <= 0 or (upper_offset is not None and upper_offset <= segment.next_offset):
                break
        return b"".join(chunks), end

    def check_fetch_offset(self, offset: int) -> None:
        """Raise OffsetOutOfRangeError unless log_start_offset <= offset <= log_end_offset.

        As in Kafka, an offset above the high watermark is not out of range: its batches are appended
        (their fsync pending), and a fetch there gets nothing yet, or waits for them.
        """
        if not self.log_start_offset <= offset <= self.log_end_offset:
            raise OffsetOutOfRangeError(f"offset {offset} outside [{self.log_start_offset}, {self.log_end_offset}]")

    def aborted_transactions(self, start_offset: int, end_offset: int) -> list[tuple[int, int]]:
        """(producer id, first offset) of the aborted transactions overlapping [start_offset, end_offset).

        Starts at the segment holding ``start_offset`` (a transaction's marker follows its data) and stops
        at the first entry proving that no later transaction can overlap, so it never scans the whole log.
        """
        self._check_usable()
        found: list[tuple[int, int]] = []
        if start_offset >= end_offset or start_offset > self._last_abort_marker:
            return found  # the common case: no abort at or after the fetch offset
        for segment in self._segments[self._segment_index(start_offset) :]:
            if len(segment.txn_index) and segment.txn_index.collect(start_offset, end_offset, found):
                break
        return found

    def _segment_index(self, offset: int) -> int:
        """Index in ``_segments`` of the segment holding ``offset`` (0 below the log start)."""
        segments = self._segments
        if len(segments) == 1 or offset >= segments[-1].base_offset:
            return len(segments) - 1
        return max(0, bisect_right([s.base_offset for s in segments], offset) - 1)

    def timestamp_lookup(self, timestamp_ms: int) -> TimestampOffset | None:
        """The first record with timestamp >= ``timestamp_ms`` (offset and its timestamp), or None."""
        self._check_usable()
        for segment in self._segments:
            if segment.max_timestamp >= timestamp_ms:
                found = segment.find_timestamp(timestamp_ms)
                if found is not None:
                    return TimestampOffset(*found)
        return None

    def offset_of_max_timestamp(self) -> TimestampOffset | None:
        """The first record carrying the log's largest timestamp (ListOffsets -3), or None when empty."""
        self._check_usable()
        best: TimestampOffset | None = None
        for segment in self._segments:
            if segment.is_empty or (best is not None and segment.max_timestamp <= best.timestamp):
                continue
            found = segment.find_timestamp(segment.max_timestamp)
            if found is not None:
                best = TimestampOffset(*found)
        return best

    def offset_for_timestamp(self, timestamp_ms: int) -> int | None:
        """First offset with timestamp >= ``timestamp_ms`` (ListOffsets by timestamp), or None."""
        found = self.timestamp_lookup(timestamp_ms)
        return None if found is None else found.offset

    # -- closing -----------------------------------------------------------------------------------

    def close(self) -> None:
        """Fsync, write the index and a producer snapshot, and release the files. Idempotent."""
        if self._closed:
            return
        try:
            if self._failed is None:
                self._run_pending_seals()
            self._closed = True
            if self._failed is None:
                self._segments[-1].seal()
                self._durable_end = self.log_end_offset
                self.producers.write_snapshot(self.high_watermark)
        finally:
            # Every descriptor is released (the duplicates of seals left undone too), also when a seal
            # failed or the log is offline (then nothing is fsynced: the log is not trusted until
            # recovery); the first error is raised.
            self._closed = True
            self._discard_pending_seals()
            _close_all(self._segments, sync=self._failed is None)

    def release_files(self) -> None:
        """Close the files of every segment with nothing unsynced (they are opened again when used):
        for logs opened in a thread other than their OpenFiles' owner (see open_files.py)."""
        for segment in self._segments:
            if segment.idle():
                segment.release_file()

    def delete_files(self) -> None:
        """Close and remove every file of this log (used when the topic is deleted)."""
        with self._seal_lock:  # a seal running in the flusher must not write into a recreated directory
            self._closed = True
        self._discard_pending_seals()
        _close_all(self._segments, sync=False)  # first: no descriptor outlives a failed unlink
        for segment in self._segments:
            segment.delete()
        for name in os.listdir(self.directory):
            unlink_quietly(os.path.join(self.directory, name))


def _check_batch(header: BatchHeader, from_client: bool) -> None:
    """Kafka's produce-path checks of one batch's header (INVALID_RECORD)."""
    if header.record_count < 1 or header.last_offset_delta != header.record_count - 1:
        raise InvalidRecordError(
            f"record count {header.record_count} inconsistent with last offset delta {header.last_offset_delta}")
    if from_client and header.is_control:
        raise InvalidRecordError("clients may not write control batches")
    if header.is_transactional and not header.has_producer_id:
        raise InvalidRecordError("transactional batch without a producer id")
    if header.has_producer_id and not header.is_control and header.base_sequence < 0:
        raise InvalidRecordError(f"producer {header.producer_id} batch without a sequence number")


def _close_all(segments: list[Segment], *, sync: bool = False) -> None:
    """Close every segment, even if closing one fails; the first failure is raised after."""
    error: BaseException | None = None
    for segment in segments:
        try:
            segment.close(sync=sync)
        except BaseException as exc:
            error = error or exc
    if error is not None:
        raise error


class _RollSeal:
    """What a roll under an fsync interval leaves to the flusher, in this order, so that nothing on disk
    claims more than is synced: the rolled segment's fsync and index file, the producer snapshot at its
    end, and the directory (for the new segment's entry)."""

    def __init__(self, plog: PartitionLog, base_offset: int, end_offset: int, seal: DetachedSeal,
                 snapshot: Callable[[], None]) -> None:
        self._log = plog
        self._base_offset = base_offset
        self._end_offset = end_offset  # where the producer snapshot is taken
        self._seal = seal
        self._snapshot = snapshot
        self._segment_deleted = False

    def run(self) -> None:
        """On the log's own thread (an inline flush or close), or in the flusher's (``run_detached``)."""
        if not self._segment_deleted:
            self._seal()
        if self._end_offset >= self._log.log_start_offset:
            # Even for a deleted segment: at the new log start it holds the state of producers whose
            # data retention deleted (recovery ignores snapshots below the start, and has no data to replay).
            self._snapshot()
        fsync_dir(self._log.directory)
        self._log._unfinished_seals.pop(self._base_offset, None)

    def drop_segment(self) -> None:
        """Retention deleted the segment (the caller holds the log's seal lock): no fsync or index is
        left to do for it; its snapshot only if it is at the new log start."""
        self._segment_deleted = True
        self._seal.discard()

    def run_detached(self) -> None:
        """In the flusher's worker thread; does nothing once the log is closed or its topic deleted."""
        with self._log._seal_lock:
            if self._log._closed:
                self.discard()
            else:
                self.run()

    def discard(self) -> None:
        self._seal.discard()
