"""Fencing tokens: only the latest owner of an app may change its 2PC state.

Taking ownership bumps the version of ``<app>/fence``; that version is the
owner's token. Every state change is a multi-op that first checks the token,
so a deposed owner (a paused leader, an old driver) fails atomically instead of
overwriting its successor's decisions. Like Flink's leader session id.

Usage::

    fence = Fence(client, paths.fence)
    fence.acquire("daemon host-1")
    txn = fence.transaction()
    txn.set_data(path, data)
    fence.commit(txn)          # raises Fenced if someone took over
"""

from __future__ import annotations

from kazoo.client import KazooClient, TransactionRequest
from kazoo.exceptions import BadVersionError, RolledBackError


class Fenced(RuntimeError):
    """Another coordinator took ownership; this one must stop."""


class Fence:
    """The ownership token of one app; see the module docstring for an example."""

    def __init__(self, client: KazooClient, path: str) -> None:
        self._client = client
        self.path = path
        self.token: int | None = None

    def acquire(self, owner: str) -> int:
        """Take ownership for ``owner`` (fencing the previous owner); return the new token."""
        self._client.retry(self._client.ensure_path, self.path)
        stat = self._client.retry(self._client.set, self.path, owner.encode())
        self.token = stat.version
        return self.token

    def check(self) -> None:
        """Raise Fenced unless the token is still current (one read)."""
        _, stat = self._client.retry(self._client.get, self.path)
        if stat.version != self.token:
            raise Fenced(f"{self.path}: ownership moved to token {stat.version}, ours is {self.token}")

    def transaction(self) -> TransactionRequest:
        """A multi-op that starts with the token check; run it with :meth:`commit`."""
        txn = self._client.transaction()
        txn.check(self.path, self.token)
        return txn

    def commit(self, txn: TransactionRequest) -> list:
        """Run a fenced multi-op; return per-op results, raise the first real error."""
        results = txn.commit()
        if isinstance(results[0], BadVersionError):
            raise Fenced(f"{self.path}: fenced, another coordinator owns this app")
        for result in results[1:]:
            if isinstance(result, Exception) and not isinstance(result, RolledBackError):
                raise result
        return results[1:]
