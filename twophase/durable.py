"""Durable file helpers: atomic replace, durable removal and directory fsync.

Example::

    atomic_write("/data/topics.json", b"{}")   # readers see the old or the new file, never a torn one
"""

from __future__ import annotations

import os


def fsync_dir(directory: str) -> None:
    """Make a rename, creation or deletion in ``directory`` durable."""
    fsync_file(directory)  # a directory opened read-only fsyncs as a file does


def fsync_file(path: str) -> None:
    """Make what was written to the file at ``path`` durable (by whichever process wrote it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` via a temporary file, fsync and rename."""
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def remove_durably(path: str) -> None:
    """Delete ``path`` if it exists, and make the deletion durable (its directory fsynced)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        return
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def unlink_quietly(path: str) -> None:
    """Remove ``path``; a file that is not there is no error."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
