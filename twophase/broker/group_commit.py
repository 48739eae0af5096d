"""Group commit: under fsync "always", produce requests share fsyncs that run in a worker thread.

An fsync costs ~1 ms whatever it covers. Done inline, it would stall the event loop for every
produce request: no other connection is served meanwhile, and N producers pay N fsyncs in a row.
Instead a produce request appends with ``defer_fsync=True`` and awaits ``durable()``: one fsync per
log runs at a time, off the event loop, and covers every append made before it started; appends
made meanwhile wait for the next one. A request is acknowledged only once its batches are on disk,
and readers see nothing before that (the log's high watermark is the fsynced end).

Each fsync calls back once it has made more of the log visible, so parked fetches wake even when
the producers whose data it covered are gone.

The transaction log takes part the same way (TransactionLog has the same fsync interface): an
AddPartitionsToTxn record is written lazily and fsynced here, and the transaction's produce
requests await it (see TransactionCoordinator.additions_durable).

Example::

    result = plog.append(records, now_ms, defer_fsync=True)
    # KafkaStorageError if the fsync failed; wake_readers() runs after each fsync of this log
    await group_commit.durable(plog, result.last_offset + 1, wake_readers)
"""

from __future__ import annotations

import asyncio
import errno
import logging
from collections.abc import Callable
from typing import Protocol

from twophase.wire.errors import KafkaError, KafkaStorageError


log = logging.getLogger("twophase.broker")


class FsyncedLog(Protocol):
    """What group commit fsyncs: a PartitionLog, or the TransactionLog (offsets: its record count)."""

    directory: str

    @property
    def high_watermark(self) -> int: ...  # the end of what is fsynced
    @property
    def log_end_offset(self) -> int: ...
    def begin_fsync(self) -> tuple[int, Callable[[], None]] | None: ...
    def fsync_done(self, offset: int) -> None: ...
    def flush(self) -> None: ...
    def flush_failed(self, exc: Exception) -> None: ...


class GroupCommit:
    """The fsync in flight for each partition log, shared by everyone waiting on that log."""

    def __init__(self) -> None:
        self._in_flight: dict[FsyncedLog, asyncio.Future] = {}

    def sync_soon(self, plog: FsyncedLog, on_visible: Callable[[], None]) -> None:
        """Start an fsync of ``plog`` now unless one is in flight, for a later ``durable`` to find done
        or under way; nobody awaits it (a failure takes the log offline, as always)."""
        if plog not in self._in_flight and plog.high_watermark < plog.log_end_offset:
            fsync = self._in_flight[plog] = asyncio.ensure_future(self._fsync(plog, on_visible))
            fsync.add_done_callback(_retrieve)

    async def durable(self, plog: FsyncedLog, end_offset: int, on_visible: Callable[[], None]) -> None:
        """Return once every offset below ``end_offset`` of ``plog`` is fsynced. ``on_visible`` runs
        after an fsync this call starts, and after each one chained to it, moved the high watermark."""
        while plog.high_watermark < end_offset:
            fsync = self._in_flight.get(plog)
            if fsync is None:
                fsync = self._in_flight[plog] = asyncio.ensure_future(self._fsync(plog, on_visible))
            await asyncio.shield(fsync)  # a cancelled waiter must not cancel the others' fsync

    async def drain(self) -> None:
        """Wait for the fsyncs in flight (before the logs close)."""
        while self._in_flight:
            await asyncio.gather(*self._in_flight.values(), return_exceptions=True)

    async def _fsync(self, plog: FsyncedLog, on_visible: Callable[[], None]) -> None:
        visible = plog.high_watermark
        try:
            await self._sync(plog)
        except KafkaError:
            raise  # the log is offline already
        except Exception as exc:  # whatever failed, the data may not be on disk
            plog.flush_failed(exc)
            raise KafkaStorageError(f"fsync failed: {exc}") from exc
        finally:
            del self._in_flight[plog]
        if plog.high_watermark > visible:
            on_visible()
        if plog.high_watermark < plog.log_end_offset:
            # Appended meanwhile: those producers may have stopped waiting (their connection went
            # away), and their data must not wait for the next produce to become durable and visible.
            fsync = self._in_flight[plog] = asyncio.ensure_future(self._fsync(plog, on_visible))
            fsync.add_done_callback(_retrieve)

    @staticmethod
    async def _sync(plog: FsyncedLog) -> None:
        try:
            started = plog.begin_fsync()
        except OSError as exc:
            if exc.errno not in (errno.EMFILE, errno.ENFILE):
                raise
            # No descriptor to spare for the worker thread: sync on the event loop instead.
            log.warning("%s: %s; fsync on the event loop", plog.directory, exc)
            plog.flush()
            return
        if started is not None:
            offset, sync = started
            await asyncio.to_thread(sync)
            plog.fsync_done(offset)


def _retrieve(fsync: asyncio.Future) -> None:
    """Mark the outcome of an fsync nobody may await as seen (a failure took the log offline, or it was closed)."""
    if not fsync.cancelled():
        fsync.exception()
