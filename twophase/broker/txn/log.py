"""The durable transaction log: one record per change of a transactional id's state.

Each record is ``length (u32) | crc32 (u32) | JSON`` with the JSON ``{"id": ..., "txn": {...}}``
(``"txn": null`` is a tombstone: the id expired). Every append is fsynced before the coordinator
acts on it, except a lazy one (``sync=False``), which the next fsynced append, a group commit
(twophase.broker.group_commit: ``begin_fsync``, in a worker thread, one fsync for every lazy record
written before it), or close makes durable with it: a record whose loss recovery repairs, such as
CompleteCommit after its PrepareCommit, or one the broker awaits before acting on it, such as
AddPartitionsToTxn's before the partitions take the transaction's data. A record over
MAX_RECORD_BYTES is refused before anything is written. On open the file
is replayed, the last record of each id wins; a torn tail (a crash mid-write: an unreadable record
with no intact one after it) is truncated with a warning. An unreadable record followed by intact
ones is damage, not a crash: opening fails rather than drop them. When the file holds many more
records than live ids it is rewritten atomically with one record per live id, so expired ids vanish.

A failed write (a full disk, an I/O error) fails the log for good: ``failed`` is set and every
later append raises, like a Kafka log directory going offline, because what reached the file is
unknown (a record may be there without its fsync). Restarting replays what is.

Example::

    log = TransactionLog("/data/transactions")
    states = log.open()                     # {transactional id: dict}
    log.append("app-1", {...}); log.append("app-1", None)
    log.close()
"""

from __future__ import annotations

import json
import logging
import os
import struct
import zlib
from collections.abc import Callable

from twophase.durable import atomic_write, fsync_dir
from twophase.wire.errors import KafkaError

log = logging.getLogger("twophase.broker.txn")

LOG_FILE = "transactions.log"
_HEAD = struct.Struct(">II")
_PAYLOAD_START = b'{"id":'  # every payload begins so (json.dumps escapes quotes inside strings)
_fsync = os.fsync  # module-level, for tests to hold or fail the fsyncs of appends
MAX_RECORD_BYTES = 16 << 20  # the largest payload append writes
COMPACT_MIN_RECORDS = 1000


def encode_record(transactional_id: str, value: dict | None) -> bytes:
    """One transaction-log record: length, CRC-32 and the JSON of (id, metadata dict or None for a removed id)."""
    payload = json.dumps({"id": transactional_id, "txn": value}, separators=(",", ":")).encode()
    return _HEAD.pack(len(payload), zlib.crc32(payload)) + payload


def _decode_record(data: bytes, pos: int) -> tuple[str, dict | None, int] | None:
    """(transactional id, value, end position) of the intact record at ``pos``, else None."""
    if pos < 0 or pos + _HEAD.size > len(data):
        return None
    length, crc = _HEAD.unpack_from(data, pos)
    end = pos + _HEAD.size + length
    if end > len(data):
        return None
    payload = data[pos + _HEAD.size:end]
    if zlib.crc32(payload) != crc:
        return None
    try:
        record = json.loads(payload)
        return record["id"], record["txn"], end
    except (ValueError, KeyError, TypeError):
        return None


def _intact_record_after(data: bytes, pos: int) -> int | None:
    """The position of an intact record starting after ``pos``, if any."""
    found = data.find(_PAYLOAD_START, pos + 1 + _HEAD.size)
    while found != -1:
        if _decode_record(data, found - _HEAD.size) is not None:
            return found - _HEAD.size
        found = data.find(_PAYLOAD_START, found + 1)
    return None


class TransactionLogFailed(KafkaError):
    """The transaction log cannot be written: transactional requests get COORDINATOR_NOT_AVAILABLE."""

    code = 15


class TransactionRecordTooLarge(KafkaError):
    """A record over MAX_RECORD_BYTES, refused before anything is written (the log stays usable).
    Kafka answers UNKNOWN_SERVER_ERROR when its transaction log refuses a record as too large."""


class TransactionLogCorrupt(RuntimeError):
    """An unreadable record with intact ones after it: damage that a crash cannot cause."""


