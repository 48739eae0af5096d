"""ZooKeeper client helpers shared by the writers, the coordinator and the CLI.

Usage::

    client = connect("127.0.0.1:2181")
    data = read_object(client, "/twophase/apps/orders", default={})
    watermark = read_epoch(client, "/twophase/apps/orders/queries/q1/watermark")   # -1 if none yet

Readers raise :class:`RecordError`, naming the znode and what is wrong, on data twophase did not write.
"""

from __future__ import annotations

import atexit
import json
import logging
import threading
import weakref
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from kazoo.client import KazooClient
from kazoo.exceptions import NodeExistsError, NoNodeError
from kazoo.protocol.states import KazooState, WatchedEvent, ZnodeStat
from kazoo.retry import KazooRetry

from coordinator.zk_poll import PollingHandler

# Connection loss is retried forever with capped backoff: a ZooKeeper restart
# must stall the pipeline, not fail it.
K = TypeVar("K")

_RETRY = dict(max_tries=-1, delay=0.05, backoff=2, max_delay=2.0)


log = logging.getLogger(__name__)

_exit_hooks: list[Callable[[], None]] = []
_clients: weakref.WeakSet[KazooClient] = weakref.WeakSet()


def connect(hosts: str, timeout: float = 15.0, session_timeout: float = 10.0) -> KazooClient:
    """A started KazooClient that reconnects forever, and is stopped at interpreter exit."""
    client = KazooClient(
        hosts=hosts,
        handler=PollingHandler(),
        timeout=session_timeout,
        connection_retry=KazooRetry(**_RETRY),
        command_retry=KazooRetry(**_RETRY),
    )
    client.start(timeout=timeout)
    _clients.add(client)
    # kazoo's handler registered its own exit hook in start(): it joins the client's callback threads
    # without stopping the client, so a watch callback retrying a read while ZooKeeper is away would
    # block the exit forever. Registered last, ours runs first (atexit is last in, first out).
    atexit.unregister(_at_exit)
    atexit.register(_at_exit)
    return client


def at_exit(hook: Callable[[], None]) -> None:
    """Run ``hook`` at interpreter exit while the clients :func:`connect` made are still running (for a
    graceful close that may still talk to ZooKeeper); they are stopped right after. Last in, first out."""
    _exit_hooks.append(hook)


def _at_exit() -> None:
    for hook in reversed(_exit_hooks):
        try:
            hook()
        except Exception:  # noqa: BLE001 - the other hooks and the clients' stop must still run
            log.exception("twophase exit hook %r failed", hook)
    for client in list(_clients):
        try:
            client.stop()  # a no-op for a client stopped already
        except Exception:  # noqa: BLE001 - the other clients must still be stopped
            log.exception("stopping a ZooKeeper client at exit failed")


_shared: dict[str, KazooClient] = {}
_shared_lock = threading.Lock()


def shared_client(hosts: str) -> KazooClient:
    """One client per process and ensemble, for Spark's reused Python workers."""
    with _shared_lock:
        client = _shared.get(hosts)
        if client is None:
            client = _shared[hosts] = connect(hosts)
        return client


_watched: dict[tuple[str, str], bytes] = {}  # (ensemble, path) -> its data, until a watch event drops it
_watchers: dict[tuple[str, str], Callable[[WatchedEvent], None]] = {}  # one per znode: kazoo keeps a set
_drops: dict[tuple[str, str], int] = {}  # how often each was dropped: a read that raced a drop is not kept
_listening: set[str] = set()  # ensembles whose client drops every cached znode when its session is lost
_watched_lock = threading.Lock()


def watched_data(hosts: str, path: str, fresh: bool = False) -> bytes:
    """``path``'s data (empty: no such znode), read through :func:`shared_client` and kept until it changes.

    The first call per process reads it and leaves a watch; later calls make no request until the watch
    fires (any change) or the session is lost. For a process that asks for one znode again and again
    (Spark's driver-side writer, twice a micro-batch). A change reaches the cache with its watch event, as
    it reaches any watcher; while the client is not connected the znode is read again, as it is with
    ``fresh`` (after a sync: for a caller about to refuse what the cache said). The watch only drops the
    data: reading in kazoo's event thread would block every other watch of the client (and its stop)
    while ZooKeeper is away::

        blob = watched_data("127.0.0.1:2181", "/twophase/apps/orders/sink")
    """
    client = shared_client(hosts)
    key = (hosts, path)
    with _watched_lock:
        if hosts not in _listening:
            client.add_listener(lambda state: _drop_all(hosts) if state == KazooState.LOST else None)
            _listening.add(hosts)
        cached = _watched.get(key)
        watcher = _watchers.setdefault(key, lambda _event: _drop(key))
        drops = _drops.get(key, 0)
    if cached is not None and not fresh and client.connected:
        return cached
    if fresh:
        client.retry(client.sync, path)
    try:
        data = client.retry(client.get, path, watch=watcher)[0]
    except NoNodeError:
        if client.retry(client.exists, path, watch=watcher) is not None:
            return watched_data(hosts, path, fresh)  # created meanwhile
        data = b""
    with _watched_lock:
        if _drops.get(key, 0) == drops:
            _watched[key] = data
    return data


