"""Reading a Spark streaming checkpoint: which micro-batches Spark completed.

Spark writes ``offsets/N`` before batch N runs and ``commits/N`` after all of
its tasks succeeded; a batch with ``commits/N`` is never re-run. So ``commits/N``
is the durable barrier for epoch N, readable by any process on the host.
Only local paths (or ``file:`` URIs) are read here.
"""

from __future__ import annotations

import os
from urllib.parse import urlparse


def local_path(checkpoint: str) -> str:
    """The local filesystem path of a checkpoint location given as a path or a file: URI."""
    parsed = urlparse(checkpoint)
    if parsed.scheme in ("", "file"):
        return parsed.path if parsed.scheme else checkpoint
    raise ValueError(f"checkpoint {checkpoint!r}: only local paths and file: URIs are supported")


def _batch_ids(directory: str) -> list[int]:
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    return sorted(int(n) for n in names if n.isdigit())


def started_epochs(checkpoint: str) -> list[int]:
    """Batch ids that have offsets/N (written before batch N runs), in ascending order."""
    return _batch_ids(os.path.join(local_path(checkpoint), "offsets"))


def completed_epochs(checkpoint: str) -> list[int]:
    """Batch ids that have commits/N, in ascending order."""
    return _batch_ids(os.path.join(local_path(checkpoint), "commits"))


def last_completed_epoch(checkpoint: str) -> int | None:
    """The highest batch id with commits/N, or None before the first batch completes."""
    done = completed_epochs(checkpoint)
    return done[-1] if done else None
