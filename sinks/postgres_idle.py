"""Connections phase two keeps open between its calls, so a ``COMMIT PREPARED`` is one round trip.

A new connection costs PostgreSQL a server process: about 2.5 ms and 4 ms of CPU on a 2-core host
(``bench/README.md``), paid by every commit of every partition of every epoch, on the CPUs the next
batch's tasks run on. The coordinator's commit threads already bound how many calls run at once, so a
list of idle connections is enough: psycopg_pool would add a scheduler and worker threads per sink.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import psycopg
from psycopg.pq import TransactionStatus

__all__ = ["IdleConnections", "MAX_IDLE_S"]

# NAT gateways, load balancers and firewalls drop idle flows without a reset after a few minutes (AWS's NAT
# after 350 s): a check on such a connection would wait out TCP's retransmissions, about 15 minutes.
MAX_IDLE_S = 60.0


class IdleConnections:
    """Up to ``keep`` open autocommit connections per dsn, checked with an empty query when taken.

    A connection whose block raised, or that is left inside a transaction, is closed instead of kept; one
    found dead when taken (the server restarted meanwhile) is replaced, and one idle for over
    :data:`MAX_IDLE_S` is closed unchecked::

        idle = IdleConnections(lambda dsn: psycopg.connect(dsn, autocommit=True), keep=8)
        with idle.connection(dsn) as conn:
            conn.execute("COMMIT PREPARED 'g1'")
        idle.close()  # the owner is done with it; a later call connects again and closes after itself
    """

    def __init__(self, connect: Callable[[str], psycopg.Connection], keep: int) -> None:
        self._connect = connect
        self._keep = keep
        self._lock = threading.Lock()
        self._idle: dict[str, list[tuple[psycopg.Connection, float]]] = {}  # with when each was given back
        self._closed = False

    @contextmanager
    def connection(self, dsn: str) -> Iterator[psycopg.Connection]:
        """An open connection to ``dsn``, kept for the next call if the block leaves it idle."""
        conn = self._take(dsn) or self._connect(dsn)
        try:
            yield conn
        except BaseException:
            conn.close()
            raise
        self._give(dsn, conn)

    def close(self) -> None:
        """Close the idle connections; connections in use are closed when given back."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, {}
        for conns in idle.values():
            for conn, _ in conns:
                conn.close()

    def _take(self, dsn: str) -> psycopg.Connection | None:
        while True:
            with self._lock:
                conns = self._idle.get(dsn)
                if not conns:
                    return None
                conn, given_back = conns.pop()
            if time.monotonic() - given_back > MAX_IDLE_S:
                conn.close()
                continue
            try:
                conn.execute("")  # a round trip: a server that restarted since has closed the socket
                return conn
            except psycopg.OperationalError:
                conn.close()

    def _give(self, dsn: str, conn: psycopg.Connection) -> None:
        if not conn.closed and conn.info.transaction_status == TransactionStatus.IDLE:
            with self._lock:
                conns = self._idle.setdefault(dsn, [])
                if not self._closed and len(conns) < self._keep:
                    conns.append((conn, time.monotonic()))
                    return
        conn.close()
