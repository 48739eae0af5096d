"""Idempotent-producer state of one partition: epochs, the last five batches' sequences, open transactions.

A retried batch whose sequence range matches one of the producer's last five batches is answered with
its original offsets instead of being stored again; a gap raises OUT_OF_ORDER_SEQUENCE_NUMBER (45), an
older epoch INVALID_PRODUCER_EPOCH (47); a marker (written only by the transaction coordinator) is
never refused for its epoch. State is snapshotted to ``<offset>.snapshot`` (on segment roll
and close) and rebuilt after a crash by replaying the batch headers written after the newest snapshot.

Example::

    state = ProducerStateManager(partition_dir)
    prepared = state.prepare(headers, markers, now_ms)   # headers already carry their final offsets
    if prepared.duplicate is None:
        ...write the batches...
        state.commit(prepared)
    state.open_transactions()                            # {producer_id: first offset}
    state.first_unstable_offset()                        # the LSO, when a transaction is open

``prepare`` also reports the transactions its ABORT markers end (for the aborted-transactions index),
each with the partition's last stable offset right after its marker.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import crc32c

from twophase.durable import atomic_write, unlink_quietly
from twophase.wire.errors import (
    InvalidProducerEpochError,
    InvalidTxnStateError,
    OutOfOrderSequenceError,
    TransactionCoordinatorFencedError,
)
from twophase.wire.records import INT32_MAX, NO_SEQUENCE, BatchHeader, ControlRecord
from .results import AppendResult
from .txnindex import AbortedTxn

log = logging.getLogger(__name__)

NO_EPOCH = -1
CACHED_BATCHES = 5  # Kafka's max.in.flight.requests.per.connection limit for idempotence
SNAPSHOT_SUFFIX = ".snapshot"
_SNAPSHOTS_KEPT = 2


@dataclass(frozen=True)
class BatchMetadata:
    """The sequence and offset range of one batch a producer appended, kept to recognise its retries."""
    first_seq: int
    last_seq: int
    base_offset: int
    last_offset: int


@dataclass
class ProducerEntry:
    """One producer's state on a partition: epoch, last batches, coordinator epoch and open transaction."""
    producer_id: int
    epoch: int = NO_EPOCH
    batches: list[BatchMetadata] = field(default_factory=list)
    coordinator_epoch: int = -1
    txn_first_offset: int | None = None
    last_timestamp: int = -1

    @property
    def last_seq(self) -> int:
        """The last sequence number appended, or NO_SEQUENCE if no batch is kept."""
        return self.batches[-1].last_seq if self.batches else NO_SEQUENCE

    def copy(self) -> ProducerEntry:
        """A copy whose batch list can change without changing this one."""
        return dataclasses.replace(self, batches=list(self.batches))

    def find_duplicate(self, header: BatchHeader) -> BatchMetadata | None:
        """The kept batch with ``header``'s epoch and sequence range (a retry), else None."""
        if header.producer_epoch != self.epoch:
            return None
        for batch in self.batches:
            if batch.first_seq == header.base_sequence and batch.last_seq == header.last_sequence:
                return batch
        return None


@dataclass
class PreparedAppend:
    """Outcome of prepare(): either a duplicate to acknowledge, or updated entries to commit after the write."""

    duplicate: AppendResult | None = None
    entries: dict[int, ProducerEntry] = field(default_factory=dict)
    aborted: list[AbortedTxn] = field(default_factory=list)


def _in_sequence(last_seq: int, next_seq: int) -> bool:
    return next_seq == last_seq + 1 or (next_seq == 0 and last_seq == INT32_MAX)


