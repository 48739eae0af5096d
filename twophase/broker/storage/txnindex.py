"""The aborted-transactions index of one segment: ``<base>.txnindex``, like Kafka's transaction index.

One entry per aborted transaction whose ABORT marker lies in the segment, in marker-offset order. Each
entry is 34 bytes, Kafka's layout: version i16 (0), producer id i64, first offset i64 (the transaction's
first batch), last offset i64 (the marker) and last stable offset i64 (the partition's LSO right after
the marker). A read_committed fetch of [start, end) needs the aborted transactions overlapping it: those
with last >= start and first < end. They are found from the segment holding ``start`` onwards, stopping
at the first entry whose LSO is >= end: every later transaction began at or after that LSO.

Unlike Kafka's, the file ends with a 34-byte seal record: version -1, the entry count, the offset below
which the index holds every aborted transaction of the segment (the segment's end once it is sealed,
the last marker's offset + 1 while it is active), the CRC-32C of the entries, and 0. Each append writes
its entry and a new seal in one write, so every file this code leaves behind is sealed. An empty, cut,
flipped or unsealed file (one from before seals) does not match its seal: ``load`` reports it as
trusting nothing, and the partition log rebuilds it by replaying the log. Without the seal an empty
file would pass for "no aborted transactions here", and read_committed readers would see aborted data.

Entries are appended just before their ABORT marker is written and fsynced with it (the segment's
flush, or a detached fsync of it); the partition log re-derives entries after its newest producer snapshot by replaying the log, so a torn or
missing tail is repaired on open (``load`` reports how far the file can be trusted).

Example::

    index = TransactionIndex.load(directory, base_offset=0, next_offset=120)
    index.append(AbortedTxn(producer_id=7, first_offset=3, last_offset=42, last_stable_offset=43))
    found: list[tuple[int, int]] = []
    complete = index.collect(start=0, end=50, out=found)   # found == [(7, 3)]
    index.seal(end_offset=120)                             # fsynced and released
"""

from __future__ import annotations

import errno
import logging
import os
import struct
from array import array
from bisect import bisect_left
from collections.abc import Callable
from dataclasses import dataclass

import crc32c

from twophase.durable import atomic_write, unlink_quietly

log = logging.getLogger(__name__)

ENTRY = struct.Struct(">hqqqq")
VERSION = 0
SEAL_VERSION = -1  # the last record: (SEAL_VERSION, entry count, complete-below offset, CRC-32C of the entries, 0)
SUFFIX = ".txnindex"

_fdatasync = getattr(os, "fdatasync", os.fsync)


def txn_index_path(directory: str, base_offset: int) -> str:
    """The path of the transaction index of the segment starting at ``base_offset``."""
    return os.path.join(directory, f"{base_offset:020d}{SUFFIX}")


@dataclass(frozen=True)
class AbortedTxn:
    """One aborted transaction of a segment: producer id, first offset, ABORT marker offset and the LSO after it."""
    producer_id: int
    first_offset: int
    last_offset: int  # offset of the ABORT marker
    last_stable_offset: int  # the partition's LSO right after the marker


