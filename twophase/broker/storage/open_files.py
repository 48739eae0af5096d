"""How many segment files a LogManager keeps open: a descriptor per partition does not scale.

A segment opens its log file when it is first used and keeps it while it is used; past
``capacity`` open files, the least recently used segments that have nothing unsynced close
theirs (they open it again on their next use), and if that is not enough, the least recently
used others are fsynced first (earlier than their flush interval asks, never later). A broker
with thousands of partitions then holds descriptors only for those in use, and starts under a
low ``ulimit -n``.

Only the thread that made the OpenFiles (the broker's event loop) counts and closes files: a
segment is used by one thread at a time, so closing it there never pulls a descriptor from under
a read. Segments opened in another thread (a topic created in a worker) are not counted; that
thread releases their files when it is done (``PartitionLog.release_files``).

Example::

    files = OpenFiles(OpenFiles.default_capacity())
    plog = PartitionLog(directory, config, open_files=files)
    files.open_count                            # at most files.capacity (unless all are unsynced)
"""

from __future__ import annotations

import collections
import resource
import threading
from typing import Protocol


class _File(Protocol):
    def idle(self) -> bool: ...

    def release_file(self, *, sync: bool = False) -> None: ...


class OpenFiles:
    """The open segment files of one LogManager, least recently used first (see the module docstring)."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, not {capacity}")
        self.capacity = capacity
        self._owner = threading.get_ident()
        self._lru: collections.OrderedDict[int, _File] = collections.OrderedDict()

    @staticmethod
    def default_capacity() -> int:
        """A quarter of the process's descriptor limit, at least 16: as many again go to the duplicates
        a periodic flush makes of unsynced files, the rest to connections and other files."""
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        return 1 << 18 if soft == resource.RLIM_INFINITY else max(16, soft // 4)

    @property
    def open_count(self) -> int:
        """Files counted as open now."""
        return len(self._lru)

    def used(self, file: _File) -> None:
        """``file`` was just used (opened or not): the most recently used now; close others past the capacity."""
        if threading.get_ident() != self._owner:
            return
        key = id(file)
        if key in self._lru:
            self._lru.move_to_end(key)
            return
        self._lru[key] = file
        for idle_only in (True, False):
            for other in list(self._lru.values()):
                if len(self._lru) <= self.capacity:
                    return
                if other is not file and (other.idle() or not idle_only):
                    other.release_file(sync=not idle_only)  # calls closed(), which drops it here

    def closed(self, file: _File) -> None:
        """``file`` closed its descriptor."""
        if threading.get_ident() == self._owner:
            self._lru.pop(id(file), None)
