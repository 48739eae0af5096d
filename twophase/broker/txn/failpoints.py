"""Crash injection for tests: the broker SIGKILLs itself at a named step of EndTxn.

Set ``TWOPHASE_BROKER_FAILPOINT`` in the broker process's environment (read when the
coordinator starts) to one of :data:`FAILPOINTS`. All but ``before_prepare`` also fire when the
broker itself aborts a transaction (timeout, or fencing by InitProducerId), which takes the same
steps:

- ``before_prepare``:  EndTxn arrived, nothing logged yet          -> the transaction is still open
- ``after_prepare``:   PrepareCommit/PrepareAbort logged, no marker -> recovery writes every marker
- ``between_markers``: the first partition's marker written         -> recovery writes the rest
- ``after_markers``:   every marker written, Complete* not logged    -> recovery rewrites them (harmless)

Example::

    TWOPHASE_BROKER_FAILPOINT=after_prepare python -m twophase.cli broker --data-dir d
"""

from __future__ import annotations

import logging
import os
import signal

log = logging.getLogger("twophase.broker.txn")

ENV = "TWOPHASE_BROKER_FAILPOINT"
FAILPOINTS = frozenset({"before_prepare", "after_prepare", "between_markers", "after_markers"})


class Failpoint:
    """A named step of EndTxn at which the broker kills itself (tests only); ``Failpoint(None)`` never fires.

    Usage::

        failpoint = Failpoint.from_env()     # TWOPHASE_BROKER_FAILPOINT, or never
        failpoint.hit("after_prepare")       # SIGKILLs this process if that is the name set
    """
    def __init__(self, name: str | None) -> None:
        if name and name not in FAILPOINTS:
            raise ValueError(f"{ENV}={name!r}: expected one of {sorted(FAILPOINTS)}")
        self.name = name or None

    @classmethod
    def from_env(cls) -> Failpoint:
        """The failpoint named by TWOPHASE_BROKER_FAILPOINT; ValueError if it names no known step."""
        return cls(os.environ.get(ENV))

    def hit(self, name: str) -> None:
        """SIGKILL this process if ``name`` is the failpoint set; else return."""
        if name == self.name:
            log.warning("failpoint %s: killing the broker (SIGKILL)", name)
            logging.shutdown()
            os.kill(os.getpid(), signal.SIGKILL)
