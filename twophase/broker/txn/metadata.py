"""What the coordinator knows about one transactional id, and its form in the transaction log.

Two (producer id, epoch) pairs are kept because of KIP-939: ``producer_id``/``producer_epoch``
is what the current producer instance uses, ``txn_producer_id``/``txn_producer_epoch`` what the
open transaction was begun with. They differ only after a new instance took over a prepared
transaction (InitProducerId with keep_prepared_txn), which bumps the epoch but leaves the
transaction alone.

A third pair, ``previous_producer_id``/``previous_producer_epoch`` (Kafka's lastProducerEpoch,
KIP-360), is what the instance that asked for the latest epoch bump held before it. A retry of that
InitProducerId, whose response was lost, presents this pair and gets the current one back instead
of PRODUCER_FENCED. Only the instance holding the current epoch can know the previous pair, so every
bump nobody asked for with its own pair (a new instance, a timeout) clears it.

Example::

    meta = TxnMetadata("app-1", producer_id=7, producer_epoch=0, timeout_ms=60_000)
    meta.transition(TxnState.ONGOING)          # IllegalTransition if not allowed
    TxnMetadata.from_dict("app-1", meta.to_dict()) == meta
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from .state import TRANSITIONS, TxnState
from .unsynced import UnsyncedMarker

MAX_EPOCH = 32767  # int16; an epoch bump beyond it allocates a new producer id


@dataclasses.dataclass(eq=True)
class TxnMetadata:
    """The coordinator's record of one transactional id: producer ids and epochs, state, and what
    the open transaction touched; one record of the transaction log (:meth:`to_dict`)."""

    transactional_id: str
    producer_id: int
    producer_epoch: int
    timeout_ms: int
    state: TxnState = TxnState.EMPTY
    two_phase: bool = False  # KIP-939: the transaction never times out
    txn_producer_id: int = -1
    txn_producer_epoch: int = -1
    partitions: set[tuple[str, int]] = dataclasses.field(default_factory=set)
    groups: set[str] = dataclasses.field(default_factory=set)
    start_ms: int = -1  # when the current (or last) transaction began
    last_update_ms: int = -1
    previous_producer_id: int = -1
    previous_producer_epoch: int = -1
    # Markers of this id's transactions their partitions may not have fsynced yet (see unsynced.py).
    unsynced_markers: tuple[UnsyncedMarker, ...] = ()

    def copy(self) -> TxnMetadata:
        """An independent copy: the coordinator changes and logs a copy, and installs it once durable."""
        return dataclasses.replace(self, partitions=set(self.partitions), groups=set(self.groups))

    def transition(self, target: TxnState) -> None:
        """Move to ``target``; IllegalTransition (a coordinator bug) if the state machine forbids it."""
        self.state = TRANSITIONS.check(self.state, target, repr(self.transactional_id))

    @property
    def taken_over(self) -> bool:
        """An instance started with keep_prepared_txn holds the open transaction: it may only end it."""
        return self.state is TxnState.ONGOING and (self.txn_producer_id, self.txn_producer_epoch) != (
            self.producer_id, self.producer_epoch)

    @property
    def marker_epoch(self) -> int:
        """The epoch commit/abort markers carry: the current one, which fences writes of older ones."""
        if self.txn_producer_id == self.producer_id:
            return self.producer_epoch
        return self.txn_producer_epoch + 1  # the id rolled over; still newer than the data's epoch

    def begin(self, now_ms: int) -> None:
        """Open a transaction with the current producer id and epoch, no partitions or groups yet."""
        self.transition(TxnState.ONGOING)
        self.txn_producer_id, self.txn_producer_epoch = self.producer_id, self.producer_epoch
        self.partitions = set()
        self.groups = set()
        self.start_ms = now_ms

    @property
    def current(self) -> tuple[int, int]:
        """The current (producer id, epoch)."""
        return self.producer_id, self.producer_epoch

    @property
    def previous(self) -> tuple[int, int]:
        """The (producer id, epoch) that asked for the last bump, or (-1, -1)."""
        return self.previous_producer_id, self.previous_producer_epoch

    def bump_epoch(self, allocate_producer_id: Callable[[], int], requested_by: tuple[int, int] | None = None) -> None:
        """Fence older instances: the next epoch, or a new producer id once the epoch runs out (like
        Kafka, the last epoch a client may hold is MAX_EPOCH - 1, so a fencing bump always fits).
        ``requested_by`` is the (id, epoch) of the instance asking for the bump, which becomes the
        previous pair; None (a new instance, a timeout) clears it."""
        self.previous_producer_id, self.previous_producer_epoch = requested_by or (-1, -1)
        if self.producer_epoch >= MAX_EPOCH - 1:
            self.producer_id, self.producer_epoch = allocate_producer_id(), 0
        else:
            self.producer_epoch += 1

    def to_dict(self) -> dict:
        """The JSON-ready record the transaction log stores."""
        return {
            "pid": self.producer_id, "epoch": self.producer_epoch, "timeout_ms": self.timeout_ms,
            "state": self.state.value, "two_phase": self.two_phase,
            "txn_pid": self.txn_producer_id, "txn_epoch": self.txn_producer_epoch,
            "partitions": sorted([t, p] for t, p in self.partitions), "groups": sorted(self.groups),
            "start_ms": self.start_ms, "last_update_ms": self.last_update_ms,
            "prev_pid": self.previous_producer_id, "prev_epoch": self.previous_producer_epoch,
            "unsynced": [m.to_list() for m in self.unsynced_markers],
        }

    @classmethod
    def from_dict(cls, transactional_id: str, d: dict) -> TxnMetadata:
        """The metadata of ``transactional_id`` from a to_dict() record."""
        return cls(transactional_id, producer_id=int(d["pid"]), producer_epoch=int(d["epoch"]),
                   timeout_ms=int(d["timeout_ms"]), state=TxnState(d["state"]), two_phase=bool(d["two_phase"]),
                   txn_producer_id=int(d["txn_pid"]), txn_producer_epoch=int(d["txn_epoch"]),
                   partitions={(str(t), int(p)) for t, p in d["partitions"]}, groups=set(d["groups"]),
                   start_ms=int(d["start_ms"]), last_update_ms=int(d["last_update_ms"]),
                   # records logged before the previous pair existed have none: a retry then is fenced
                   previous_producer_id=int(d.get("prev_pid", -1)),
                   previous_producer_epoch=int(d.get("prev_epoch", -1)),
                   unsynced_markers=tuple(UnsyncedMarker.from_list(m) for m in d.get("unsynced", ())))