class ProducerStateManager:
    """Per-partition producer state; synchronous and not thread-safe, like the log that owns it."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._producers: dict[int, ProducerEntry] = {}
        # Producer id -> first offset of its open transaction; kept beside the entries so the LSO is
        # O(open transactions), not O(producers), on every fetch.
        self._open: dict[int, int] = {}

    # -- queries ----------------------------------------------------------------------------------

    def entry(self, producer_id: int) -> ProducerEntry | None:
        """The state of ``producer_id``, or None if it is unknown here."""
        return self._producers.get(producer_id)

    def entries(self) -> list[ProducerEntry]:
        """Every known producer's state (DescribeProducers), by producer id."""
        return [self._producers[pid] for pid in sorted(self._producers)]

    def producer_ids(self) -> list[int]:
        """Every known producer id, sorted."""
        return sorted(self._producers)

    def open_transactions(self) -> dict[int, int]:
        """Producer id -> first offset of its open transaction (the LSO is the smallest of these)."""
        return dict(self._open)

    def has_open_transaction(self, producer_id: int) -> bool:
        """Whether ``producer_id`` has a transaction open on this partition."""
        return producer_id in self._open

    def first_unstable_offset(self) -> int | None:
        """First offset of the earliest open transaction, or None when none is open."""
        return min(self._open.values()) if self._open else None

    # -- validation and update --------------------------------------------------------------------

    def check(
        self, header: BatchHeader, marker: ControlRecord | None = None, *, from_client: bool = True
    ) -> AppendResult | None:
        """Validate one batch against the current state: the original result for a duplicate, else None."""
        return self.prepare([header], [marker], now_ms=-1, from_client=from_client).duplicate

    def prepare(
        self,
        headers: Sequence[BatchHeader],
        markers: Sequence[ControlRecord | None],
        now_ms: int,
        *,
        from_client: bool = True,
    ) -> PreparedAppend:
        """Validate batches (with final offsets) in order, each against the state left by the previous ones.

        Raises on the first invalid batch; nothing is changed until commit().
        """
        staged: dict[int, ProducerEntry] = {}
        aborted: list[AbortedTxn] = []
        for header, marker in zip(headers, markers, strict=True):
            pid = header.producer_id
            if pid < 0:
                continue
            current = self._producers.get(pid)
            if from_client and not header.is_control and current is not None:
                dup = current.find_duplicate(header)
                if dup is not None:
                    return PreparedAppend(duplicate=AppendResult(dup.base_offset, dup.last_offset, -1, True))
            entry = staged.get(pid)
            if entry is None:
                entry = current.copy() if current is not None else ProducerEntry(pid)
            self._validate(entry, header, marker, from_client)
            txn_first_offset = entry.txn_first_offset
            self._update(entry, header, marker, now_ms)
            staged[pid] = entry
            if _ends_aborted_txn(header, marker, txn_first_offset):
                open_firsts = [f for p, f in self._open.items() if p not in staged]
                open_firsts += [e.txn_first_offset for e in staged.values() if e.txn_first_offset is not None]
                aborted.append(AbortedTxn(pid, txn_first_offset, header.base_offset,
                                          min(open_firsts, default=header.last_offset + 1)))
        return PreparedAppend(entries=staged, aborted=aborted)

    def commit(self, prepared: PreparedAppend) -> None:
        """Install the state prepare() computed, once its batches are written."""
        self._producers.update(prepared.entries)
        for entry in prepared.entries.values():
            self._track_open(entry)

    def replay(self, header: BatchHeader, marker: ControlRecord | None, now_ms: int) -> AbortedTxn | None:
        """Apply a batch read back from the log during recovery (already validated when appended).

        Returns the aborted transaction an ABORT marker ends, as prepare() reports it.
        """
        if header.producer_id < 0:
            return None
        entry = self._producers.setdefault(header.producer_id, ProducerEntry(header.producer_id))
        txn_first_offset = entry.txn_first_offset
        self._update(entry, header, marker, now_ms)
        self._track_open(entry)
        if not _ends_aborted_txn(header, marker, txn_first_offset):
            return None
        return AbortedTxn(entry.producer_id, txn_first_offset, header.base_offset,
                          min(self._open.values(), default=header.last_offset + 1))

    def clear(self) -> None:
        """Forget every producer (before replaying the whole log)."""
        self._producers.clear()
        self._open.clear()

    def _track_open(self, entry: ProducerEntry) -> None:
        if entry.txn_first_offset is None:
            self._open.pop(entry.producer_id, None)
        else:
            self._open[entry.producer_id] = entry.txn_first_offset

    @staticmethod
    def _validate(entry: ProducerEntry, header: BatchHeader, marker: ControlRecord | None, from_client: bool) -> None:
        pid, epoch = header.producer_id, header.producer_epoch
        if header.is_control:
            if marker is not None and marker.coordinator_epoch < entry.coordinator_epoch:
                raise TransactionCoordinatorFencedError(
                    f"producer {pid}: coordinator epoch {marker.coordinator_epoch} < {entry.coordinator_epoch}")
            if epoch < entry.epoch:
                # Only the coordinator writes markers, and it knows the producer's true epoch: data
                # claiming a later one was not its producer's (Produce refuses such data; older logs
                # may hold some). The marker wins, or the transaction could never end.
                log.warning("producer %d: a marker with epoch %d ends what data of epoch %d held open",
                            pid, epoch, entry.epoch)
            return
        if epoch < entry.epoch:
            raise InvalidProducerEpochError(f"producer {pid}: epoch {epoch} is older than current {entry.epoch}")
        if not from_client:
            return
        if epoch != entry.epoch:
            # A bumped epoch restarts sequences at 0. An unknown producer (its state may have expired)
            # may resume at any sequence, as in Kafka.
            if header.base_sequence != 0 and entry.epoch != NO_EPOCH:
                raise OutOfOrderSequenceError(
                    f"producer {pid}: new epoch {epoch} must start at sequence 0, got {header.base_sequence}")
        elif not _in_sequence(entry.last_seq, header.base_sequence):
            raise OutOfOrderSequenceError(
                f"producer {pid} epoch {epoch}: sequence {header.base_sequence} after {entry.last_seq}")
        if not header.is_transactional and entry.txn_first_offset is not None:
            raise InvalidTxnStateError(f"producer {pid}: non-transactional batch inside an open transaction")

    @staticmethod
    def _update(entry: ProducerEntry, header: BatchHeader, marker: ControlRecord | None, now_ms: int) -> None:
        if header.producer_epoch != entry.epoch:
            entry.epoch = header.producer_epoch
            entry.batches = []
        if header.is_control:
            entry.txn_first_offset = None
            if marker is not None:
                entry.coordinator_epoch = marker.coordinator_epoch
        else:
            if header.base_sequence >= 0:
                entry.batches.append(
                    BatchMetadata(header.base_sequence, header.last_sequence, header.base_offset, header.last_offset))
                del entry.batches[:-CACHED_BATCHES]
            if header.is_transactional and entry.txn_first_offset is None:
                entry.txn_first_offset = header.base_offset
        entry.last_timestamp = max(entry.last_timestamp, now_ms)

    def expire(self, now_ms: int, expiration_ms: int) -> list[int]:
        """Forget producers idle for ``expiration_ms`` with no open transaction; returns their ids."""
        gone = [
            pid for pid, e in self._producers.items()
            if e.txn_first_offset is None and e.last_timestamp + expiration_ms < now_ms
        ]
        for pid in gone:
            del self._producers[pid]
        return gone

    # -- snapshots --------------------------------------------------------------------------------

    def _snapshot_offsets(self) -> list[int]:
        offsets = []
        for name in os.listdir(self.directory):
            stem = name[: -len(SNAPSHOT_SUFFIX)]
            if name.endswith(SNAPSHOT_SUFFIX) and stem.isdigit():
                offsets.append(int(stem))
        return sorted(offsets)

    def _snapshot_path(self, offset: int) -> str:
        return os.path.join(self.directory, f"{offset:020d}{SNAPSHOT_SUFFIX}")

    def write_snapshot(self, offset: int) -> None:
        """Persist the state as of ``offset`` (the next offset to be written), atomically; keep the newest two."""
        self.snapshot_writer(offset)()

    def snapshot_writer(self, offset: int) -> Callable[[], None]:
        """The state as of ``offset``, captured now, and a call that persists it like ``write_snapshot``.

        The call touches only files, so it may run in another thread.
        """
        body = json.dumps({
            "version": 1,
            "offset": offset,
            "producers": [
                {
                    "pid": e.producer_id,
                    "epoch": e.epoch,
                    "coordinator_epoch": e.coordinator_epoch,
                    "txn_first_offset": e.txn_first_offset,
                    "last_timestamp": e.last_timestamp,
                    "batches": [[b.first_seq, b.last_seq, b.base_offset, b.last_offset] for b in e.batches],
                }
                for e in self._producers.values()
            ],
        }, separators=(",", ":")).encode()
        data = b"%08x\n" % crc32c.crc32c(body) + body

        def write() -> None:
            atomic_write(self._snapshot_path(offset), data)
            for old in self._snapshot_offsets()[:-_SNAPSHOTS_KEPT]:
                unlink_quietly(self._snapshot_path(old))

        return write

    def load_snapshot(self, max_offset: int) -> int | None:
        """Load the newest valid snapshot at or below ``max_offset``; returns its offset (None: replay all).

        Snapshots beyond ``max_offset`` describe data that recovery truncated and are deleted.
        """
        self.clear()
        for offset in reversed(self._snapshot_offsets()):
            path = self._snapshot_path(offset)
            if offset > max_offset:
                log.warning("%s: deleting snapshot beyond the log end %d", path, max_offset)
                unlink_quietly(path)
                continue
            try:
                with open(path, "rb") as f:
                    raw = f.read()
                crc, _, body = raw.partition(b"\n")
                if int(crc, 16) != crc32c.crc32c(body):
                    raise ValueError("CRC mismatch")
                state = json.loads(body)
                producers = {
                    p["pid"]: ProducerEntry(
                        producer_id=p["pid"],
                        epoch=p["epoch"],
                        batches=[BatchMetadata(*b) for b in p["batches"]],
                        coordinator_epoch=p["coordinator_epoch"],
                        txn_first_offset=p["txn_first_offset"],
                        last_timestamp=p["last_timestamp"],
                    )
                    for p in state["producers"]
                }
            except (OSError, ValueError, KeyError, TypeError) as exc:
                log.warning("%s: unreadable producer snapshot (%s), trying an older one", path, exc)
                continue
            self._producers = producers
            for entry in producers.values():
                self._track_open(entry)
            return offset
        return None


def _ends_aborted_txn(header: BatchHeader, marker: ControlRecord | None, txn_first_offset: int | None) -> bool:
    return header.is_control and marker is not None and not marker.commit and txn_first_offset is not None
