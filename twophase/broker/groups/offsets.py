"""Committed consumer-group offsets, persisted durably in the data directory.

One JSON file per group under ``<data dir>/groups/``, replaced atomically (write, fsync,
rename, fsync the directory) on every commit, so an acknowledged commit survives a crash and a
torn write leaves the previous version. The file name is a hash of the group id (group ids can
be any string); the id itself is stored inside the file.

Transactional offset commits (KIP-98/KIP-447) are staged per producer id in the same file as
pending offsets: they survive a restart while their transaction is open, become committed
offsets when it commits and vanish when it aborts. OffsetFetch with require_stable asks
:meth:`OffsetStore.has_pending`.

A group left with neither committed nor staged offsets (its topics were deleted, its only
transaction aborted) has its file deleted and ``on_forgotten(group_id)`` called, so the group
coordinator can delete the group too, as Kafka's group metadata cleanup does.

Example::

    store = OffsetStore("/data/groups")
    store.commit("g", {("t", 0): CommittedOffset(42, -1, "", now_ms)})
    store.get("g", "t", 0).offset   # 42, also after a restart
    store.stage("g", producer_id, {("t", 0): CommittedOffset(50, -1, "", now_ms)})
    store.complete_pending("g", producer_id, commit=True)   # now 50
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from collections.abc import Callable

from twophase.durable import atomic_write, remove_durably, unlink_quietly

log = logging.getLogger("twophase.broker.groups")

FILE_VERSION = 1


@dataclasses.dataclass(frozen=True, slots=True)
class CommittedOffset:
    """One committed offset of a group for one partition, with its leader epoch, metadata and commit time."""
    offset: int
    leader_epoch: int
    metadata: str | None
    commit_timestamp_ms: int


class OffsetStore:
    """Committed offsets of every group; loaded at construction, written through on commit."""

    def __init__(self, directory: str, on_forgotten: Callable[[str], None] | None = None) -> None:
        self.directory = directory
        self.on_forgotten = on_forgotten
        os.makedirs(directory, exist_ok=True)
        self._offsets: dict[str, dict[tuple[str, int], CommittedOffset]] = {}
        # group id -> producer id -> staged offsets of its open transaction
        self._pending: dict[str, dict[int, dict[tuple[str, int], CommittedOffset]]] = {}
        self._load()

    def _path(self, group_id: str) -> str:
        digest = hashlib.sha256(group_id.encode()).hexdigest()[:32]
        return os.path.join(self.directory, f"offsets-{digest}.json")

    def _load(self) -> None:
        for entry in sorted(os.listdir(self.directory)):
            if not (entry.startswith("offsets-") and entry.endswith(".json")):
                continue
            path = os.path.join(self.directory, entry)
            try:
                with open(path, "rb") as f:
                    raw = json.load(f)
                group_id = raw["group_id"]
                offsets = _decode(raw["offsets"])
                pending = {int(pid): _decode(staged) for pid, staged in raw.get("pending", {}).items()}
            except (OSError, ValueError, KeyError, TypeError) as exc:
                # atomic_write never leaves a torn file; anything unreadable was put there by hand.
                log.error("ignoring unreadable offsets file %s: %s", path, exc)
                continue
            if not (offsets or pending):  # left by a version that kept the files of emptied groups
                unlink_quietly(path)
            if offsets:
                self._offsets[group_id] = offsets
            if pending:
                self._pending[group_id] = pending
        if self._offsets:
            log.info("loaded committed offsets of %d groups", len(self._offsets))

    def groups(self) -> list[str]:
        """Every group with committed or staged offsets."""
        return list(dict.fromkeys([*self._offsets, *self._pending]))

    def has_offsets(self, group_id: str) -> bool:
        """Whether ``group_id`` has committed or staged offsets."""
        return group_id in self._offsets or group_id in self._pending

    def get(self, group_id: str, topic: str, partition: int) -> CommittedOffset | None:
        """The committed offset of the partition, or None."""
        return self._offsets.get(group_id, {}).get((topic, partition))

    def all(self, group_id: str) -> dict[tuple[str, int], CommittedOffset]:
        """A copy of every committed offset of the group, by (topic, partition)."""
        return dict(self._offsets.get(group_id, {}))

    def commit(self, group_id: str, offsets: dict[tuple[str, int], CommittedOffset]) -> None:
        """Record ``offsets`` and make them durable before returning."""
        if not offsets:
            return
        merged = dict(self._offsets.get(group_id, {}))
        merged.update(offsets)
        self._store(group_id, merged, self._pending.get(group_id, {}))

    # -- transactional offsets -------------------------------------------------------------------

    def stage(self, group_id: str, producer_id: int, offsets: dict[tuple[str, int], CommittedOffset]) -> None:
        """Durably record ``offsets`` as pending for the open transaction of ``producer_id``."""
        pending = {pid: dict(staged) for pid, staged in self._pending.get(group_id, {}).items()}
        pending.setdefault(producer_id, {}).update(offsets)
        self._store(group_id, self._offsets.get(group_id, {}), pending)

    def complete_pending(self, group_id: str, producer_id: int, commit: bool) -> None:
        """Apply (commit) or drop (abort) what ``producer_id`` staged; a no-op if nothing is staged."""
        pending = dict(self._pending.get(group_id, {}))
        staged = pending.pop(producer_id, None)
        if staged is None:
            return
        offsets = dict(self._offsets.get(group_id, {}))
        if commit:
            offsets.update(staged)
        self._store(group_id, offsets, pending)

    def has_pending(self, group_id: str, topic: str, partition: int) -> bool:
        """Whether an open transaction has staged an offset for the partition."""
        return any((topic, partition) in staged for staged in self._pending.get(group_id, {}).values())

    def pending_producers(self) -> list[tuple[str, int]]:
        """(group id, producer id) of every staged transactional commit."""
        return [(g, pid) for g, by_producer in self._pending.items() for pid in by_producer]

    def delete_topic(self, topic: str) -> None:
        """Forget every group's offsets for ``topic`` (the topic was deleted)."""
        for group_id in set(self._offsets) | set(self._pending):
            offsets = self._offsets.get(group_id, {})
            pending = self._pending.get(group_id, {})
            kept = {k: v for k, v in offsets.items() if k[0] != topic}
            kept_pending = {pid: {k: v for k, v in staged.items() if k[0] != topic} for pid, staged in pending.items()}
            if len(kept) != len(offsets) or kept_pending != pending:
                self._store(group_id, kept, kept_pending)

    def _store(self, group_id: str, offsets: dict[tuple[str, int], CommittedOffset],
               pending: dict[int, dict[tuple[str, int], CommittedOffset]]) -> None:
        """Make ``offsets`` and ``pending`` the group's, durably; with both empty, forget the group."""
        if offsets or pending:
            self._write(group_id, offsets, pending)
        else:
            remove_durably(self._path(group_id))
        for by_group, value in ((self._offsets, offsets), (self._pending, pending)):
            if value:
                by_group[group_id] = value
            else:
                by_group.pop(group_id, None)
        if not (offsets or pending) and self.on_forgotten is not None:
            self.on_forgotten(group_id)

    def _write(self, group_id: str, offsets: dict[tuple[str, int], CommittedOffset],
               pending: dict[int, dict[tuple[str, int], CommittedOffset]]) -> None:
        data = {"version": FILE_VERSION, "group_id": group_id, "offsets": _encode(offsets)}
        if pending:
            data["pending"] = {str(pid): _encode(staged) for pid, staged in pending.items()}
        atomic_write(self._path(group_id), json.dumps(data, separators=(",", ":")).encode())


def _encode(offsets: dict[tuple[str, int], CommittedOffset]) -> dict[str, dict[str, list]]:
    by_topic: dict[str, dict[str, list]] = {}
    for (topic, partition), c in offsets.items():
        by_topic.setdefault(topic, {})[str(partition)] = [c.offset, c.leader_epoch, c.metadata, c.commit_timestamp_ms]
    return by_topic


def _decode(by_topic: dict) -> dict[tuple[str, int], CommittedOffset]:
    return {(t, int(p)): CommittedOffset(int(o), int(e), m, int(ts))
            for t, parts in by_topic.items() for p, (o, e, m, ts) in parts.items()}