def _drop(key: tuple[str, str]) -> None:
    with _watched_lock:
        _watched.pop(key, None)
        _drops[key] = _drops.get(key, 0) + 1


def _drop_all(hosts: str) -> None:
    """A lost session lost its watches too (kazoo forgets them without calling them)."""
    with _watched_lock:
        for key in [k for k in _watchers if k[0] == hosts]:  # a read in flight too: its watch is gone
            _watched.pop(key, None)
            _drops[key] = _drops.get(key, 0) + 1


class RecordError(ValueError):
    """A znode holds data twophase did not write (hand-edited, damaged, another program's).

    The message names the znode and what is wrong; the CLI prints it and exits 2.
    """


def dump(obj: Any) -> bytes:
    """JSON for a znode, keys sorted so that equal data is equal bytes."""
    return json.dumps(obj, sort_keys=True).encode()


def read_json(client: KazooClient, path: str, default: Any = None) -> Any:
    """The JSON stored at ``path``; ``default`` if the znode is missing or empty; RecordError if not JSON."""
    return parse_json(_data(client, path), path, default)


def parse_json(raw: bytes, path: str, default: Any = None) -> Any:
    """``raw``, read from the znode ``path``, as JSON; ``default`` if empty; RecordError if not JSON."""
    try:
        return json.loads(raw) if raw else default
    except ValueError as e:
        raise RecordError(f"znode {path}: not JSON ({e})") from None


def read_object(client: KazooClient, path: str, default: Any = None) -> Any:
    """The JSON object stored at ``path`` (``default`` if missing or empty); RecordError if it is no object."""
    return parse_object(_data(client, path), path, default)


def parse_object(raw: bytes, path: str, default: Any = None) -> Any:
    """``raw``, read from the znode ``path``, as a JSON object (``default`` if empty); RecordError if it is no
    object."""
    data = parse_json(raw, path)
    if data is None:
        return default
    if not isinstance(data, dict):
        raise RecordError(f"znode {path}: expected a JSON object, found {json.dumps(data)[:80]}")
    return data


def _data(client: KazooClient, path: str) -> bytes:
    """The znode's data; empty if it does not exist (readers treat both alike)."""
    try:
        return client.retry(client.get, path)[0]
    except NoNodeError:
        return b""


def read_epoch(client: KazooClient, path: str) -> int:
    """The ``"epoch"`` of a ``{"epoch": N, ...}`` znode (a watermark, a barrier); -1 if missing or empty."""
    data = read_object(client, path, {"epoch": -1})
    epoch = data.get("epoch")
    if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < -1:
        raise RecordError(f"znode {path}: \"epoch\" must be an integer >= -1, found {json.dumps(data)[:80]}")
    return epoch


def epoch_numbers(client: KazooClient, path: str) -> list[int]:
    """The children of an ``epochs`` znode as epoch numbers, ascending; RecordError on a name that is not one."""
    names = children(client, path)
    if bad := [n for n in names if not n.isdigit()]:
        raise RecordError(f"znode {path}/{bad[0]}: its name is not an epoch number")
    return sorted(int(n) for n in names)


def read_many(client: KazooClient, paths: Mapping[K, str]) -> list[tuple[K, bytes, ZnodeStat]]:
    """(key, data, stat) of each znode in ``paths`` (key -> path), read pipelined: one round trip for
    all, not one each. Znodes deleted meanwhile are left out."""
    pending = [(key, client.get_async(path)) for key, path in paths.items()]
    found = []
    for key, result in pending:
        try:
            raw, stat = result.get()
        except NoNodeError:
            continue
        found.append((key, raw, stat))
    return found


def children(client: KazooClient, path: str) -> list[str]:
    """The sorted child names of ``path``; none if it does not exist."""
    try:
        return sorted(client.retry(client.get_children, path))
    except NoNodeError:
        return []


def put_data(client: KazooClient, path: str, data: bytes, retry: bool = True) -> None:
    """Set ``path`` to ``data``, creating it (and its parents) with its data if it does not exist yet: no watch
    sees it empty. ``retry=False``: KazooException at once while ZooKeeper is away, not a retry for ever."""
    call = client.retry if retry else (lambda function, *args, **kwargs: function(*args, **kwargs))
    try:
        call(client.set, path, data)
    except NoNodeError:
        try:
            call(client.create, path, data, makepath=True)
        except NodeExistsError:  # another writer created it meanwhile
            call(client.set, path, data)
