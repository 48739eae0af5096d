"""The state of one transactional id, as an enum with the transitions the coordinator may make.

    Empty ──AddPartitions/AddOffsets──▶ Ongoing ──EndTxn(commit)──▶ PrepareCommit ──markers──▶ CompleteCommit
    ▲   │                                  │
    └───┘ InitProducerId (epoch bump)      └──EndTxn(abort), timeout, InitProducerId (fencing)──┐
                                                                                                ▼
                                           CompleteAbort ◀──markers── PrepareAbort ◀────────────┘

Ongoing stays Ongoing while partitions and groups are added.
CompleteCommit/CompleteAbort go to Ongoing (the next transaction) or Empty (InitProducerId).
Empty and Complete* go to Dead when the transactional id expires; Dead leads nowhere. There is
no PrepareEpochFence: a fencing abort bumps the epoch in the same log record as PrepareAbort.

Example::

    state.check(TxnState.PREPARE_COMMIT)   # IllegalTransition unless allowed from ``state``
"""

from __future__ import annotations

import enum


class IllegalTransition(RuntimeError):
    pass


class TxnState(enum.Enum):
    EMPTY = "Empty"
    ONGOING = "Ongoing"
    PREPARE_COMMIT = "PrepareCommit"
    PREPARE_ABORT = "PrepareAbort"
    COMPLETE_COMMIT = "CompleteCommit"
    COMPLETE_ABORT = "CompleteAbort"
    DEAD = "Dead"

    @property
    def completing(self) -> bool:
        """A decision is logged and its markers are (being) written."""
        return self in (TxnState.PREPARE_COMMIT, TxnState.PREPARE_ABORT)

    @property
    def idle(self) -> bool:
        """No transaction is open: the id may start one, or expire."""
        return self in (TxnState.EMPTY, TxnState.COMPLETE_COMMIT, TxnState.COMPLETE_ABORT)

    def check(self, target: TxnState) -> None:
        if target not in ALLOWED_TRANSITIONS[self]:
            raise IllegalTransition(f"transaction state {self.value} -> {target.value}")


ALLOWED_TRANSITIONS: dict[TxnState, frozenset[TxnState]] = {
    TxnState.EMPTY: frozenset({TxnState.EMPTY, TxnState.ONGOING, TxnState.DEAD}),
    TxnState.ONGOING: frozenset({TxnState.ONGOING, TxnState.PREPARE_COMMIT, TxnState.PREPARE_ABORT}),
    TxnState.PREPARE_COMMIT: frozenset({TxnState.COMPLETE_COMMIT}),
    TxnState.PREPARE_ABORT: frozenset({TxnState.COMPLETE_ABORT}),
    TxnState.COMPLETE_COMMIT: frozenset({TxnState.EMPTY, TxnState.ONGOING, TxnState.DEAD}),
    TxnState.COMPLETE_ABORT: frozenset({TxnState.EMPTY, TxnState.ONGOING, TxnState.DEAD}),
    TxnState.DEAD: frozenset(),
}
