"""Epoch states with explicit transitions, so an illegal step fails loudly.

::

    OPEN ──> COMMITTING ──> COMMITTED
      │          │  ^
      │          v  │ (operator retry: twophase recover --retry-failed)
      └──────> FAILED
      (the write of the run that completed the epoch failed: never committed, `twophase replay` runs it again)

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

from coordinator.zk import RecordError
from twophase.states import Transitions


class EpochState(str, Enum):
    """Where phase two of one epoch stands."""

    OPEN = "open"              # pre-commits arriving; Spark has not completed the epoch
    COMMITTING = "committing"  # decision recorded: which attempts commit, the rest abort
    COMMITTED = "committed"    # every decided attempt committed, every other aborted
    FAILED = "failed"          # a handle can never be committed, or the epoch's write failed; needs an operator


EPOCH_TRANSITIONS = Transitions("epoch", {
    EpochState.OPEN: {EpochState.COMMITTING, EpochState.FAILED},
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
    replay: bool = False                       # FAILED for good: its run's write failed, only a replay helps

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
    def decode(cls, raw: bytes, path: str = "epoch record") -> EpochRecord:
        """The record stored in the znode ``path``; an empty znode (just created by a writer) is OPEN.

        RecordError, naming ``path`` and what is wrong, if it holds anything :meth:`encode` does not write.
        """
        if not raw:
            return cls(updated=0.0)
        try:
            data = json.loads(raw)
            if not isinstance(data, dict):
                raise ValueError(f"expected a JSON object, found {raw[:80]!r}")
            states = [s.value for s in EpochState]
            if data.get("state") not in states:
                raise ValueError(f"state {data.get('state')!r} is not one of {', '.join(states)}")
            winners = data.get("winners", [])
            if not isinstance(winners, list) or not all(isinstance(w, str) for w in winners):
                raise ValueError(f"winners {winners!r:.80} is not a list of attempt names")
            for key in ("run", "error"):
                if not isinstance(data.get(key), (str, type(None))):
                    raise ValueError(f"{key} {data[key]!r:.80} is not a string")
            updated = data.get("updated", 0.0)
            if isinstance(updated, bool) or not isinstance(updated, (int, float)):
                raise ValueError(f"updated {updated!r:.80} is not a timestamp")
            if not isinstance(data.get("replay", False), bool):
                raise ValueError(f"replay {data['replay']!r:.80} is not a boolean")
        except ValueError as e:  # not JSON too
            raise RecordError(f"znode {path}: not an epoch record: {e}") from None
        return cls(EpochState(data["state"]), data.get("run"), tuple(winners), updated, data.get("error"),
                   data.get("replay", False))
