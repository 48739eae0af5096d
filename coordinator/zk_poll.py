"""A kazoo handler whose connection thread waits with one ``poll(2)`` per wait.

kazoo's threading handler waits through ``selector_select``, which builds an epoll selector, registers
the descriptors, waits and closes it again on every call: five system calls, several times per request
(the connection loop, each socket write, each read of a header and of a body). That halved the
requests a client can send per CPU second here (``bench/README.md``). ``poll`` takes any descriptor
number, as the selector does (a Spark driver may hold more than 1024), in one system call.

Usage::

    client = KazooClient(hosts="127.0.0.1:2181", handler=PollingHandler())
"""

from __future__ import annotations

import select
from typing import Any

from kazoo.handlers.threading import SequentialThreadingHandler
from kazoo.handlers.utils import fileobj_to_fd

_READABLE = select.POLLIN
_WRITABLE = select.POLLOUT
# Reported as ready for both, as kazoo's epoll selector reported them: the recv or send that follows raises.
_BROKEN = select.POLLERR | select.POLLHUP | select.POLLNVAL


class PollingHandler(SequentialThreadingHandler):
    """kazoo's :class:`SequentialThreadingHandler`, with ``select`` made of one ``poll(2)``.

    ::

        client = KazooClient(hosts="127.0.0.1:2181", handler=PollingHandler())
    """

    def select(self, rlist: list[Any], wlist: list[Any], xlist: list[Any],
               timeout: float | None = None) -> tuple[list[Any], list[Any], list[Any]]:
        """Like :func:`select.select` (kazoo's contract): the objects of each list that are ready."""
        if timeout is not None and timeout < 0:
            raise ValueError("timeout must be non-negative")
        wanted: dict[int, int] = {}
        for objects, events in ((rlist, _READABLE), (wlist, _WRITABLE)):
            for obj in objects:
                fd = fileobj_to_fd(obj)
                wanted[fd] = wanted.get(fd, 0) | events
        poller = select.poll()
        for fd, events in wanted.items():
            poller.register(fd, events)
        ready = dict(poller.poll(None if timeout is None else timeout * 1000))
        return ([obj for obj in rlist if ready.get(fileobj_to_fd(obj), 0) & (_READABLE | _BROKEN)],
                [obj for obj in wlist if ready.get(fileobj_to_fd(obj), 0) & (_WRITABLE | _BROKEN)],
                [])
