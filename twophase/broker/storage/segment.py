"""One log segment: ``<base>.log`` (concatenated record batches), its sparse ``<base>.index`` and its
aborted-transactions index ``<base>.txnindex`` (twophase.broker.storage.txnindex).

Each index entry is 16 bytes: the batch's base offset relative to the segment (i32), the batch's file
position (i32) and the largest timestamp of all batches before that position (i64). Offset lookups
bisect the first column, timestamp lookups the third (a running maximum, hence sorted). An entry is
added once ``index_interval_bytes`` have been appended since the last one. The active segment keeps
its index in memory; ``seal()`` writes it when the segment rolls, and recovery rebuilds a missing or
inconsistent index from the log itself.

Reads CRC-check what they serve, once: a closed segment opened without recovery (its batches were
checked when written, but a disk can flip a byte since) checks each batch the first time it is read
and remembers the checked file ranges, so later reads of them cost nothing; the active segment is
checked on append (and fully on recovery). A damaged batch found is logged as an ERROR. If only its
CRC fails and its framing holds (the next batch starts at its end with the offset after its last),
reads raise CorruptRecordError (CORRUPT_MESSAGE) for its offsets alone and serve the batches after
it (``bad_batches``). Otherwise it marks the segment damaged from there to its end (``damage``):
reads return the batches before it and raise CorruptRecordError for any offset from it on, rather
than serve bytes that fail their CRC or offsets that do not follow on.

Example::

    seg = Segment.create(directory, base_offset=0, index_interval_bytes=4096)
    seg.append(data, headers)                 # headers: [(position in data, BatchHeader)] with offsets assigned
                                              # (written with those offsets and leader epochs; data unchanged)
    seg.read(offset=5, max_bytes=1 << 20)     # whole batches, starting with the one holding offset 5
    seg.damage                                # None, or where the first damaged batch was found
    seg.close()
"""

from __future__ import annotations

import errno
import logging
import os
import struct
import threading
from array import array
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from twophase.durable import fsync_dir
from twophase.wire.errors import CorruptRecordError, KafkaStorageError
from twophase.wire.records import (
    HEADER_SIZE,
    INT32_MAX,
    LOG_OVERHEAD,
    MAGIC,
    BatchHeader,
    iter_record_timestamps,
    parse_header,
    validate_batch,
)

from .errors import is_disk_full, raise_if_disk_full
from .open_files import OpenFiles
from .txnindex import TransactionIndex, txn_index_path

log = logging.getLogger(__name__)

NO_TIMESTAMP = -1
_ENTRY = struct.Struct(">iiq")
_PREFIX = struct.Struct(">qi")
# baseOffset, batchLength, partitionLeaderEpoch: the bytes before magic, all outside the CRC.
_STAMPED_HEAD = struct.Struct(">qii")
_LAST_OFFSET_DELTA = struct.Struct(">i")
_LOOKUP_CHUNK = 64 * 1024
_RECOVERY_CHUNK = 1024 * 1024

_fdatasync = getattr(os, "fdatasync", os.fsync)
_INT64_MAX = 2**63 - 1
# Buffers per os.writev call (1024 on Linux); -1 means no limit, where 1024 is as good as any.
_IOV_MAX = os.sysconf("SC_IOV_MAX")
if _IOV_MAX < 1:
    _IOV_MAX = 1024


def _next_offset(data: bytes, pos: int) -> int:
    """The offset after the batch at ``pos``: its base offset plus lastOffsetDelta plus one."""
    return _PREFIX.unpack_from(data, pos)[0] + _LAST_OFFSET_DELTA.unpack_from(data, pos + 23)[0] + 1


def _stamped_buffers(data: memoryview, headers: Sequence[tuple[int, BatchHeader]]) -> list[bytes | memoryview]:
    """Two os.writev buffers per batch: its head stamped from its header, then a view of the rest in ``data``."""
    buffers: list[bytes | memoryview] = []
    add, pack, head_size = buffers.append, _STAMPED_HEAD.pack, _STAMPED_HEAD.size  # runs per batch: kept lean
    for pos, header in headers:
        add(pack(header.base_offset, header.length, header.leader_epoch))
        add(data[pos + head_size : pos + LOG_OVERHEAD + header.length])
    return buffers


@dataclass(frozen=True)
class Damage:
    """The first damaged batch found in a segment: its file position, its offset and what is wrong."""
    position: int
    offset: int
    reason: str


@dataclass(frozen=True)
class BadBatch:
    """A batch that failed its CRC check but whose framing holds: file positions [position, end_position)
    and offsets [offset, end_offset), both bounded by the batch that follows it."""
    position: int
    end_position: int
    offset: int
    end_offset: int
    reason: str


