"""Markers left to a partition's periodic flush, logged so that a crash cannot lose one for good.

Under an fsync interval the coordinator does not fsync a partition for its marker: that fsync
covers everything the partition holds unflushed (up to an interval of every producer's data), on
the event loop, and it was most of a commit's time. The transaction log (fsynced) instead keeps,
per transactional id, the markers not yet covered by their partition's ``flushed_end``; each
record it writes drops the ones covered since. After a crash of the machine a partition recovers
a prefix of its log; a marker at or beyond the recovered end is lost, and the open transaction
its producer then has there is the one that marker ended (anything later was after it). Recovery
writes that marker again, with the logged outcome, before it completes any logged decision.

Consecutive markers of one producer on one partition with the same epoch and outcome are kept as
one entry, the last offset: whichever of them was the first lost, the outcome is the same. An id
whose list outgrows MAX_UNSYNCED (commits and aborts alternating faster than the flush interval)
has those partitions fsynced instead.

Example::

    markers = record(markers, UnsyncedMarker("orders", 0, producer_id=7, epoch=0, commit=True, offset=41))
    markers = still_unsynced(markers, partition_log)               # before each transaction-log record
    markers = restore(markers, partition_log, 0, now_ms, woken)    # at start, before completing anything
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import NamedTuple

from twophase.wire.errors import KafkaError, UnknownTopicOrPartitionError

log = logging.getLogger("twophase.broker.txn")

# Entries per transactional id, each a few dozen bytes in every record of the id. Runs of commits
# keep one entry per partition, so only a transaction over this many partitions (or commits and
# aborts alternating within a flush interval) gets its partitions fsynced.
MAX_UNSYNCED = 1024


class UnsyncedMarker(NamedTuple):
    """A marker the partition may not have fsynced yet: where it is and what it said."""
    topic: str
    partition: int
    producer_id: int
    epoch: int
    commit: bool
    offset: int

    def to_list(self) -> list:
        """The JSON form (the transaction log's)."""
        return list(self)

    @classmethod
    def from_list(cls, value: list) -> UnsyncedMarker:
        """An entry from ``to_list``."""
        topic, partition, producer_id, epoch, commit, offset = value
        return cls(str(topic), int(partition), int(producer_id), int(epoch), bool(commit), int(offset))


def record(markers: tuple[UnsyncedMarker, ...], new: UnsyncedMarker) -> tuple[UnsyncedMarker, ...]:
    """``markers`` with ``new`` added: it replaces the producer's previous entry on the partition if that
    has the same epoch and outcome (the later offset stands for both)."""
    key = new[:3]
    for i in range(len(markers) - 1, -1, -1):
        if markers[i][:3] == key:
            if markers[i][3:5] == new[3:5]:
                return markers[:i] + markers[i + 1:] + (new,)
            break
    return (*markers, new)


def still_unsynced(markers: tuple[UnsyncedMarker, ...], partition_log: Callable) -> tuple[UnsyncedMarker, ...]:
    """The entries whose partition holds them but has not fsynced them yet. A deleted partition's are
    dropped, and so are those beyond the log's end: the topic was deleted and created again (or the
    log cut back), and writing such a marker after a crash would end a transaction it never ended."""
    kept = []
    for marker in markers:
        try:
            plog = partition_log(marker.topic, marker.partition)
        except UnknownTopicOrPartitionError:
            continue
        if plog.flushed_end <= marker.offset < plog.log_end_offset:
            kept.append(marker)
    return tuple(kept)


def sync_all(markers: tuple[UnsyncedMarker, ...], partition_log: Callable) -> None:
    """Fsync the partitions of ``markers`` now (KafkaError or OSError if one fails)."""
    for topic, partition in sorted({(m.topic, m.partition) for m in markers}):
        try:
            plog = partition_log(topic, partition)
        except UnknownTopicOrPartitionError:
            continue
        plog.flush()


def restore(markers: tuple[UnsyncedMarker, ...], partition_log: Callable, coordinator_epoch: int, now_ms: int,
            data_arrived: Callable[[str, int], None]) -> tuple[UnsyncedMarker, ...]:
    """At start: write again (fsynced) every marker a crash lost; the entries that could not be settled
    (a partition that failed), logged as ERRORs. One that survived needs nothing: opening the log
    fsynced what its recovery kept."""
    unsettled = []
    for marker in sorted(markers, key=lambda m: (m.topic, m.partition, m.producer_id, m.offset)):
        try:
            plog = partition_log(marker.topic, marker.partition)
        except UnknownTopicOrPartitionError:
            continue
        try:
            if marker.offset >= plog.log_end_offset and plog.has_open_transaction(marker.producer_id):
                outcome = "COMMIT" if marker.commit else "ABORT"
                log.warning("%s-%d: the %s marker of producer %d at offset %d was lost in a crash: writing it "
                            "again", marker.topic, marker.partition, outcome, marker.producer_id, marker.offset)
                plog.append_marker(marker.producer_id, marker.epoch, marker.commit, coordinator_epoch, now_ms)
                data_arrived(marker.topic, marker.partition)
        except (KafkaError, OSError) as exc:
            log.error("%s-%d: settling the unsynced marker of producer %d at offset %d failed; its transaction "
                      "may stay open there: %s", marker.topic, marker.partition, marker.producer_id, marker.offset,
                      exc)
            unsettled.append(marker)
    return tuple(unsettled)
