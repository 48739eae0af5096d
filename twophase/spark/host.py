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
import time
from collections.abc import Callable

from kazoo.exceptions import KazooException

from coordinator.app import AppCoordinator, await_work
from coordinator.fence import Fenced
from twophase.supervisor import Supervision, Supervisor

log = logging.getLogger("twophase.driver")


class CoordinatorHost:
    """Runs the app's coordinator (ownership, watches, reconcile loop) until stopped or fenced.

    A failure anywhere, start-up included, is logged and the coordinator restarted with
    backoff; if it keeps failing, ``on_give_up`` is told (the hook then halts the runs).
    Being fenced is not a failure: a newer driver or a daemon owns the app and finishes
    its epochs.
    """

    def __init__(self, coordinator: AppCoordinator, supervision: Supervision,
                 on_give_up: Callable[[BaseException], None]) -> None:
        self.coordinator = coordinator
        self._full_pass = False  # wake() asked for a pass over every query
        self.supervisor = Supervisor(f"twophase-coordinator-{coordinator.app}", self._run,
                                     on_give_up=on_give_up, supervision=supervision,
                                     interrupt=coordinator.wake.set)

    def start(self) -> None:
        """Start the coordinator under its supervisor thread."""
        self.supervisor.start()

    def wake(self) -> None:
        """Make the coordinator's reconcile loop run a full pass now instead of at its next tick."""
        self._full_pass = True
        self.coordinator.wake.set()

    def _run(self, stop: threading.Event) -> None:
        # AppCoordinator.reconcile_logged logs and retries every failed pass for ever (what the
        # daemon, serving many apps, wants); here a pass that fails for another reason than ZooKeeper being away
        # (a refused signature, a sink that cannot be loaded, a bug) goes to the supervisor, so
        # that one that keeps failing halts the runs instead of stalling phase two quietly.
        # A pass woken by a watch visits only the queries whose watches fired (or that have work left);
        # one every poll_interval, or asked for by wake(), visits them all, in case a watch was lost.
        coordinator = self.coordinator
        try:
            coordinator.prepare()
            last_full = None
            while not stop.is_set():
                coordinator.wake.clear()
                now = time.monotonic()
                asked, self._full_pass = self._full_pass, False
                full = asked or last_full is None or now - last_full >= coordinator.policy.poll_interval
                try:
                    coordinator.reconcile(changed_only=not full, all_queries=asked)
                except KazooException as e:
                    log.warning("app %s: ZooKeeper trouble, retrying: %r", coordinator.app, e)
                if full:
                    last_full = now
                await_work(coordinator.wake, last_full + coordinator.policy.poll_interval, [coordinator])
        except Fenced:
            log.info("app %s: fenced; another coordinator owns phase two now", coordinator.app)