class TransactionIndex:
    """Aborted transactions of one segment, held in memory and mirrored in its sealed file."""

    def __init__(self, path: str, base_offset: int) -> None:
        self.path = path
        self.base_offset = base_offset
        self.trusted_until = base_offset  # every aborted transaction with its marker below this is here
        self._producer_ids = array("q")
        self._first = array("q")
        self._last = array("q")
        self._lso = array("q")
        self._crc = 0  # CRC-32C of the entries' bytes, for the seal
        self._fd = -1
        self._dirty = False  # written since the last fsync started
        self._detached_sync = False  # an fsync was handed to another thread (detach_sync), not yet succeeded
        self._file_matches = False  # whether the file holds exactly the entries in memory and their seal

    @classmethod
    def create(cls, directory: str, base_offset: int) -> TransactionIndex:
        """A new index file for a new segment, holding only its seal (the caller fsyncs the directory)."""
        index = cls(txn_index_path(directory, base_offset), base_offset)
        with open(index.path, "wb") as f:
            f.write(index._seal_record())
        index._file_matches = True
        return index

    @classmethod
    def load(cls, directory: str, base_offset: int, next_offset: int) -> TransactionIndex:
        """Read the index of the segment holding offsets [base_offset, next_offset), checked against its seal.

        ``trusted_until`` tells how far the result is complete: the seal's offset for an intact file,
        ``next_offset`` for one with entries beyond the log end (dropped), ``base_offset`` (no entries
        kept) for a missing file or one that does not match its seal or its segment. The caller
        re-derives entries from there.
        """
        index = cls(txn_index_path(directory, base_offset), base_offset)
        try:
            with open(index.path, "rb") as f:
                raw = f.read()
        except FileNotFoundError:
            if next_offset > base_offset:
                log.warning("%s: missing, will be rebuilt from the log", index.path)
            return index
        problem = index._read(raw, next_offset)
        if problem is not None:
            log.warning("%s: %s; will be rebuilt from the log", index.path, problem)
            index._clear()
            index.trusted_until = base_offset
        return index

    def _read(self, raw: bytes, next_offset: int) -> str | None:
        """Load ``raw`` into this index; returns what is wrong with it, None if it can be used."""
        if not raw or len(raw) % ENTRY.size:
            return f"{len(raw)} bytes, not whole entries and a seal (cut or emptied)"
        version, count, sealed_until, crc, _ = ENTRY.unpack_from(raw, len(raw) - ENTRY.size)
        entries = raw[: -ENTRY.size]
        if version != SEAL_VERSION:
            return "no seal record (damaged, or written before indexes were sealed)"
        if count != len(entries) // ENTRY.size or crc != crc32c.crc32c(entries):
            return f"does not match its seal ({count} entries, CRC {crc:#010x})"
        prev_last = self.base_offset - 1
        for version, pid, first, last, lso in ENTRY.iter_unpack(entries):
            if version != VERSION or last <= prev_last or first > last or pid < 0 or last >= sealed_until:
                return f"inconsistent entry for marker offset {last}"
            if last >= next_offset:
                # Written in marker order, so everything before is complete: the log lost its tail.
                log.warning("%s: dropping entries beyond the log end %d", self.path, next_offset)
                self.trusted_until = next_offset
                self._crc = crc32c.crc32c(entries[: len(self) * ENTRY.size])
                return None
            self._add(AbortedTxn(pid, first, last, lso))
            prev_last = last
        self.trusted_until = min(sealed_until, next_offset)
        self._crc = crc
        self._file_matches = sealed_until <= next_offset
        return None

    # -- queries -----------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._last)

    @property
    def dirty(self) -> bool:
        """Whether something written to the file may not be fsynced yet."""
        return self._dirty or self._detached_sync

    @property
    def last_marker(self) -> int:
        """Offset of the newest ABORT marker here, -1 if none."""
        return self._last[-1] if len(self._last) else -1

    def entries(self) -> list[AbortedTxn]:
        """Every entry, in marker-offset order."""
        return [AbortedTxn(*e) for e in zip(self._producer_ids, self._first, self._last, self._lso)]

    def collect(self, start: int, end: int, out: list[tuple[int, int]]) -> bool:
        """Append (producer id, first offset) of entries overlapping [start, end) to ``out``.

        Returns True when no later segment can hold an overlapping transaction.
        """
        first, lso = self._first, self._lso
        for i in range(bisect_left(self._last, start), len(self._last)):
            if first[i] < end:
                out.append((self._producer_ids[i], first[i]))
            if lso[i] >= end:
                return True
        return False

    # -- changes -----------------------------------------------------------------------------------

    def append(self, txn: AbortedTxn) -> None:
        """Record an aborted transaction whose marker follows every entry already here."""
        if len(self) and txn.last_offset <= self._last[-1]:
            raise ValueError(f"marker offset {txn.last_offset} does not follow {self._last[-1]}")
        entry = ENTRY.pack(VERSION, txn.producer_id, txn.first_offset, txn.last_offset, txn.last_stable_offset)
        crc = crc32c.crc32c(entry, self._crc)
        # The entry and the seal that covers it in one write: a killed process leaves the old or the new file.
        data = entry + ENTRY.pack(SEAL_VERSION, len(self) + 1, txn.last_offset + 1, crc, 0)
        self._write(data)
        self._add(txn)
        self._crc = crc
        self.trusted_until = txn.last_offset + 1

    def drop_last(self, count: int, *, crc: int, trusted_until: int) -> None:
        """Undo the last ``count`` appends (their markers were not written), back to the CRC and
        ``trusted_until`` they found. The seal goes back where it was: that needs no new space."""
        if not count and self._file_matches:
            return  # nothing was written
        if count:
            for column in (self._producer_ids, self._first, self._last, self._lso):
                del column[-count:]
        self._crc = crc
        self.trusted_until = trusted_until
        try:
            self._write(self._seal_record())
        except OSError as exc:  # the next write puts the seal back; until then a restart rebuilds the file
            log.warning("%s: putting its seal back failed, rewritten on the next write: %s", self.path, exc)

    @property
    def checkpoint(self) -> tuple[int, int]:
        """(CRC, trusted_until) now: what ``drop_last`` needs to undo the appends that follow."""
        return self._crc, self.trusted_until

    def seal(self, end_offset: int, *, sync: bool = True) -> None:
        """The segment ends at ``end_offset`` (it is sealed or closed): say so in the seal, fsync (with
        ``sync``; else it stays dirty, for ``detach_sync`` or ``flush``) and release the file."""
        try:
            if self.trusted_until != end_offset or not self._file_matches:
                self.trusted_until = end_offset
                self._write(self._seal_record())
        finally:
            self.close(sync=sync)

    def detach_sync(self) -> Callable[[], None] | None:
        """An fsync of everything written so far, to call once in any thread; None if nothing is unsynced.

        It opens the file on a descriptor of its own, so closing the index meanwhile does no harm. Until
        it has succeeded, ``flush()`` fsyncs again rather than trust it.
        """
        if not self._dirty:
            return None
        self._dirty = False
        self._detached_sync = True
        return self._run_detached_sync

    def _run_detached_sync(self) -> None:
        self._sync_by_path()
        self._detached_sync = False  # at most one is handed out at a time (as for a segment's log)

    def _sync_by_path(self) -> None:
        fd = os.open(self.path, os.O_RDONLY)
        try:
            _fdatasync(fd)
        finally:
            os.close(fd)

    def truncate_from(self, offset: int) -> None:
        """Drop entries whose marker is at or after ``offset``; rewrites the file (atomically) if it differs."""
        keep = bisect_left(self._last, offset)
        if keep == len(self) and self._file_matches:
            return
        kept = self.entries()[:keep]
        self.close()
        self._clear()
        for txn in kept:
            self._add(txn)
        self.trusted_until = max(self.base_offset, min(self.trusted_until, offset))
        entries = b"".join(
            ENTRY.pack(VERSION, t.producer_id, t.first_offset, t.last_offset, t.last_stable_offset) for t in kept)
        self._crc = crc32c.crc32c(entries)
        atomic_write(self.path, entries + self._seal_record())
        self._file_matches = True

    def flush(self) -> None:
        """fdatasync what was written since the last fsync (again if a detached one has not succeeded)."""
        if self._dirty or self._detached_sync:
            if self._fd >= 0:
                _fdatasync(self._fd)
            else:  # closed unsynced by seal(sync=False), its detached fsync not run yet
                self._sync_by_path()
            self._dirty = self._detached_sync = False

    def close(self, *, sync: bool = True) -> None:
        """Fsync (with ``sync``) and release the file; it is released even if the fsync fails."""
        if self._fd >= 0:
            try:
                if sync:
                    self.flush()
            finally:
                os.close(self._fd)
                self._fd = -1

    def delete(self) -> None:
        """Close the index without syncing it and remove its file (its segment is deleted)."""
        self.close(sync=False)  # going away
        unlink_quietly(self.path)

    def _seal_record(self) -> bytes:
        return ENTRY.pack(SEAL_VERSION, len(self), self.trusted_until, self._crc, 0)

    def _write(self, data: bytes) -> None:
        """Write ``data`` over the seal (at the end of the entries): the file then ends with ``data``."""
        if self._fd < 0:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o644)
        at = len(self) * ENTRY.size
        self._file_matches = False  # until the write is whole
        if os.pwrite(self._fd, data, at) != len(data):
            # A regular file takes fewer bytes than given only when the disk (or quota) is full.
            raise OSError(errno.ENOSPC, f"short write to {self.path}")
        os.ftruncate(self._fd, at + len(data))  # nothing of a longer file may follow the seal
        self._dirty = True
        self._file_matches = True

    def _add(self, txn: AbortedTxn) -> None:
        self._producer_ids.append(txn.producer_id)
        self._first.append(txn.first_offset)
        self._last.append(txn.last_offset)
        self._lso.append(txn.last_stable_offset)

    def _clear(self) -> None:
        for column in (self._producer_ids, self._first, self._last, self._lso):
            del column[:]
        self._crc = 0
