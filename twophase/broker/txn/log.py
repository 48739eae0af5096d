"""The durable transaction log: one record per change of a transactional id's state.

Each record is ``length (u32) | crc32 (u32) | JSON`` with the JSON ``{"id": ..., "txn": {...}}``
(``"txn": null`` is a tombstone: the id expired). Every append is fsynced before the coordinator
acts on it. On open the file is replayed, the last record of each id wins; a torn or corrupt
tail (a crash mid-write) is truncated with a warning. When the file holds many more records than
live ids it is rewritten atomically with one record per live id, so expired ids vanish.

A failed write (a full disk, an I/O error) fails the log for good: ``failed`` is set and every
later append raises, like a Kafka log directory going offline, because the coordinator's memory may
already be ahead of what is durable. Restarting replays what is.

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

from twophase.broker.storage.errors import KafkaError
from twophase.durable import atomic_write, fsync_dir

log = logging.getLogger("twophase.broker.txn")

LOG_FILE = "transactions.log"
_HEAD = struct.Struct(">II")
MAX_RECORD_BYTES = 16 << 20  # a length beyond this is garbage, not a record
COMPACT_MIN_RECORDS = 1000


def encode_record(transactional_id: str, value: dict | None) -> bytes:
    payload = json.dumps({"id": transactional_id, "txn": value}, separators=(",", ":")).encode()
    return _HEAD.pack(len(payload), zlib.crc32(payload)) + payload


class TransactionLogFailed(KafkaError):
    """The transaction log cannot be written: transactional requests get COORDINATOR_NOT_AVAILABLE."""

    code = 15


class TransactionLog:
    """Append-only, fsynced, CRC-checked records of transaction metadata (dicts) per transactional id."""

    def __init__(self, directory: str, *, compact_min_records: int = COMPACT_MIN_RECORDS) -> None:
        self.directory = directory
        self.path = os.path.join(directory, LOG_FILE)
        self.compact_min_records = compact_min_records
        self._latest: dict[str, dict] = {}
        self._records = 0
        self._file = None
        self.failed: OSError | None = None

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
        self._file = open(self.path, "ab")
        if created:
            fsync_dir(self.directory)
        return dict(self._latest)

    def _replay(self, data: bytes) -> int:
        """Apply every intact record; the byte position after the last one."""
        pos = 0
        while pos + _HEAD.size <= len(data):
            length, crc = _HEAD.unpack_from(data, pos)
            end = pos + _HEAD.size + length
            if length > MAX_RECORD_BYTES or end > len(data):
                break
            payload = data[pos + _HEAD.size:end]
            if zlib.crc32(payload) != crc:
                break
            try:
                record = json.loads(payload)
                transactional_id, value = record["id"], record["txn"]
            except (ValueError, KeyError, TypeError):
                break
            self._apply(transactional_id, value)
            pos = end
        return pos

    def _apply(self, transactional_id: str, value: dict | None) -> None:
        self._records += 1
        if value is None:
            self._latest.pop(transactional_id, None)
        else:
            self._latest[transactional_id] = value

    def append(self, transactional_id: str, value: dict | None) -> None:
        """Durably record ``value`` (None: forget the id) before returning."""
        if self._file is None:
            raise RuntimeError("transaction log is not open")
        if self.failed is not None:
            raise TransactionLogFailed(f"{self.path} failed earlier: {self.failed}")
        try:
            self._file.write(encode_record(transactional_id, value))
            self._file.flush()
            os.fsync(self._file.fileno())
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
        self._file = open(self.path, "ab")
        log.info("compacted %s: %d records -> %d live transactional ids", self.path, self._records, len(self._latest))
        self._records = len(self._latest)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
