"""Reading a Spark streaming checkpoint: which micro-batches Spark completed.

Spark writes ``offsets/N`` before batch N runs and ``commits/N`` after all of
its tasks succeeded; a batch with ``commits/N`` is never re-run. So ``commits/N``
is the durable barrier for epoch N, readable by any process on the host.
Only local paths (or ``file:`` URIs) are read here.
"""

from __future__ import annotations

import json
import os
from urllib.parse import urlparse


def local_path(checkpoint: str) -> str:
    """The local filesystem path of a checkpoint location given as a path or a file: URI."""
    parsed = urlparse(checkpoint)
    if parsed.scheme in ("", "file"):
        return parsed.path if parsed.scheme else checkpoint
    raise ValueError(f"checkpoint {checkpoint!r}: only local paths and file: URIs are supported")


def checkpoint_query_id(checkpoint: str) -> str:
    """The id of the query whose checkpoint this is (its ``metadata``, written when the query first started).
    OSError or ValueError if it names none."""
    with open(os.path.join(local_path(checkpoint), "metadata")) as f:
        data = json.loads(f.readline())
    if not isinstance(data, dict) or not isinstance(data.get("id"), str):
        raise ValueError(f"{checkpoint}/metadata names no query id")
    return data["id"]


def belongs_to(checkpoint: str, query_id: str) -> bool:
    """Whether ``checkpoint`` is query ``query_id``'s (False if it cannot be read here)."""
    try:
        return checkpoint_query_id(checkpoint) == query_id
    except (OSError, ValueError):
        return False


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


def is_completed(checkpoint: str, epoch: int) -> bool:
    """Whether ``commits/<epoch>`` exists: one stat, cheap enough to poll (Spark renames the file into
    place, so it is never seen half-written). FileNotFoundError if ``commits`` is no directory here (a
    checkpoint on another host): no look could tell."""
    commits = os.path.join(local_path(checkpoint), "commits")
    if os.path.exists(os.path.join(commits, str(epoch))):
        return True
    if not os.path.isdir(commits):
        raise FileNotFoundError(f"no directory {commits}")
    return False


def highest_commit(checkpoint: str) -> int:
    """The highest batch id with commits/N, -1 before the first. FileNotFoundError if ``commits`` is no
    directory here (Spark makes it when the query starts: a checkpoint on another host): no look could tell."""
    commits = os.path.join(local_path(checkpoint), "commits")
    if not os.path.isdir(commits):
        raise FileNotFoundError(f"no directory {commits}")
    return max(_batch_ids(commits), default=-1)


# Spark's state store files per version: HDFS-backed (<v>.delta, <v>.snapshot), RocksDB (<v>.changelog, <v>.zip).
_STATE_SUFFIXES = (".delta", ".snapshot", ".changelog", ".zip")


def missing_state(checkpoint: str, version: int) -> list[str]:
    """State store directories of the checkpoint that no longer hold state ``version`` (the state
    batch ``version`` starts from, so re-running that batch needs it); [] for a stateless query or
    version 0 (empty state)."""
    root = os.path.join(local_path(checkpoint), "state")
    if version == 0 or not os.path.isdir(root):
        return []
    wanted = {f"{version}{suffix}" for suffix in _STATE_SUFFIXES}
    missing = []
    for directory, _, files in os.walk(root):
        versioned = [f for f in files if f.split(".", 1)[0].isdigit() and f.endswith(_STATE_SUFFIXES)]
        if versioned and not wanted & set(files):
            missing.append(os.path.relpath(directory, root))
    return sorted(missing)


def rewind(checkpoint: str, batch: int) -> list[str]:
    """Make Spark run ``batch`` again on its next start: remove commits/K for K >= batch, offsets/K
    for K > batch (offsets/``batch`` stays: Spark re-runs the batch with exactly those offsets), and
    state store files of versions above ``batch`` (written by the batches being undone; Spark would
    otherwise read a later version's snapshot of the discarded timeline). Returns the removed files,
    relative to the checkpoint. Idempotent."""
    root = local_path(checkpoint)
    doomed = [os.path.join("commits", str(k)) for k in completed_epochs(checkpoint) if k >= batch]
    doomed += [os.path.join("offsets", str(k)) for k in started_epochs(checkpoint) if k > batch]
    for directory, _, files in os.walk(os.path.join(root, "state")):
        doomed += [os.path.relpath(os.path.join(directory, f), root) for f in files
                   if f.endswith(_STATE_SUFFIXES) and f.split(".", 1)[0].isdigit() and int(f.split(".", 1)[0]) > batch]
    for relative in doomed:
        for path in (os.path.join(root, relative), _crc_of(os.path.join(root, relative))):
            try:
                os.remove(path)
            except FileNotFoundError:
                pass
    return doomed


def _crc_of(path: str) -> str:
    """Hadoop's checksum file beside ``path`` (written by Spark's local file system)."""
    directory, name = os.path.split(path)
    return os.path.join(directory, f".{name}.crc")
