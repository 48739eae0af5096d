"""The HA coordinator daemon: several run, one leads, the leader runs phase two.

Daemons join a kazoo Election under ``<root>/daemon/election``. The leader takes
the fence of every app configured with ``coordinator="daemon"`` (so a deposed
leader's state changes fail atomically) and reconciles them until it stops,
loses its ZooKeeper session, or is fenced; then it rejoins the election.

Usage::

    daemon = CoordinatorDaemon("127.0.0.1:2181", "/twophase", Signer(load_secret()))
    daemon.run(stop_event)        # blocks; `twophase coordinator` does this
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time

from kazoo.client import KazooState

from coordinator.app import AppCoordinator, CommitPolicy, await_work
from coordinator.fence import Fenced
from coordinator.layout import AppPaths, app_names, election_path
from coordinator.zk import RecordError, children, connect, read_object
from twophase.cli_args import check_positive_seconds
from twophase.signing import Signer

log = logging.getLogger("twophase.daemon")


class CoordinatorDaemon:
    """One HA coordinator daemon: contends for leadership and, while leading, runs phase two
    of every app published with ``coordinator="daemon"``.

    ::

        stop = threading.Event()
        daemon = CoordinatorDaemon("zk1:2181,zk2:2181", "/twophase", Signer(load_secret()),
                                   CommitPolicy(poll_interval=1.0), session_timeout=5.0)
        daemon.run(stop)        # until stop is set; daemon.leading tells whether it leads
    """

    def __init__(self, hosts: str, root: str, signer: Signer, policy: CommitPolicy | None = None,
                 identifier: str | None = None, session_timeout: float = 10.0) -> None:
        self.hosts = hosts
        self.session_timeout = check_positive_seconds(session_timeout, "session_timeout")
        self.root = root
        self.signer = signer
        self.policy = policy or CommitPolicy()
        self.identifier = identifier or f"{socket.gethostname()}:{os.getpid()}"
        self.leading = threading.Event()
        self._wake = threading.Event()
        self._session_lost = threading.Event()
        self._troubled: dict[tuple[str, str], str] = {}  # (app, stage) -> the trouble last logged as an ERROR

    def run(self, stop: threading.Event) -> None:
        """Contend and, when elected, lead, until ``stop`` is set; rejoins the election after losing it."""
        client = connect(self.hosts, session_timeout=self.session_timeout)
        client.add_listener(self._on_state)
        try:
            election = client.Election(election_path(self.root), self.identifier)
            while not stop.is_set():
                self._session_lost.clear()
                log.info("daemon %s: waiting for leadership", self.identifier)
                # Election.run blocks until elected, then holds the lock while _lead runs.
                runner = threading.Thread(target=election.run, args=(self._lead, client, stop), daemon=True)
                runner.start()
                while runner.is_alive() and not stop.is_set():
                    runner.join(0.2)
                if stop.is_set():
                    election.cancel()
                    self._wake.set()
                    runner.join(5)
        finally:
            client.stop()
            client.close()

    def _on_state(self, state: str) -> None:
        if state == KazooState.LOST:
            self._session_lost.set()  # our election node is gone: someone else may lead now
            self._wake.set()

    def _lead(self, client, stop: threading.Event) -> None:
        log.info("daemon %s: leading", self.identifier)
        self.leading.set()
        apps: dict[str, AppCoordinator] = {}
        try:
            client.retry(client.ensure_path, app_names(self.root))
            client.ChildrenWatch(app_names(self.root), lambda _: self._wake.set())
            last_full = None
            while not stop.is_set() and not self._session_lost.is_set():
                self._wake.clear()
                # As the embedded host does: a pass woken by a watch (or a ready hint's commits/N appearing)
                # visits only the queries that changed, one every poll_interval every query of every app,
                # in case a watch was lost.
                now = time.monotonic()
                full = last_full is None or now - last_full >= self.policy.poll_interval
                names = self._daemon_apps(client)
                for name in set(apps) - set(names):
                    apps.pop(name).close()  # no longer a daemon app: its watches and hints must not wake us
                for name in names:
                    if name not in apps:
                        app = AppCoordinator(client, self.root, name, self.signer,
                                             f"daemon {self.identifier}", self.policy, self._wake)
                        try:
                            app.prepare()
                        except Fenced:
                            raise
                        except Exception as e:  # noqa: BLE001 - one app's trouble must not stop the others
                            self._app_trouble(name, "start", f"cannot start phase two: {e!r}; retried next round", e)
                            continue
                        apps[name] = app
                        self._troubled.pop((name, "start"), None)
                        app.reconcile_logged()  # a new app's first pass visits every query
                    else:
                        apps[name].reconcile_logged(changed_only=not full)
                if full:
                    last_full = now
                await_work(self._wake, last_full + self.policy.poll_interval, apps.values())
        except Fenced:
            log.error("daemon %s: fenced by a newer leader; stepping down", self.identifier)
        except Exception as e:  # noqa: BLE001 - said with its cause; the daemon contends again
            log.error("daemon %s: leading failed: %r; stepping down", self.identifier, e, exc_info=e)
            stop.wait(self.policy.poll_interval)  # not a tight loop when the cause persists
        finally:
            for app in apps.values():
                app.close()  # the client outlives this leadership: its watches must not wake the next one
            self.leading.clear()
            log.info("daemon %s: no longer leading", self.identifier)

    def _app_trouble(self, name: str, stage: str, what: str, cause: BaseException | None = None) -> None:
        """Log an app's trouble as an ERROR when it is new, then only at DEBUG while it stays the same:
        the daemon retries every round, and one damaged app must not flood the log."""
        if self._troubled.get((name, stage)) == what:
            log.debug("daemon %s: app %r still %s", self.identifier, name, what)
            return
        self._troubled[(name, stage)] = what
        log.error("daemon %s: app %r %s", self.identifier, name, what, exc_info=cause)

    def _daemon_apps(self, client) -> list[str]:
        names = []
        for name in children(client, app_names(self.root)):
            try:
                mode = read_object(client, AppPaths(self.root, name).base, {}).get("coordinator")
            except RecordError as e:  # one damaged app must not stop the others
                self._app_trouble(name, "read", f"skipped: {e}")
                continue
            self._troubled.pop((name, "read"), None)
            if mode == "daemon":
                names.append(name)
        return names
