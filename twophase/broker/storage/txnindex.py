"""The aborted-transactions index of one segment: ``<base>.txnindex``, like Kafka's transaction index.

One entry per aborted transaction whose ABORT marker lies in the segment, in marker-offset order. Each
entry is 34 bytes, Kafka's layout: version i16 (0), producer id i64, first offset i64 (the transaction's
first batch), last offset i64 (the marker) and last stable offset i64 (the partition's LSO right after
the marker). A read_committed fetch of [start, end) needs the aborted transactions overlapping it: those
with last >= start and first < end. They are found from the segment holding ``start`` onwards, stopping
at the first entry whose LSO is >= end: every later transaction began at or after that LSO.

Entries are appended when a marker is written and fsynced when the segment is sealed or closed; the
partition log re-derives entries after its newest producer snapshot by replaying the log, so a torn or
missing tail is repaired on open (``load`` reports how far the file can be trusted).

Example::

    index = TransactionIndex.load(directory, base_offset=0, next_offset=120)
    index.append(AbortedTxn(producer_id=7, first_offset=3, last_offset=42, last_stable_offset=43))
    found: list[tuple[int, int]] = []
    complete = index.collect(start=0, end=50, out=found)   # found == [(7, 3)]
    index.flush(); index.close()
"""

from __future__ import annotations

import logging
import os
import struct
from array import array
from bisect import bisect_left
from dataclasses import dataclass

from twophase.durable import atomic_write, unlink_quietly

log = logging.getLogger(__name__)

ENTRY = struct.Struct(">hqqqq")
VERSION = 0
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
    """Aborted transactions of one segment, held in memory and mirrored in its file."""

    def __init__(self, path: str, base_offset: int) -> None:
        self.path = path
        self.base_offset = base_offset
        self.trusted_until = base_offset  # entries for markers below this offset are known complete
        self._producer_ids = array("q")
        self._first = array("q")
        self._last = array("q")
        self._lso = array("q")
        self._fd = -1
        self._dirty = False
        self._file_matches = False  # whether the file holds exactly the entries in memory

    @classmethod
    def create(cls, directory: str, base_offset: int) -> TransactionIndex:
        """A new, empty index file for a new segment (the caller fsyncs the directory)."""
        index = cls(txn_index_path(directory, base_offset), base_offset)
        with open(index.path, "wb"):
            pass
        index._file_matches = True
        return index

    @classmethod
    def load(cls, directory: str, base_offset: int, next_offset: int) -> TransactionIndex:
        """Read the index of the segment holding offsets [base_offset, next_offset).

        ``trusted_until`` tells how far the result is complete: ``next_offset`` for an intact file or one
        with entries beyond the log end (dropped), the offset after the last whole entry for a torn tail
        (dropped), ``base_offset`` for a missing or inconsistent file (no entries kept). The caller
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
        whole = len(raw) - len(raw) % ENTRY.size
        prev_last = base_offset - 1
        for version, pid, first, last, lso in ENTRY.iter_unpack(raw[:whole]):
            if last >= next_offset and last > prev_last:
                # Written in marker order, so everything before is complete: the log lost its tail.
                log.warning("%s: dropping entries beyond the log end %d", index.path, next_offset)
                index.trusted_until = next_offset
                return index
            if version != VERSION or last <= prev_last or first > last or pid < 0:
                log.warning("%s: inconsistent entry for marker offset %d, will be rebuilt from the log",
                            index.path, last)
                index._clear()
                return index
            index._add(AbortedTxn(pid, first, last, lso))
            prev_last = last
        if whole < len(raw):
            log.warning("%s: dropping a torn tail of %d bytes", index.path, len(raw) - whole)
            index.trusted_until = prev_last + 1 if len(index) else base_offset
        else:
            index.trusted_until = next_offset
            index._file_matches = True
        return index

    # -- queries -----------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._last)

    @property
    def dirty(self) -> bool:
        """Whether entries were appended since the last fsync."""
        return self._dirty

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
        if self._fd < 0:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        data = ENTRY.pack(VERSION, txn.producer_id, txn.first_offset, txn.last_offset, txn.last_stable_offset)
        if os.write(self._fd, data) != len(data):
            raise OSError(f"short write to {self.path}")
        self._dirty = True
        self._add(txn)

    def truncate_from(self, offset: int) -> None:
        """Drop entries whose marker is at or after ``offset``; rewrites the file (atomically) if it differs."""
        keep = bisect_left(self._last, offset)
        if keep == len(self) and self._file_matches:
            return
        kept = self.entries()[:keep]
        self.close()
        self._clear()
        atomic_write(self.path, b"".join(
            ENTRY.pack(VERSION, t.producer_id, t.first_offset, t.last_offset, t.last_stable_offset) for t in kept))
        for txn in kept:
            self._add(txn)
        self._file_matches = True

    def flush(self) -> None:
        """fdatasync the entries appended since the last flush, if any."""
        if self._dirty:
            _fdatasync(self._fd)
            self._dirty = False

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

    def _add(self, txn: AbortedTxn) -> None:
        self._producer_ids.append(txn.producer_id)
        self._first.append(txn.first_offset)
        self._last.append(txn.last_offset)
        self._lso.append(txn.last_stable_offset)

    def _clear(self) -> None:
        for column in (self._producer_ids, self._first, self._last, self._lso):
            del column[:]
