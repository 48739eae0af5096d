"""Fail a test that leaves file descriptors or non-daemon threads behind (used by tests/conftest.py).

Why: py4j's callback server uses select(), which cannot watch a descriptor numbered 1024 or
more. A pytest process that had accumulated ~1,000 descriptors from finished tests (segment
files and data-directory locks of brokers nobody stopped, deleted files still open) made a
later Spark test hang. So every test must give back what it opened.

How: ``/proc/self/fd`` is read before and after each test; a descriptor is identified by its
number *and* its target (``os.readlink``: a path, ``socket:[inode]``, ``pipe:[inode]``,
``anon_inode:[eventpoll]``...), so a number closed and reused for something else counts as
new. After the test (and after its function-scoped fixtures were torn down) the check waits,
bounded, while the set of new descriptors keeps shrinking: a broker's event-loop thread or a
client's I/O thread may still be closing what the test already asked it to close. Then one
garbage collection runs: what it releases belonged to an object nobody closed that a reference
cycle kept alive (a sqlite3 connection, a producer held by a pytest.raises traceback); that is
reported as a LeakWarning (it would have stayed open until some later collection), and fixed
where the object is made. Whatever is still open after it fails the test, listed by target:
descriptors owned by no object at all (a PartitionLog's raw ``os.open`` descriptors, a broker
never stopped) are never released by anyone.

What is not a leak: objects that live for the whole session on purpose and may be created
*during* some test (session fixtures are set up lazily, inside the first test that asks for
them). Each such owner is registered in :data:`SESSION_OWNERS` by the code that creates it, as a
function returning the descriptors it holds right now (see tests/conftest.py: the shared
ZooKeeper and PostgreSQL servers' log files, the Spark session's py4j sockets and the JVM's stdin pipe, the
per-process ZooKeeper clients of coordinator.zk.shared_client and the Spark driver hooks). Only
those exact descriptor numbers are ignored, looked up at check time (a restarted ZooKeeper
server reopens its log file under a new number). Likewise :data:`SESSION_THREADS` names the
non-daemon threads of such objects (py4j's callback server and its connections).
"""

from __future__ import annotations

import gc
import os
import threading
import time
from collections.abc import Callable, Iterable

# Functions returning descriptors (ints) owned by session-lifetime objects, and how many
# transient epoll descriptors those objects may hold at any moment (see session_epolls).
SESSION_OWNERS: list[Callable[[], Iterable[int]]] = []
SESSION_EPOLLS: list[Callable[[], int]] = []
# Predicates telling threads of session-lifetime objects (py4j's callback threads are not daemons).
SESSION_THREADS: list[Callable[[threading.Thread], bool]] = []

SETTLE_TIMEOUT_S = 10.0  # the longest the check waits for descriptors to be closed
STALL_S = 1.0  # ... and the longest it waits once nothing closed any more
_EPOLL = "anon_inode:[eventpoll]"


def open_descriptors() -> dict[int, str]:
    """This process's open descriptors: number -> readlink target."""
    out = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            out[int(name)] = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            pass  # the descriptor listdir itself used, closed by now
    return out


def _session_owned() -> set[int]:
    owned: set[int] = set()
    for owner in SESSION_OWNERS:
        try:
            owned.update(owner())
        except Exception:
            pass  # an owner being torn down has nothing to claim
    return owned


def _session_epolls() -> int:
    return sum(count() for count in SESSION_EPOLLS)


def new_descriptors(before: dict[int, str]) -> dict[int, str]:
    """Descriptors open now that were not open (with that target) in ``before``, minus session-owned ones."""
    now = open_descriptors()
    owned = _session_owned()
    new = {fd: target for fd, target in now.items() if before.get(fd) != target and fd not in owned}
    # A session-lifetime kazoo client creates an epoll selector for each select() call it makes
    # (kazoo.handlers.utils.selector_select), so it may hold one when the check runs.
    allowed_epolls = _session_epolls()
    for fd in sorted(fd for fd, target in new.items() if target == _EPOLL)[:allowed_epolls]:
        del new[fd]
    return new


def new_threads(before: set[threading.Thread]) -> list[threading.Thread]:
    """Non-daemon threads alive now that were not before (daemon threads die with the process)."""
    return [t for t in threading.enumerate() if t not in before and t.is_alive() and not t.daemon
            and not any(owned(t) for owned in SESSION_THREADS)]


def settle(before_fds: dict[int, str], before_threads: set[threading.Thread]):
    """Wait, bounded, while leftovers are still going away; returns (descriptors, threads) left, and the
    descriptors that only a garbage collection released (objects never closed, kept by a reference
    cycle: a sqlite3 connection, anything a pytest.raises traceback holds)."""
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    fds, threads = new_descriptors(before_fds), new_threads(before_threads)
    fewest = len(fds) + len(threads)
    last_progress = time.monotonic()
    interval = 0.005
    while fewest and time.monotonic() < deadline and time.monotonic() - last_progress < STALL_S:
        time.sleep(interval)
        interval = min(interval * 2, 0.1)
        fds, threads = new_descriptors(before_fds), new_threads(before_threads)
        if len(fds) + len(threads) < fewest:
            fewest = len(fds) + len(threads)
            last_progress = time.monotonic()
    collected: dict[int, str] = {}
    if fds:
        gc.collect()
        remaining = new_descriptors(before_fds)
        collected = {fd: target for fd, target in fds.items() if remaining.get(fd) != target}
        fds = remaining
    return fds, threads, collected


class LeakWarning(UserWarning):
    """A test left descriptors that only a garbage collection released."""


def describe(fds: dict[int, str], threads: list[threading.Thread]) -> str:
    lines = []
    if fds:
        lines.append(f"{len(fds)} file descriptor(s) left open:")
        lines += [f"  fd {fd}: {target}" for fd, target in sorted(fds.items())]
    if threads:
        lines.append(f"{len(threads)} non-daemon thread(s) left running:")
        lines += [f"  {t.name} ({t.__class__.__name__})" for t in threads]
    return "\n".join(lines)
