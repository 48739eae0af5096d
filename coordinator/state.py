"""Epoch states with explicit transitions, so an illegal step fails loudly.

::

    OPEN ──> COMMITTING ──> COMMITTED
                 │  ^
                 v  │ (operator retry: twophase recover --retry-failed)
               FAILED
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field, replace
from enum import Enum


class EpochState(str, Enum):
    OPEN = "open"              # pre-commits arriving; Spark has not completed the epoch
    COMMITTING = "committing"  # decision recorded: which attempts commit, the rest abort
    COMMITTED = "committed"    # every decided attempt committed, every other aborted
    FAILED = "failed"          # a handle can never be committed; needs an operator


_ALLOWED = {
    EpochState.OPEN: {EpochState.COMMITTING},
    EpochState.COMMITTING: {EpochState.COMMITTED, EpochState.FAILED},
    EpochState.FAILED: {EpochState.COMMITTING},
    EpochState.COMMITTED: set(),
}


class IllegalTransition(RuntimeError):
    pass


@dataclass(frozen=True)
class EpochRecord:
    """What the coordinator decided for one epoch, stored as JSON in its znode."""

    state: EpochState = EpochState.OPEN
    run: str | None = None                     # the run whose attempts are committed
    winners: tuple[str, ...] = ()              # attempt names to commit
    updated: float = field(default_factory=time.time)
    error: str | None = None

    def to(self, state: EpochState, **changes) -> "EpochRecord":
        if state not in _ALLOWED[self.state]:
            raise IllegalTransition(f"epoch cannot go from {self.state.value} to {state.value}")
        return replace(self, state=state, updated=time.time(), **changes)

    def encode(self) -> bytes:
        data = asdict(self)
        data["state"] = self.state.value
        data["winners"] = list(self.winners)
        return json.dumps(data).encode()

    @classmethod
    def decode(cls, raw: bytes) -> "EpochRecord":
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
