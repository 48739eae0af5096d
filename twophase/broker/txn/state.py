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

    TRANSITIONS.check(TxnState.ONGOING, TxnState.PREPARE_COMMIT)   # IllegalTransition if not allowed
    meta.transition(TxnState.PREPARE_COMMIT)                      # the same, on a TxnMetadata
"""

from __future__ import annotations

import enum

from twophase.states import Transitions


class TxnState(enum.Enum):
    """Where one transactional id's transaction is, as the coordinator logs it (Kafka's names)."""

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


TRANSITIONS: Transitions[TxnState] = Transitions("transaction", {
    TxnState.EMPTY: {TxnState.EMPTY, TxnState.ONGOING, TxnState.DEAD},
    TxnState.ONGOING: {TxnState.ONGOING, TxnState.PREPARE_COMMIT, TxnState.PREPARE_ABORT},
    TxnState.PREPARE_COMMIT: {TxnState.COMPLETE_COMMIT},
    TxnState.PREPARE_ABORT: {TxnState.COMPLETE_ABORT},
    TxnState.COMPLETE_COMMIT: {TxnState.EMPTY, TxnState.ONGOING, TxnState.DEAD},
    TxnState.COMPLETE_ABORT: {TxnState.EMPTY, TxnState.ONGOING, TxnState.DEAD},
    TxnState.DEAD: (),
})
