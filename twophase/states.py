"""State machines as an enum plus a table of allowed moves, so an illegal move fails loudly.

Every stateful thing in twophase (an epoch in the coordinator, a transaction in the broker's
coordinator and in the client, a consumer group) declares its states as an ``enum.Enum`` and
its moves with one :class:`Transitions` table. Depends on nothing, so the sink contract, the
coordinator, the broker and the client can all use it.

Usage::

    class Light(enum.Enum):
        RED = "red"
        GREEN = "green"

    LIGHT = Transitions("light", {Light.RED: {Light.GREEN}, Light.GREEN: {Light.RED}})
    LIGHT.check(Light.RED, Light.GREEN)             # fine
    LIGHT.check(Light.RED, Light.RED)               # IllegalTransition: light red -> red
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from typing import Generic, TypeVar

S = TypeVar("S", bound=enum.Enum)


class IllegalTransition(RuntimeError):
    """A move its state machine does not allow: a bug in the caller, never retried."""


class Transitions(Generic[S]):
    """The moves allowed between the states of one enum.

    Args:
        what: names the machine in error messages ("epoch", "transaction", "group").
        allowed: for each state, the states it may move to. Every member of the enum must
            have an entry (an empty one for a final state), so a new state cannot be forgotten.
        from_any: states reachable from every state (a fatal error, a shutdown).
    """

    def __init__(self, what: str, allowed: Mapping[S, Iterable[S]], *, from_any: Iterable[S] = ()) -> None:
        self.what = what
        self._allowed = {state: frozenset(targets) for state, targets in allowed.items()}
        self._from_any = frozenset(from_any)
        states = {type(s) for s in self._allowed}
        if len(states) != 1:
            raise TypeError(f"{what}: the table must cover exactly one enum, got {sorted(t.__name__ for t in states)}")
        missing = set(next(iter(states))) - set(self._allowed)
        if missing:
            raise TypeError(f"{what}: no entry for {sorted(s.name for s in missing)}")

    def targets(self, current: S) -> frozenset[S]:
        """Every state ``current`` may move to."""
        return self._allowed[current] | self._from_any

    def allows(self, current: S, target: S) -> bool:
        """Whether ``current`` may move to ``target``."""
        return target in self.targets(current)

    def check(self, current: S, target: S, subject: str = "") -> S:
        """Return ``target`` if the move is allowed; raise IllegalTransition naming it otherwise."""
        if not self.allows(current, target):
            who = f"{self.what} {subject}".rstrip()
            raise IllegalTransition(f"{who}: {_label(current)} -> {_label(target)} is not allowed")
        return target


def _label(state: enum.Enum) -> str:
    return str(state.value) if isinstance(state.value, str) else state.name
