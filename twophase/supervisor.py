"""Background jobs that cannot die silently: log the cause, restart with backoff, give up loudly.

A thread whose exception ends it prints a traceback nobody reads, and whatever it did
(publishing Spark's progress, running phase two) stops without a word. A
:class:`Supervisor` runs a job in a thread of its own instead: each failure is logged
with its cause and the job restarts after an exponential backoff; after ``attempts``
failures in a row it stops retrying and calls ``on_give_up`` with the last error, so the
owner can stop what depends on the job (the driver hook halts the query's run).

Usage::

    def publish(stop: threading.Event) -> None:
        while not stop.wait(0.5):
            push_progress()                       # raising here is logged and retried

    job = Supervisor("publisher", publish, on_give_up=lambda error: halt(repr(error)))
    job.start()
    ...
    job.stop()                                    # sets the event, joins the thread
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger("twophase.supervisor")


@dataclass(frozen=True)
class Supervision:
    """How hard a supervised job is restarted before its owner is told it failed for good.

    A job that ran ``healthy_after`` seconds before failing starts its count afresh, so a
    rare failure is never fatal; ``attempts`` failures in a row are.
    """

    attempts: int = 5
    first_backoff: float = 0.5
    max_backoff: float = 10.0
    healthy_after: float = 60.0

    def backoff(self, failures: int) -> float:
        """Seconds to wait before restart number ``failures``: doubling from ``first_backoff`` up to ``max_backoff``."""
        return min(self.max_backoff, self.first_backoff * 2 ** (failures - 1))


class Supervisor:
    """Runs ``job(stop_event)`` in a daemon thread, restarting it when it raises.

    The job returns when ``stop_event`` is set (or when it has nothing left to do); it
    signals trouble by raising. ``on_give_up(error)`` runs in the supervisor's thread once
    the job failed ``supervision.attempts`` times in a row; the thread then ends.
    ``interrupt()`` is called on stop, for a job that sleeps on an event of its own.
    """

    def __init__(self, name: str, job: Callable[[threading.Event], None], *,
                 on_give_up: Callable[[BaseException], None],
                 supervision: Supervision | None = None,
                 interrupt: Callable[[], None] = lambda: None) -> None:
        self.name = name
        self.job = job
        self.on_give_up = on_give_up
        self.supervision = supervision or Supervision()
        self.interrupt = interrupt  # wakes a job sleeping on something other than the stop event
        self.failure: BaseException | None = None  # set once the supervisor gave up
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> Supervisor:
        """Start the job's thread; returns self."""
        self._thread.start()
        return self

    def stop(self, timeout: float | None = 10.0) -> None:
        """Ask the job to stop and wait for it (a job stuck in I/O is left to its daemon thread)."""
        self.request_stop()
        self.join(timeout)

    def request_stop(self) -> None:
        """Ask the job to stop (set its stop event and interrupt it) without waiting."""
        self._stop.set()
        self.interrupt()

    def join(self, timeout: float | None = 10.0) -> bool:
        """Wait for the thread to end; True if it has."""
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        return not self._thread.is_alive()

    @property
    def finished(self) -> bool:
        """The job ended: stopped, done, or given up on."""
        return self._thread.ident is not None and not self._thread.is_alive()

    def _run(self) -> None:
        failures = 0
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                self.job(self._stop)
                return
            except Exception as error:  # noqa: BLE001 - every failure is logged, retried, then escalated
                if self._stop.is_set():  # its resources were closed under it to stop it
                    log.debug("%s ended while stopping: %r", self.name, error)
                    return
                if time.monotonic() - started >= self.supervision.healthy_after:
                    failures = 0
                failures += 1
                if failures >= self.supervision.attempts:
                    self.failure = error
                    log.error("%s failed %d times in a row, giving up: %r", self.name, failures, error,
                              exc_info=error)
                    try:
                        self.on_give_up(error)
                    except Exception:  # noqa: BLE001 - the owner's handler must not end silently either
                        log.exception("%s: handling its failure failed too", self.name)
                    return
                delay = self.supervision.backoff(failures)
                log.warning("%s failed (%d of %d), restarting in %.1fs: %r", self.name, failures,
                            self.supervision.attempts, delay, error, exc_info=error)
                self._stop.wait(delay)
