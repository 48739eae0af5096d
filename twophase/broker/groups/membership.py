"""Group membership persisted across broker restarts: generation, protocol, leader and members.

Kafka writes a group's metadata to ``__consumer_offsets`` whenever a generation becomes Stable
(and when a static member is replaced) and, after a coordinator restart or failover, loads the
group Stable with its members, so members keep heartbeating and committing with their old
member id and generation instead of rejoining all at once. This store does the same with one
JSON file per group under ``<data dir>/groups/``, replaced atomically (``atomic_write``), next
to the committed-offsets files. A rebalance in progress is not persisted: after a restart the
group is back at its last Stable generation, and members of the interrupted rebalance rejoin.

Example::

    store = MembershipStore("/data/groups")
    store.save(group)                  # when it becomes Stable or Empty
    groups = store.load()              # {group id: Group}, after a restart
    store.delete("g")                  # the group was deleted (Empty, no offsets)
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os

from twophase.durable import atomic_write, remove_durably

from .group import Group, GroupState, Member

log = logging.getLogger("twophase.broker.groups")

FILE_VERSION = 1
_PREFIX = "members-"


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _member_json(m: Member) -> dict:
    return {"member_id": m.member_id, "group_instance_id": m.group_instance_id, "client_id": m.client_id,
            "client_host": m.client_host, "session_timeout_ms": m.session_timeout_ms,
            "rebalance_timeout_ms": m.rebalance_timeout_ms, "protocol_type": m.protocol_type,
            "protocols": [[name, _b64(meta)] for name, meta in m.protocols], "assignment": _b64(m.assignment)}


def _member(raw: dict) -> Member:
    return Member(str(raw["member_id"]), raw["group_instance_id"], str(raw["client_id"]), str(raw["client_host"]),
                  int(raw["session_timeout_ms"]), int(raw["rebalance_timeout_ms"]), str(raw["protocol_type"]),
                  tuple((str(name), base64.b64decode(meta)) for name, meta in raw["protocols"]),
                  base64.b64decode(raw["assignment"]))


class MembershipStore:
    """Reads and writes the membership files of a group directory."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        os.makedirs(directory, exist_ok=True)

    def _path(self, group_id: str) -> str:
        digest = hashlib.sha256(group_id.encode()).hexdigest()[:32]
        return os.path.join(self.directory, f"{_PREFIX}{digest}.json")

    def save(self, group: Group) -> None:
        """Persist ``group`` (Stable or Empty) durably before returning."""
        if group.state not in (GroupState.STABLE, GroupState.EMPTY):
            raise ValueError(f"group {group.group_id!r} is {group.state.value}: only Stable or Empty is saved")
        data = {"version": FILE_VERSION, "group_id": group.group_id, "generation": group.generation,
                "protocol_type": group.protocol_type, "protocol_name": group.protocol_name,
                "leader_id": group.leader_id, "members": [_member_json(m) for m in group.members.values()]}
        atomic_write(self._path(group.group_id), json.dumps(data, separators=(",", ":")).encode())

    def delete(self, group_id: str) -> None:
        """Durably remove the file of ``group_id``, if it has one."""
        remove_durably(self._path(group_id))

    def load(self) -> dict[str, Group]:
        """Every persisted group, Stable with its members (or Empty); unreadable files are logged and skipped."""
        groups: dict[str, Group] = {}
        for entry in sorted(os.listdir(self.directory)):
            if not (entry.startswith(_PREFIX) and entry.endswith(".json")):
                continue
            path = os.path.join(self.directory, entry)
            try:
                with open(path, "rb") as f:
                    raw = json.load(f)
                if raw.get("version") != FILE_VERSION:
                    raise ValueError(f"unknown file version {raw.get('version')!r}")
                group = Group.restored(str(raw["group_id"]), int(raw["generation"]), raw["protocol_type"],
                                       raw["protocol_name"], raw["leader_id"], [_member(m) for m in raw["members"]])
            except (OSError, ValueError, KeyError, TypeError) as exc:
                # atomic_write never leaves a torn file; anything unreadable was put there by hand.
                log.error("ignoring unreadable group membership file %s: %s", path, exc)
                continue
            groups[group.group_id] = group
        return groups