class CheckedRanges:
    """Disjoint, sorted file ranges [start, end) whose batches passed their CRC check.

    Usage::

        checked = CheckedRanges()
        checked.add(0, 4096)
        checked.add(4096, 8192)      # merged: [(0, 8192)]
        checked.end_of(100)          # 8192: the end of the range holding position 100 (None if unchecked)
    """

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._ends: list[int] = []

    def end_of(self, pos: int) -> int | None:
        """The end of the checked range holding ``pos``, None if ``pos`` is unchecked."""
        i = bisect_right(self._starts, pos) - 1
        return self._ends[i] if i >= 0 and pos < self._ends[i] else None

    def add(self, start: int, end: int) -> None:
        """Mark [start, end) checked, merging it with the ranges it touches."""
        lo = bisect_left(self._ends, start)  # the first range ending at or after start
        hi = bisect_right(self._starts, end)  # past the last range starting at or before end
        if lo < hi:
            start, end = min(start, self._starts[lo]), max(end, self._ends[hi - 1])
        self._starts[lo:hi] = [start]
        self._ends[lo:hi] = [end]


def log_path(directory: str, base_offset: int) -> str:
    """The path of the log file of the segment starting at ``base_offset``."""
    return os.path.join(directory, f"{base_offset:020d}.log")


def index_path(directory: str, base_offset: int) -> str:
    """The path of the offset index file of the segment starting at ``base_offset``."""
    return os.path.join(directory, f"{base_offset:020d}.index")


