"""The embedded coordinator's host: phase two for the app, in a supervised thread of the driver.

Usage::

    host = CoordinatorHost(AppCoordinator(client, root, app, signer, owner, policy),
                           supervision, on_give_up=lambda error: publisher.halt(repr(error)))
    host.start()
    host.wake()          # a barrier moved: reconcile now rather than at the next poll
    host.supervisor.stop()
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from coordinator.app import AppCoordinator
from coordinator.fence import Fenced
from twophase.supervisor import Supervision, Supervisor

log = logging.getLogger("twophase.driver")


class CoordinatorHost:
    """Runs ``coordinator.run`` (ownership, watches, reconcile loop) until stopped or fenced.

    A failure anywhere, start-up included, is logged and the coordinator restarted with
    backoff; if it keeps failing, ``on_give_up`` is told (the hook then halts the runs).
    Being fenced is not a failure: a newer driver or a daemon owns the app and finishes
    its epochs.
    """

    def __init__(self, coordinator: AppCoordinator, supervision: Supervision,
                 on_give_up: Callable[[BaseException], None]) -> None:
        self.coordinator = coordinator
        self.supervisor = Supervisor(f"twophase-coordinator-{coordinator.app}", self._run,
                                     on_give_up=on_give_up, supervision=supervision,
                                     interrupt=coordinator.wake.set)

    def start(self) -> None:
        """Start the coordinator under its supervisor thread."""
        self.supervisor.start()

    def wake(self) -> None:
        """Make the coordinator's reconcile loop run now instead of at its next tick."""
        self.coordinator.wake.set()

    def _run(self, stop: threading.Event) -> None:
        try:
            self.coordinator.run(stop)
        except Fenced:
            log.info("app %s: fenced; another coordinator owns phase two now", self.coordinator.app)
