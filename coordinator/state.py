"""Epoch states with explicit transitions, so an illegal step fails loudly.

::

    OPEN ──> COMMITTING ──> COMMITTED
                 │  ^
                 v  │ (operator retry: twophase recover --retry-failed)
               FAILED

Usage::

    record = EpochRecord()                                   # OPEN
    record = record.transition(EpochState.COMMITTING, run="r1", winners=("r1.0.0.0",))
    record.transition(EpochState.OPEN)         # IllegalTransition
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field, replace
from enum import Enum
from typing import Any

from twophase.states import Transitions


class EpochState(str, Enum):
    """Where phase two of one epoch stands."""

    OPEN = "open"              # pre-commits arriving; Spark has not completed the epoch
    COMMITTING = "committing"  # decision recorded: which attempts commit, the rest abort
    COMMITTED = "committed"    # every decided attempt committed, every other aborted
    FAILED = "failed"          # a handle can never be committed; needs an operator


EPOCH_TRANSITIONS = Transitions("epoch", {
    EpochState.OPEN: {EpochState.COMMITTING},
    EpochState.COMMITTING: {EpochState.COMMITTED, EpochState.FAILED},
    EpochState.FAILED: {EpochState.COMMITTING},
    EpochState.COMMITTED: (),
})


@dataclass(frozen=True)
class EpochRecord:
    """What the coordinator decided for one epoch, stored as JSON in its znode."""

    state: EpochState = EpochState.OPEN
    run: str | None = None                     # the run whose attempts are committed
    winners: tuple[str, ...] = ()              # attempt names (TxnContext.name) to commit
    updated: float = field(default_factory=time.time)
    error: str | None = None

    def transition(self, state: EpochState, **changes: Any) -> EpochRecord:
        """This record moved to ``state`` (with ``changes``); IllegalTransition if the move is not allowed."""
        EPOCH_TRANSITIONS.check(self.state, state)
        return replace(self, state=state, updated=time.time(), **changes)

    def encode(self) -> bytes:
        """The znode payload."""
        data = asdict(self)
        data["state"] = self.state.value
        data["winners"] = list(self.winners)
        return json.dumps(data).encode()

    @classmethod
    def decode(cls, raw: bytes) -> EpochRecord:
        """The record stored in a znode; an empty znode (just created by a writer) is OPEN."""
        if not raw:
            return cls(updated=0.0)
        data = json.loads(raw)
        return cls(
            state=EpochState(data["state"]),
            run=data.get("run"),
            winners=tuple(data.get("winners", ())),
            updated=data.get("updated", 0.0),
            error=data.get("error"),
        )