class Segment:
    """An append-only segment file; all calls are synchronous and not thread-safe.

    Its log file is opened when first used; with ``open_files`` (see open_files.py) it may be closed
    while idle and opened again when used."""

    def __init__(self, directory: str, base_offset: int, index_interval_bytes: int,
                 open_files: OpenFiles | None = None) -> None:
        self.directory = directory
        self.base_offset = base_offset
        self.index_interval_bytes = index_interval_bytes
        self.path = log_path(directory, base_offset)
        self._open_files = open_files
        self._file_fd = -1
        self._file_closed = False
        self.next_offset = base_offset
        self.max_timestamp = NO_TIMESTAMP
        self._rel_offsets = array("i")
        self._positions = array("i")
        self._ts_before = array("q")
        self._bytes_since_index = 0
        self._dirty = False  # appended to since the last fsync started
        self._detached_sync = False  # an fsync was handed to another thread (detach_flush)
        # Held around every fdatasync of this file. Linux reports a writeback error once per open
        # file, and the detached fsync's duplicate shares it: an fsync that failed there must fail
        # the next one here too, not let a later one on this descriptor succeed.
        self._sync_lock = threading.Lock()
        self._sync_error: OSError | None = None
        self.txn_index = TransactionIndex(txn_index_path(directory, base_offset), base_offset)
        self._checked = CheckedRanges()  # file ranges whose batches passed their CRC check
        self.damage: Damage | None = None  # the first damaged batch a read found (without intact framing)
        self.bad_batches: dict[int, BadBatch] = {}  # by file position: damaged batches skipped, see BadBatch
        self._file_fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            self.size = os.fstat(self._file_fd).st_size
            if open_files is not None:
                open_files.used(self)
        except BaseException:
            self.close(sync=False)  # not yet returned to anyone: nothing else would release it
            raise

    @property
    def _fd(self) -> int:
        """The log file's descriptor, opened again if it was closed while idle (-1 once the segment is
        closed). No descriptor to spare is KafkaStorageError, not an OSError: nothing failed on disk,
        so the log must not go offline for it."""
        if self._file_closed:
            return -1  # not counted as used: a closed segment must not enter the open files
        if self._file_fd < 0:
            try:
                self._file_fd = os.open(self.path, os.O_RDWR | os.O_APPEND)
            except OSError as exc:
                if exc.errno not in (errno.EMFILE, errno.ENFILE):
                    raise
                raise KafkaStorageError(f"{self.path}: no descriptor to open it: {exc}") from exc
        if self._open_files is not None:
            self._open_files.used(self)
        return self._file_fd

    def idle(self) -> bool:
        """Whether its files could be closed now without losing anything: open, and nothing unsynced."""
        return self._file_fd >= 0 and not (self._dirty or self._detached_sync or self.txn_index.dirty)

    def release_file(self, *, sync: bool = False) -> None:
        """Close the files while idle (see ``idle``), or after an fsync of what is unsynced with ``sync``;
        they are opened again when next used. A failed fsync leaves them open (and is raised by the
        next flush, so the log that owns them goes offline)."""
        if sync:
            if self._sync_error is not None:
                return  # its log is going offline for that error: nothing to close it for
            try:
                self.flush()
            except OSError as exc:
                log.warning("%s: fsync before closing an idle file failed, kept open: %s", self.path, exc)
                return
        if self._file_fd >= 0:
            os.close(self._file_fd)
            self._file_fd = -1
        self.txn_index.close(sync=False)  # nothing unsynced: its next append opens it again
        if self._open_files is not None:
            self._open_files.closed(self)

    # -- opening ---------------------------------------------------------------------------------

    @classmethod
    def create(cls, directory: str, base_offset: int, index_interval_bytes: int,
               open_files: OpenFiles | None = None) -> Segment:
        """A new, empty segment with an empty transaction index; FileExistsError if its log already holds data."""
        seg = cls(directory, base_offset, index_interval_bytes, open_files)
        try:
            if seg.size:
                raise FileExistsError(f"segment {seg.path} already holds data")
            seg.txn_index = TransactionIndex.create(directory, base_offset)
        except BaseException as exc:
            seg.close(sync=False)  # say EMFILE for the index: the log's descriptor must not leak
            if not isinstance(exc, FileExistsError):
                seg.txn_index.delete()  # empty: its files would only stand in the way of the next try
                os.unlink(seg.path)
            raise_if_disk_full(exc, f"{seg.path}: no space for a new segment")
            raise
        return seg

    @classmethod
    def open(cls, directory: str, base_offset: int, index_interval_bytes: int, *, recover: bool,
             open_files: OpenFiles | None = None) -> Segment:
        """Open an existing segment; ``recover`` CRC-checks every batch (for the possibly torn active segment).

        Otherwise the index is trusted if consistent and only the bytes after its last entry are
        walked. A bad batch is logged; with ``recover`` it is truncated if it is a torn tail (nothing
        intact follows it), else (and always without ``recover``) the segment is marked damaged there.
        """
        seg = cls(directory, base_offset, index_interval_bytes, open_files)
        try:
            kept = 0 if recover else seg._load_index()
            seg._rescan(kept, validate=recover)
            if recover:
                seg._checked.add(0, seg.size)
                # What a crash left in the page cache unsynced counts as written from now on (a producer's
                # retry of it is acknowledged as a duplicate), so it is made durable before anyone can ask.
                seg._sync()
            # A damaged segment's end is not known from its log: its sealed index says how far it goes.
            end = seg.next_offset if seg.damage is None else _INT64_MAX
            seg.txn_index = TransactionIndex.load(directory, base_offset, end)
        except BaseException:
            seg.close(sync=False)
            raise
        return seg

    def _load_index(self) -> int:
        """Load the index file; returns how many entries are usable (0 means rebuild everything)."""
        try:
            with open(index_path(self.directory, self.base_offset), "rb") as f:
                raw = f.read()
        except FileNotFoundError:
            return 0
        if len(raw) % _ENTRY.size:
            return 0
        prev = (-1, 0, NO_TIMESTAMP)
        entries = list(_ENTRY.iter_unpack(raw))
        for rel, pos, ts in entries:
            if rel <= prev[0] or pos <= prev[1] or ts < prev[2] or pos >= self.size:
                log.warning("%s: inconsistent index, rebuilding", self.path)
                return 0
            prev = (rel, pos, ts)
        if entries:
            rel, pos, _ = entries[-1]
            prefix = os.pread(self._fd, LOG_OVERHEAD, pos)
            if len(prefix) < LOG_OVERHEAD or _PREFIX.unpack(prefix)[0] != self.base_offset + rel:
                log.warning("%s: index does not match the log, rebuilding", self.path)
                return 0
        for rel, pos, ts in entries:
            self._rel_offsets.append(rel)
            self._positions.append(pos)
            self._ts_before.append(ts)
        return len(entries)

    def _rescan(self, kept: int, *, validate: bool) -> None:
        """Walk the log from index entry ``kept - 1`` (or the start), re-deriving state; truncate a torn tail
        (``validate``: the possibly torn active segment), or mark the segment damaged there: a sealed one
        always, the active one when intact batches follow the bad one to the end of the file (a crash
        tears only the end; acknowledged batches after a flipped byte are kept, and not served)."""
        if kept:
            # Resume at the last trusted entry; dropping it and forcing the interval re-adds it.
            start = self._positions[kept - 1]
            self.max_timestamp = self._ts_before[kept - 1]
            self.next_offset = self.base_offset + self._rel_offsets[kept - 1]
            self._bytes_since_index = self.index_interval_bytes
            kept -= 1
        else:
            start = 0
            self.max_timestamp = NO_TIMESTAMP
            self.next_offset = self.base_offset
            self._bytes_since_index = 0
        del self._rel_offsets[kept:], self._positions[kept:], self._ts_before[kept:]
        file_size = self.size
        self.size = start
        try:
            self._track_from(start, validate=validate)
        except CorruptRecordError as exc:
            at = self.size if exc.position is None else exc.position
            resume = self._intact_run_after(at, file_size) if validate else None
            if not validate or resume is not None:
                # A sealed segment was fsynced before its index was written: no crash tears it, so this is
                # damage. Its bytes are kept (they may be repairable) and not served: the bad batch alone
                # if the intact run starts right at its end, else everything from it on.
                expected, self.size = self.next_offset, file_size
                alone = resume is not None and resume == self._framed_end(at)
                if not (alone and self._mark_bad_batch(at, expected, exc.reason)):
                    self._mark_damaged(at, expected, exc.reason)
                if resume is not None:  # the offsets up to the end stay taken: appends go after them
                    self.next_offset = _PREFIX.unpack(os.pread(self._fd, LOG_OVERHEAD, resume))[0]
                    self._track_from(resume, validate=True)
                return
            log.warning(
                "%s: truncating corrupt or torn tail at offset %d (file position %d): dropping %d bytes: %s",
                self.path, self.next_offset, self.size, file_size - self.size, exc.reason)
        if self.size < file_size:
            os.ftruncate(self._fd, self.size)
            self._sync()

    def _track_from(self, start: int, *, validate: bool) -> None:
        """Walk the batches from ``start`` to the end of the file into the index and offsets (see ``_rescan``)."""
        for pos, header in self._walk(start, validate=validate, chunk=_RECOVERY_CHUNK):
            # baseOffset lies outside the CRC; this log never leaves gaps, so a mismatch is damage.
            if header.base_offset != self.next_offset or header.last_offset_delta < 0:
                raise CorruptRecordError(
                    f"batch offset {header.base_offset} (+{header.last_offset_delta}) "
                    f"does not follow {self.next_offset}", pos)
            self._track(pos, header)
            self.size = pos + header.size

    def _intact_run_after(self, at: int, end: int) -> int | None:
        """The position after ``at`` (a bad batch) from which CRC-valid batches with consecutive offsets, from
        ``next_offset`` on, run exactly to ``end``; None if there is none (a torn tail).

        The bad batch's own length is tried first (a flipped byte elsewhere leaves it intact); else every
        later position whose magic byte and length fit is tried.
        """
        own_end = self._framed_end(at)
        if own_end is not None and at < own_end < end and self._runs_to(own_end, end):
            return own_end
        magic = bytes([MAGIC])
        magic_at = LOG_OVERHEAD + 4  # after partitionLeaderEpoch
        window_start = at + 1
        while window_start + HEADER_SIZE <= end:
            window = os.pread(self._fd, _RECOVERY_CHUNK + HEADER_SIZE, window_start)
            found = window.find(magic, magic_at)
            while found >= 0 and found - magic_at + HEADER_SIZE <= len(window):
                pos = window_start + found - magic_at
                base, length = _PREFIX.unpack_from(window, found - magic_at)
                if (0 <= base - self.next_offset <= INT32_MAX and HEADER_SIZE - LOG_OVERHEAD <= length
                        and pos + LOG_OVERHEAD + length <= end and self._runs_to(pos, end)):
                    return pos
                found = window.find(magic, found + 1)
            window_start += _RECOVERY_CHUNK
        return None

    def _framed_end(self, pos: int) -> int | None:
        """Where the batch at ``pos`` ends by its length field (None if the file ends before that field)."""
        prefix = os.pread(self._fd, LOG_OVERHEAD, pos)
        return pos + LOG_OVERHEAD + _PREFIX.unpack(prefix)[1] if len(prefix) == LOG_OVERHEAD else None

    def _runs_to(self, pos: int, end: int) -> bool:
        """Whether CRC-valid batches with consecutive offsets (from ``next_offset`` on) run from ``pos`` to ``end``."""
        expected = None
        try:
            for _, header in self._walk(pos, validate=True, chunk=_RECOVERY_CHUNK):
                if header.base_offset < self.next_offset or header.last_offset_delta < 0 or (
                        expected is not None and header.base_offset != expected):
                    return False
                expected = header.last_offset + 1
        except CorruptRecordError:
            return False
        return expected is not None

    def _walk(self, pos: int, *, validate: bool, chunk: int) -> Iterator[tuple[int, BatchHeader]]:
        """Yield (position, header) from ``pos`` to the end of the file, reading ``chunk`` bytes at a time."""
        end = os.fstat(self._fd).st_size
        buf = b""
        buf_start = pos
        while pos < end:
            off = pos - buf_start
            if off + HEADER_SIZE > len(buf):
                buf, buf_start, off = os.pread(self._fd, chunk, pos), pos, 0
            if len(buf) - off < LOG_OVERHEAD:
                raise CorruptRecordError(f"truncated batch: {len(buf) - off} bytes left", pos)
            length = _PREFIX.unpack_from(buf, off)[1]
            size = LOG_OVERHEAD + length
            try:
                if validate:
                    if off + size > len(buf) and 0 < size <= end - pos:
                        buf, buf_start, off = os.pread(self._fd, max(chunk, size), pos), pos, 0
                    header = validate_batch(buf, off)
                else:
                    header = parse_header(buf, off)
                    if header.magic != MAGIC:
                        raise CorruptRecordError(f"unsupported magic {header.magic}")
                    if length < HEADER_SIZE - LOG_OVERHEAD or size > end - pos:
                        raise CorruptRecordError(f"bad batch length {length}")
            except CorruptRecordError as exc:
                raise CorruptRecordError(exc.reason, pos) from None
            yield pos, header
            pos += size

    # -- writing ---------------------------------------------------------------------------------

    def _track(self, pos: int, header: BatchHeader) -> None:
        if pos > 0 and self._bytes_since_index >= self.index_interval_bytes:
            self._rel_offsets.append(header.base_offset - self.base_offset)
            self._positions.append(pos)
            self._ts_before.append(self.max_timestamp)
            self._bytes_since_index = 0
        self._bytes_since_index += header.size
        self.max_timestamp = max(self.max_timestamp, header.max_timestamp)
        self.next_offset = header.last_offset + 1

    def append(self, data: bytes | bytearray | memoryview, headers: Sequence[tuple[int, BatchHeader]]) -> None:
        """Append the validated batches of ``data`` (all of it), each stamped with the base offset and leader
        epoch of its header in ``headers`` (position in ``data``, header with offsets assigned).

        ``data`` is neither copied nor modified: each batch goes out as a new 16-byte head followed by a
        view of its remaining bytes, in as few os.writev calls as IOV_MAX allows. A failed write is undone
        (the file is cut back); one for want of space raises DiskFullError.
        """
        start = self.size
        try:
            buffers = _stamped_buffers(memoryview(data), headers)
            for i in range(0, len(buffers), _IOV_MAX):
                group = buffers[i : i + _IOV_MAX]
                size = sum(map(len, group))
                written = os.writev(self._fd, group)
                if written != size:
                    # A regular file takes fewer bytes than given only when the disk (or quota) is full.
                    raise OSError(errno.ENOSPC, f"short write to {self.path}: {written} of {size} bytes")
        except BaseException as exc:
            # Leave no partial batch behind: the caller reports the failure and state stays consistent.
            os.ftruncate(self._fd, start)
            raise_if_disk_full(exc, self.path)
            raise
        for pos, header in headers:
            self._track(start + pos, header)
        self.size = start + len(data)
        self._checked.add(start, self.size)  # the caller validated every batch
        self._dirty = True

    def _sync(self, fd: int | None = None) -> None:
        with self._sync_lock:
            if self._sync_error is not None:
                raise self._sync_error
            try:
                _fdatasync(self._fd if fd is None else fd)
            except OSError as exc:
                self._sync_error = exc
                raise

    def flush(self) -> None:
        """fsync what was appended since the last sync (again if a detached sync has not succeeded), and the
        transaction index's new entries, so the segment is idle after; raises OSError."""
        if self._dirty or self._detached_sync:
            self._sync()
            self._dirty = self._detached_sync = False
        self.txn_index.flush()

    def detach_flush(self) -> DetachedSync | None:
        """An fsync of everything appended so far (transaction index included), to run in another thread;
        None if nothing is unsynced.

        It works on a duplicate of the descriptor, so closing or deleting the segment meanwhile does no
        harm. Until it has succeeded, ``flush()`` (so ``seal()`` and ``close()``) fsyncs again rather
        than trust it (waiting for it if it is running).
        """
        if not self._dirty:  # an index entry is written only with the marker appended to the log
            return None
        return self._detach()

    def _detach(self) -> DetachedSync:
        sync = DetachedSync(self, os.dup(self._fd), self.txn_index.detach_sync())
        self._dirty = False
        self._detached_sync = True
        return sync

    def seal(self) -> None:
        """Make the segment durable before it stops being the active one: fsync the log and both indexes."""
        self.flush()
        self._seal_txn_index(sync=True)
        self._write_index(self._index_bytes())

    def seal_detached(self) -> DetachedSeal:
        """Like ``seal()``, but the fsyncs (log and transaction index, whose dirtiness goes with them) and the
        index file are left to a call that may run in any thread.

        The index file is written only after those fsyncs, and an older one is removed now: a segment
        without one is CRC-checked on recovery, as the active segment is, so a crash before the call
        ran loses nothing that was synced and keeps no torn batch.
        """
        self._seal_txn_index(sync=False)
        stale = index_path(self.directory, self.base_offset)  # from a close() before a restart
        if os.path.exists(stale):
            os.unlink(stale)
            fsync_dir(self.directory)
        # Even if nothing is dirty: a periodic fsync may still be running, and the index must not be
        # written before it finished (the fsync on the duplicate waits for it).
        return DetachedSeal(self, self._detach(), self._index_bytes())

    def _seal_txn_index(self, *, sync: bool) -> None:
        if self.damage is None:
            self.txn_index.seal(self.next_offset, sync=sync)  # reopened if the segment is appended to again
        else:  # what lies past the damage was not re-derived: its seal claims no more than recovery gave it
            self.txn_index.close(sync=sync)

    def _index_bytes(self) -> bytes:
        return b"".join(_ENTRY.pack(*e) for e in zip(self._rel_offsets, self._positions, self._ts_before))

    def _write_index(self, raw: bytes) -> None:
        """Write the offset index file. Without space for it the segment goes on without one (recovery
        CRC-checks such a segment and writes it then): a full disk must not take the log offline."""
        path = index_path(self.directory, self.base_offset)
        try:
            with open(path, "wb") as f:
                f.write(raw)
                f.flush()
                os.fsync(f.fileno())
        except OSError as exc:
            if not is_disk_full(exc):
                raise
            os.unlink(path)  # a cut index would be trusted as far as it is consistent: none at all instead
            log.warning("%s: no space for its index file, left without one (recovery rebuilds it): %s",
                        self.path, exc)

    def close(self, *, sync: bool = True) -> None:
        """Release the files (after an fsync with ``sync``). The descriptors are closed even if that fsync
        fails (a log gone offline is closed this way): the error is raised after."""
        try:
            if self._file_fd >= 0 and sync:
                self.flush()
        finally:
            self._file_closed = True
            try:
                if self._file_fd >= 0:
                    os.close(self._file_fd)
                    self._file_fd = -1
                if self._open_files is not None:
                    self._open_files.closed(self)
            finally:
                if sync:
                    self._seal_txn_index(sync=True)
                else:
                    self.txn_index.close(sync=False)

    def delete(self) -> None:
        """Close without syncing and remove the log, offset index and transaction index files."""
        self.close(sync=False)  # going away: an fsync (say, right after a roll) would only cost time
        self.txn_index.delete()
        for path in (self.path, index_path(self.directory, self.base_offset)):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass

    # -- reading ---------------------------------------------------------------------------------

    @property
    def is_empty(self) -> bool:
        """Whether the log file holds no data."""
        return self.size == 0

    def largest_timestamp(self) -> int:
        """Largest batch timestamp, or the file's mtime when no batch carries one (as Kafka does)."""
        if self.max_timestamp >= 0:
            return self.max_timestamp
        return int(os.fstat(self._fd).st_mtime * 1000)

    def index_entries(self) -> list[tuple[int, int, int]]:
        """(relative offset, position, timestamp before) triples, for tests and tools."""
        return list(zip(self._rel_offsets, self._positions, self._ts_before))

    def find_position(self, offset: int) -> int | None:
        """File position of the first batch whose last offset is >= ``offset``, or None.

        Raises CorruptRecordError for an offset in the damaged part of the segment (see ``_locate``).
        """
        located = self._locate(offset)
        return None if located is None else located[0]

    def _locate(self, offset: int) -> tuple[int, int] | None:
        """(file position, base offset) of the first batch whose last offset is >= ``offset``, or None.

        The walk from the nearest index entry checks that each batch's base offset (outside its CRC)
        follows on from the entry's: one that does not, or a batch whose framing is broken, marks the
        segment damaged from there.
        """
        if offset >= self.next_offset:
            return None
        self._refuse_damaged(offset)
        i = bisect_right(self._rel_offsets, offset - self.base_offset) - 1
        pos, expected = 0, self.base_offset
        if i >= 0:
            pos, expected = self._positions[i], self.base_offset + self._rel_offsets[i]
        try:
            for pos, header in self._walk(pos, validate=False, chunk=_LOOKUP_CHUNK):
                if header.base_offset != expected:
                    raise CorruptRecordError(f"batch offset {header.base_offset} does not follow {expected}")
                bad = self.bad_batches.get(pos)
                end_offset = header.last_offset + 1 if bad is None else bad.end_offset  # its delta failed the CRC
                if end_offset > offset:
                    return pos, expected
                expected = end_offset
        except CorruptRecordError as exc:
            self._mark_damaged(pos if exc.position is None else exc.position, expected, exc.reason)
            self._refuse_damaged(offset)
        return None

    def _mark_damaged(self, position: int, offset: int, reason: str) -> None:
        if self.damage is not None and self.damage.position <= position:
            return
        self.damage = Damage(position, offset, reason)
        log.error("%s: damaged batch at offset %d (file position %d): %s; it and the rest of the segment are "
                  "not served", self.path, offset, position, reason)

    def _mark_bad_batch(self, position: int, offset: int, reason: str) -> bool:
        """Record the batch at ``position`` (expected to start at ``offset``), which failed its CRC check, as a
        BadBatch if its framing holds; False if it does not (nothing after it can be trusted then)."""
        head = os.pread(self._fd, HEADER_SIZE, position)
        if len(head) < HEADER_SIZE:
            return False
        header = parse_header(head)
        end = position + header.size
        if (header.base_offset != offset or header.magic != MAGIC or header.last_offset_delta < 0
                or not position + HEADER_SIZE <= end < self.size):
            return False  # the last batch of the segment has no follower to vouch for its length
        follower = os.pread(self._fd, HEADER_SIZE, end)
        if len(follower) < HEADER_SIZE:
            return False
        following = parse_header(follower)
        if (following.magic != MAGIC or following.base_offset != header.last_offset + 1
                or end + following.size > self.size):
            return False
        self.bad_batches[position] = BadBatch(position, end, offset, following.base_offset, reason)
        log.error("%s: damaged batch at offset %d (offsets %d-%d, file position %d): %s; it is not served, the "
                  "batches after it are", self.path, offset, offset, following.base_offset - 1, position, reason)
        return True

    def _first_bad_from(self, position: int) -> BadBatch | None:
        return min((b for b in self.bad_batches.values() if b.position >= position),
                   key=lambda b: b.position, default=None)

    def _refuse_damaged(self, offset: int) -> None:
        if self.damage is not None and offset >= self.damage.offset:
            raise CorruptRecordError(f"offset {offset} of {self.path} is in its damaged part, from offset "
                                     f"{self.damage.offset}: {self.damage.reason}")
        for bad in self.bad_batches.values():
            if bad.offset <= offset < bad.end_offset:
                raise CorruptRecordError(
                    f"offset {offset} of {self.path} is in a damaged batch (offsets {bad.offset}-"
                    f"{bad.end_offset - 1}): {bad.reason}; offset {bad.end_offset} on is served")

    def iter_headers(self, from_offset: int) -> Iterator[BatchHeader]:
        """Headers of the batches from the one holding ``from_offset`` to the end, or to the first damaged one
        (which marks the segment damaged there, as a read does)."""
        try:
            located = self._locate(from_offset)
        except CorruptRecordError:
            return  # ``from_offset`` lies in the damaged part
        if located is None:
            return
        pos, expected = located
        try:
            for pos, header in self._walk(pos, validate=False, chunk=_RECOVERY_CHUNK):
                if self.damage is not None and pos >= self.damage.position:
                    return
                if header.base_offset != expected:
                    raise CorruptRecordError(f"batch offset {header.base_offset} does not follow {expected}")
                bad = self.bad_batches.get(pos)
                if bad is not None:  # its header failed the CRC: not to be trusted
                    expected = bad.end_offset
                    continue
                yield header
                expected = header.last_offset + 1
        except CorruptRecordError as exc:
            self._mark_damaged(pos if exc.position is None else exc.position, expected, exc.reason)

    def read(self, offset: int, max_bytes: int, upper_offset: int | None = None, *, min_one: bool = True) -> bytes:
        """Whole batches from the one holding ``offset``, only those with base offset below ``upper_offset``,
        at most ``max_bytes`` of them, except that with ``min_one`` a first batch larger than that is
        returned whole (Kafka's fetch semantics)."""
        return self.read_chunk(offset, max_bytes, upper_offset, min_one=min_one)[0]

    def read_chunk(
        self, offset: int, max_bytes: int, upper_offset: int | None = None, *, min_one: bool = True
    ) -> tuple[bytes, bool, int]:
        """Like read(), plus whether the read stopped only because the segment (or ``upper_offset``) ended,
        and the offset after the last returned batch (``offset`` when none is returned).

        Batch boundaries come from the sparse index: only the batches within one index interval of
        the cut are walked, so the cost does not grow with the number of (small) batches returned.
        Batches not read before are CRC-checked; the read stops before a damaged one (not complete),
        and raises CorruptRecordError if that is the first batch asked for.
        """
        located = self._locate(offset)
        if located is None:
            return b"", True, offset
        pos, base = located
        data, complete, end_offset = self._read_batches(pos, max_bytes, upper_offset, min_one=min_one)
        if not data:
            return data, complete, offset
        good, cut_offset = self._check(pos, base, data)
        if good < len(data):
            self._refuse_damaged(offset)  # the batch asked for is the damaged one
            return data[:good], False, cut_offset
        return data, complete, end_offset

    def _read_batches(self, pos: int, max_bytes: int, upper_offset: int | None, *, min_one: bool
                      ) -> tuple[bytes, bool, int]:
        """read_chunk's bytes from the batch at ``pos``, unchecked, up to the damage or a bad batch if any
        (not complete then: stopped by it, not by the segment's end)."""
        end, end_offset, whole = self.size, self.next_offset, True
        if self.damage is not None:
            end, end_offset, whole = self.damage.position, self.damage.offset, False
        bad = self._first_bad_from(pos)
        if bad is not None and bad.position < end:
            end, end_offset, whole = bad.position, bad.offset, False
        if upper_offset is not None and upper_offset < end_offset:
            end, end_offset = self._first_batch_from(upper_offset)
            whole = True  # stopped by the upper offset, which lies before any damage
            if end <= pos:
                return b"", True, end_offset
        if end - pos <= max_bytes:
            return os.pread(self._fd, end - pos, pos), whole, end_offset
        cut, cut_offset = self._last_boundary_within(pos, pos + max_bytes)
        if cut > pos:
            return os.pread(self._fd, cut - pos, pos), False, cut_offset
        if not min_one:
            return b"", False, end_offset
        # The first batch alone exceeds max_bytes: it is returned whole (KIP-74). A damaged length is
        # kept within the file, and the check finds the batch damaged.
        size = LOG_OVERHEAD + _PREFIX.unpack(os.pread(self._fd, LOG_OVERHEAD, pos))[1]
        data = os.pread(self._fd, max(HEADER_SIZE, min(size, self.size - pos)), pos)
        return data, whole and pos + size >= end, _next_offset(data, 0)

    def _check(self, pos: int, base: int, data: bytes) -> tuple[int, int]:
        """How many leading bytes of ``data`` (read at ``pos``, starting with the batch with base offset
        ``base``) hold intact batches, and the offset after them: CRC-checks those not checked before and
        marks the first damaged one (a BadBatch if only its CRC fails, else the segment's damage)."""
        at, expected, end = pos, base, pos + len(data)
        while at < end:
            checked_end = self._checked.end_of(at)
            if checked_end is not None and checked_end >= end:
                break
            try:
                header = validate_batch(data, at - pos)
                if header.base_offset != expected:
                    raise CorruptRecordError(f"batch offset {header.base_offset} does not follow {expected}")
            except CorruptRecordError as exc:
                if at not in self.bad_batches and not self._mark_bad_batch(at, expected, exc.reason):
                    self._mark_damaged(at, expected, exc.reason)
                return at - pos, expected
            self._checked.add(at, at + header.size)
            expected = header.last_offset + 1
            at += header.size
        return len(data), -1  # the caller knows the offset after the whole of ``data``

    def _first_batch_from(self, offset: int) -> tuple[int, int]:
        """(file position, base offset) of the first batch whose base offset is >= ``offset`` (< next_offset)."""
        pos = self.find_position(offset)
        header = os.pread(self._fd, HEADER_SIZE, pos)
        base = _PREFIX.unpack_from(header)[0]
        if base >= offset:
            return pos, base
        # ``offset`` lies inside this batch: the boundary is the next one.
        return pos + LOG_OVERHEAD + _PREFIX.unpack_from(header)[1], _next_offset(header, 0)

    def _last_boundary_within(self, pos: int, limit: int) -> tuple[int, int]:
        """(position, base offset) of the last batch start in (pos, limit], or (pos, -1) if there is none.

        ``pos`` is a batch start and ``limit`` lies before the end of the segment.
        """
        i = bisect_right(self._positions, limit) - 1
        start = self._positions[i] if i >= 0 and self._positions[i] > pos else pos
        chunk = os.pread(self._fd, limit - start + LOG_OVERHEAD, start)  # up to the prefix of a batch at limit
        found = (pos, -1)
        at = start
        while at - start + LOG_OVERHEAD <= len(chunk):
            base, length = _PREFIX.unpack_from(chunk, at - start)
            if at > pos:
                found = (at, base)
            at += LOG_OVERHEAD + length
            if at > limit:
                break
        return found

    def find_timestamp(self, timestamp: int) -> tuple[int, int] | None:
        """(offset, timestamp) of the first record with a timestamp >= ``timestamp``, or None.

        Records of compressed batches are not decoded: such a batch answers with its base offset and
        max timestamp, which is at or before the exact record (consumers may see a few older records).
        """
        if self.max_timestamp < timestamp:
            return None
        i = bisect_left(self._ts_before, timestamp) - 1
        start = self._positions[i] if i >= 0 else 0
        for pos, header in self._walk(start, validate=False, chunk=_LOOKUP_CHUNK):
            if header.max_timestamp < timestamp:
                continue
            batch = os.pread(self._fd, header.size, pos)
            try:
                for offset, ts in iter_record_timestamps(batch):
                    if ts >= timestamp:
                        return offset, ts
            except ValueError:
                return header.base_offset, header.max_timestamp
        return None


class DetachedSync:
    """An fsync of a segment on a duplicate of its descriptor, and of its transaction index if that was
    dirty (``index_sync``): call it once, in any thread, or discard it."""

    def __init__(self, segment: Segment, fd: int, index_sync: Callable[[], None] | None) -> None:
        self._segment = segment
        self._fd = fd
        self._index_sync = index_sync

    def __call__(self) -> None:
        try:
            self._segment._sync(self._fd)
            self._segment._detached_sync = False  # at most one is handed out per segment at a time
            if self._index_sync is not None:
                self._index_sync()
        finally:
            self.discard()

    def discard(self) -> None:
        """Release the duplicate descriptor (a deleted segment's disk space is freed only then)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class DetachedSeal:
    """The seal of a rolled segment left to another thread: fsync its log and transaction index, then write
    its index file."""

    def __init__(self, segment: Segment, sync: DetachedSync, index: bytes) -> None:
        self._segment = segment
        self._sync = sync
        self._index = index

    def __call__(self) -> None:
        self._sync()  # the log, then the transaction index
        self._segment._write_index(self._index)

    def discard(self) -> None:
        """Give up the seal without running it: release its duplicate descriptor."""
        self._sync.discard()
