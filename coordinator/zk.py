"""ZooKeeper client helpers shared by the writers, the coordinator and the CLI.

Usage::

    client = connect("127.0.0.1:2181")
    data = read_json(client, "/twophase/apps/orders", default={})
"""

from __future__ import annotations

import json
import threading
from typing import Any

from kazoo.client import KazooClient
from kazoo.exceptions import NoNodeError
from kazoo.retry import KazooRetry

# Connection loss is retried forever with capped backoff: a ZooKeeper restart
# must stall the pipeline, not fail it.
_RETRY = dict(max_tries=-1, delay=0.05, backoff=2, max_delay=2.0)


def connect(hosts: str, timeout: float = 15.0, session_timeout: float = 10.0) -> KazooClient:
    """A started KazooClient that reconnects forever."""
    client = KazooClient(
        hosts=hosts,
        timeout=session_timeout,
        connection_retry=KazooRetry(**_RETRY),
        command_retry=KazooRetry(**_RETRY),
    )
    client.start(timeout=timeout)
    return client


_shared: dict[str, KazooClient] = {}
_shared_lock = threading.Lock()


def shared_client(hosts: str) -> KazooClient:
    """One client per process and ensemble, for Spark's reused Python workers."""
    with _shared_lock:
        client = _shared.get(hosts)
        if client is None:
            client = _shared[hosts] = connect(hosts)
        return client


def dump(obj: Any) -> bytes:
    """JSON for a znode, keys sorted so that equal data is equal bytes."""
    return json.dumps(obj, sort_keys=True).encode()


def read_json(client: KazooClient, path: str, default: Any = None) -> Any:
    """The JSON stored at ``path``; ``default`` if the znode is missing or empty."""
    try:
        raw, _ = client.retry(client.get, path)
    except NoNodeError:
        return default
    return json.loads(raw) if raw else default


def children(client: KazooClient, path: str) -> list[str]:
    """The sorted child names of ``path``; none if it does not exist."""
    try:
        return sorted(client.retry(client.get_children, path))
    except NoNodeError:
        return []
