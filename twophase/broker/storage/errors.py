"""Storage failures that are not Kafka protocol errors (those are in :mod:`twophase.wire.errors`)."""

from __future__ import annotations

import errno


class DataDirLockedError(RuntimeError):
    """Another process (or LogManager) already holds the data directory."""


class DiskFullError(OSError):
    """An append found no space (ENOSPC, EDQUOT, or a short write) and was undone: the segment holds exactly
    what it held before, so the log stays usable and the next append tries again."""


def is_disk_full(exc: BaseException) -> bool:
    """Whether ``exc`` says the disk (or the quota) has no space left."""
    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)


def raise_if_disk_full(exc: BaseException, where: str) -> None:
    """Raise ``exc`` as a DiskFullError (``where: strerror``) if it says there is no space; else return,
    and the caller re-raises it as it was."""
    if is_disk_full(exc):
        raise DiskFullError(exc.errno, f"{where}: {exc.strerror}") from exc


class MetadataFileError(ValueError):
    """A broker state file (``topics.json``, ``producer-ids.json``) is unreadable or not what the broker wrote.

    The message names the file and what is wrong with it; the broker refuses to start rather than guess.
    """
