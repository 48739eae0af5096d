"""Committed consumer-group offsets, persisted durably in the data directory.

One JSON file per group under ``<data dir>/groups/``, replaced atomically (write, fsync,
rename, fsync the directory) on every commit, so an acknowledged commit survives a crash and a
torn write leaves the previous version. The file name is a hash of the group id (group ids can
be any string); the id itself is stored inside the file.

Example::

    store = OffsetStore("/data/groups")
    store.commit("g", {("t", 0): CommittedOffset(42, -1, "", now_ms)})
    store.get("g", "t", 0).offset   # 42, also after a restart
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os

from twophase.durable import atomic_write

log = logging.getLogger("twophase.broker.groups")

FILE_VERSION = 1


@dataclasses.dataclass(frozen=True, slots=True)
class CommittedOffset:
    offset: int
    leader_epoch: int
    metadata: str | None
    commit_timestamp_ms: int


class OffsetStore:
    """Committed offsets of every group; loaded at construction, written through on commit."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        os.makedirs(directory, exist_ok=True)
        self._offsets: dict[str, dict[tuple[str, int], CommittedOffset]] = {}
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
                offsets = {(t, int(p)): CommittedOffset(int(o), int(e), m, int(ts))
                           for t, parts in raw["offsets"].items() for p, (o, e, m, ts) in parts.items()}
            except (OSError, ValueError, KeyError, TypeError) as exc:
                # atomic_write never leaves a torn file; anything unreadable was put there by hand.
                log.error("ignoring unreadable offsets file %s: %s", path, exc)
                continue
            self._offsets[group_id] = offsets
        if self._offsets:
            log.info("loaded committed offsets of %d groups", len(self._offsets))

    def groups(self) -> list[str]:
        return list(self._offsets)

    def get(self, group_id: str, topic: str, partition: int) -> CommittedOffset | None:
        return self._offsets.get(group_id, {}).get((topic, partition))

    def all(self, group_id: str) -> dict[tuple[str, int], CommittedOffset]:
        return dict(self._offsets.get(group_id, {}))

    def commit(self, group_id: str, offsets: dict[tuple[str, int], CommittedOffset]) -> None:
        """Record ``offsets`` and make them durable before returning."""
        if not offsets:
            return
        merged = dict(self._offsets.get(group_id, {}))
        merged.update(offsets)
        self._write(group_id, merged)
        self._offsets[group_id] = merged

    def delete_topic(self, topic: str) -> None:
        """Forget every group's offsets for ``topic`` (the topic was deleted)."""
        for group_id, offsets in list(self._offsets.items()):
            kept = {k: v for k, v in offsets.items() if k[0] != topic}
            if len(kept) != len(offsets):
                self._write(group_id, kept)
                self._offsets[group_id] = kept

    def _write(self, group_id: str, offsets: dict[tuple[str, int], CommittedOffset]) -> None:
        by_topic: dict[str, dict[str, list]] = {}
        for (topic, partition), c in offsets.items():
            by_topic.setdefault(topic, {})[str(partition)] = [c.offset, c.leader_epoch, c.metadata,
                                                              c.commit_timestamp_ms]
        data = {"version": FILE_VERSION, "group_id": group_id, "offsets": by_topic}
        atomic_write(self._path(group_id), json.dumps(data, separators=(",", ":")).encode())