class TransactionLog:
    """Append-only, fsynced, CRC-checked records of transaction metadata (dicts) per transactional id."""

    def __init__(self, directory: str, *, compact_min_records: int = COMPACT_MIN_RECORDS) -> None:
        self.directory = directory
        self.path = os.path.join(directory, LOG_FILE)
        self.compact_min_records = compact_min_records
        self._latest: dict[str, dict] = {}
        self._records = 0
        self._file = None
        self._appended = 0  # records appended since open (lazy or not) ...
        self._synced = 0  # ... and how many of them are fsynced
        self.failed: Exception | None = None

    def open(self) -> dict[str, dict]:
        """Replay the file (truncating a bad tail) and open it for appends; the live records."""
        os.makedirs(self.directory, exist_ok=True)
        try:
            with open(self.path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            data = b""
        good = self._replay(data)
        if good < len(data):
            log.warning("%s: truncating %d bytes of torn or corrupt records at byte %d",
                        self.path, len(data) - good, good)
            with open(self.path, "r+b") as f:
                f.truncate(good)
                os.fsync(f.fileno())
        created = not os.path.exists(self.path)
        self._file = open(self.path, "ab", buffering=0)
        if created:
            fsync_dir(self.directory)
        return dict(self._latest)

    def _replay(self, data: bytes) -> int:
        """Apply every intact record; the byte position after the last one, where only a torn tail
        may follow. A record is intact when its CRC matches, whatever its length: an older version
        wrote records over MAX_RECORD_BYTES, and they are kept."""
        pos = 0
        while (record := _decode_record(data, pos)) is not None:
            transactional_id, value, pos = record
            self._apply(transactional_id, value)
        if pos < len(data) and (later := _intact_record_after(data, pos)) is not None:
            raise TransactionLogCorrupt(
                f"{self.path}: unreadable record at byte {pos}, but an intact one at byte {later}: "
                "refusing to truncate the log (restore it, or cut the damaged record out by hand)")
        return pos

    def _apply(self, transactional_id: str, value: dict | None) -> None:
        self._records += 1
        if value is None:
            self._latest.pop(transactional_id, None)
        else:
            self._latest[transactional_id] = value

    def append(self, transactional_id: str, value: dict | None, *, sync: bool = True) -> None:
        """Durably record ``value`` (None: forget the id) before returning; with ``sync=False`` only
        write it, for the next fsynced append (or close) to cover. An fsync takes ~0.3 ms, tens of
        ms on a busy disk, on the event loop; a lost Complete* record is redone from its Prepare*."""
        if self._file is None:
            raise RuntimeError("transaction log is not open")
        if self.failed is not None:
            raise TransactionLogFailed(f"{self.path} failed earlier: {self.failed}")
        record = encode_record(transactional_id, value)
        if len(record) - _HEAD.size > MAX_RECORD_BYTES:
            raise TransactionRecordTooLarge(f"{self.path}: a record of {len(record)} bytes for transactional id "
                                            f"{transactional_id!r} exceeds {MAX_RECORD_BYTES}")
        try:
            _write_all(self._file, record)
            if sync:
                _fsync(self._file.fileno())
            self._appended += 1
            if sync:
                self._synced = self._appended
            self._apply(transactional_id, value)
            if self._records > max(self.compact_min_records, 2 * len(self._latest)):
                self.compact()
        except OSError as exc:
            self.failed = exc
            log.error("%s: write failed, transactions are unavailable until the broker restarts: %s", self.path, exc)
            raise TransactionLogFailed(f"{self.path}: {exc}") from exc

    def compact(self) -> None:
        """Rewrite the file with one record per live id (atomically: old or new file, never torn)."""
        data = b"".join(encode_record(tid, value) for tid, value in self._latest.items())
        self._file.close()
        atomic_write(self.path, data)
        self._synced = self._appended
        self._file = open(self.path, "ab", buffering=0)
        log.info("compacted %s: %d records -> %d live transactional ids", self.path, self._records, len(self._latest))
        self._records = len(self._latest)

    # -- group commit (twophase.broker.group_commit) of lazy appends, in a worker thread ----------

    @property
    def high_watermark(self) -> int:
        """How many of the records appended since open are fsynced."""
        return self._synced

    @property
    def log_end_offset(self) -> int:
        """How many records were appended since open: ``group_commit.durable(log, log.log_end_offset, ...)``
        returns once every one of them is fsynced."""
        return self._appended

    def begin_fsync(self) -> tuple[int, Callable[[], None]] | None:
        """(end, sync) where ``sync`` fsyncs the records below ``end`` and may run in any thread; None if
        they are fsynced already. Report success with ``fsync_done(end)``, a failure with ``flush_failed``."""
        if self.failed is not None:
            raise TransactionLogFailed(f"{self.path} failed earlier: {self.failed}")
        if self._file is None or self._synced >= self._appended:  # closed: close() synced what it could
            return None
        end, fd = self._appended, os.dup(self._file.fileno())  # its own descriptor: compact() may close the file

        def sync() -> None:
            try:
                _fsync(fd)
            finally:
                os.close(fd)

        return end, sync

    def fsync_done(self, end: int) -> None:
        """A sync from ``begin_fsync`` finished: the records below ``end`` are durable."""
        self._synced = max(self._synced, end)

    def flush(self) -> None:
        """Fsync every record on the calling thread (group commit's fallback when no descriptor is left)."""
        try:
            _fsync(self._file.fileno())
        except OSError as exc:
            self.flush_failed(exc)
            raise TransactionLogFailed(f"{self.path}: {exc}") from exc
        self._synced = self._appended

    def flush_failed(self, exc: Exception) -> None:
        """An fsync failed: what reached the file is unknown, so the log fails for good (see above)."""
        self.failed = exc
        log.error("%s: fsync failed, transactions are unavailable until the broker restarts: %s", self.path, exc)

    def close(self) -> None:
        """Fsync a lazy append still unsynced, and close the file."""
        if self._file is not None:
            file, self._file = self._file, None
            try:
                if self._synced < self._appended and self.failed is None:
                    _fsync(file.fileno())
                    self._synced = self._appended
                file.close()
            except OSError as exc:  # nothing is buffered; a lost lazy record is redone by recovery or took no data
                log.warning("%s: close failed: %s", self.path, exc)


def _write_all(file, data: bytes) -> None:
    """Write ``data`` to an unbuffered file: nothing a refused record wrote lingers in a buffer, to be
    flushed later behind the caller's back."""
    view = memoryview(data)
    while view:
        view = view[file.write(view):]
