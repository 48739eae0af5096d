"""Hanging transactions: open on a partition, but not held open by the transaction coordinator.

KIP-664's name for a transaction that holds a partition's last stable offset back while no
coordinator will ever end it: its transaction log was lost, or the coordinator logged it complete
but the marker never landed (a torn tail). The coordinator looks for them once at start
(:meth:`TransactionCoordinator.resolve_open_transactions`): it rewrites the marker whose outcome it
logged, and keeps the others here, to be aborted once the longest transaction timeout has passed
(an operator may abort them earlier with WriteTxnMarkers, ``twophase txns abort --topic ...``).

Example::

    found = open_transactions(logs.partitions())          # [OpenTxn(topic, partition, pid, epoch, start)]
    unknown = HangingTransactions()
    unknown.add(found[0], deadline_ms=now_ms + 900_000)
    for txn in unknown.due(now_ms): ...                    # past their deadline: abort them
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping


@dataclasses.dataclass(frozen=True)
class OpenTxn:
    """A transaction open on one partition: its producer id and epoch there, and its first offset."""
    topic: str
    partition: int
    producer_id: int
    producer_epoch: int
    start_offset: int


def open_transactions(partitions: Mapping[tuple[str, int], object]) -> list[OpenTxn]:
    """Every transaction open on the given PartitionLogs (by (topic, partition)), in partition order."""
    found = []
    for (topic, partition), plog in sorted(partitions.items()):
        for producer_id, start in sorted(plog.producers.open_transactions().items()):
            found.append(OpenTxn(topic, partition, producer_id, plog.producers.entry(producer_id).epoch, start))
    return found


class HangingTransactions:
    """Hanging transactions of unknown outcome, each with the time after which it is aborted.

    Usage::

        unknown = HangingTransactions()
        unknown.add(txn, deadline_ms)
        unknown.due(now_ms)                 # those past their deadline, removed from here
        unknown.discard(txn.topic, txn.partition, txn.producer_id)   # ended otherwise
    """

    def __init__(self) -> None:
        self._deadlines: dict[tuple[str, int, int], tuple[OpenTxn, int]] = {}

    def add(self, txn: OpenTxn, deadline_ms: int) -> None:
        """Abort ``txn`` at ``deadline_ms`` unless it ends before."""
        self._deadlines[(txn.topic, txn.partition, txn.producer_id)] = (txn, deadline_ms)

    def discard(self, topic: str, partition: int, producer_id: int) -> None:
        """Forget the producer's hanging transaction on the partition (ended some other way)."""
        self._deadlines.pop((topic, partition, producer_id), None)

    def due(self, now_ms: int) -> Iterable[OpenTxn]:
        """The transactions whose deadline has passed; each is handed out once."""
        due = [key for key, (_, deadline) in self._deadlines.items() if deadline <= now_ms]
        return [self._deadlines.pop(key)[0] for key in due]
