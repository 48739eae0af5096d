"""One consumer group's membership state (no I/O, no wire types).

The state machine follows Kafka's classic group coordinator::

    Empty ──join──▶ PreparingRebalance ──all joined / rebalance timeout──▶ CompletingRebalance
      ▲                 │  ▲                                                   │
      └─last member gone┘  └──────join/leave/expiry/sync timeout──────────────┤ leader's SyncGroup
                           └──────────────────join/leave/expiry─── Stable ◀────┘

Dead is reachable from every state (the broker shuts down) and leads nowhere. A group restored
from disk after a restart starts Stable (or Empty), as Kafka loads it.

Static members (KIP-345) carry a ``group_instance_id`` that outlives their member id: the
group maps each instance id to the member id currently holding it, and a request naming the
instance id with any other member id comes from a fenced (replaced) instance.

Example::

    group = Group("g")
    group.transition(GroupState.PREPARING_REBALANCE)   # IllegalTransition if TRANSITIONS forbids it
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum

from twophase.states import Transitions


class GroupState(enum.Enum):
    """Where a group is in its rebalance cycle (Kafka's classic group states)."""

    EMPTY = "Empty"
    PREPARING_REBALANCE = "PreparingRebalance"
    COMPLETING_REBALANCE = "CompletingRebalance"
    STABLE = "Stable"
    DEAD = "Dead"


# Dead is listed per state rather than as from_any: Dead -> Dead is not a move.
TRANSITIONS: Transitions[GroupState] = Transitions("group", {
    GroupState.EMPTY: {GroupState.PREPARING_REBALANCE, GroupState.DEAD},
    GroupState.PREPARING_REBALANCE: {GroupState.COMPLETING_REBALANCE, GroupState.EMPTY, GroupState.DEAD},
    GroupState.COMPLETING_REBALANCE: {GroupState.STABLE, GroupState.PREPARING_REBALANCE, GroupState.DEAD},
    GroupState.STABLE: {GroupState.PREPARING_REBALANCE, GroupState.DEAD},
    GroupState.DEAD: (),
})


@dataclasses.dataclass(frozen=True, slots=True)
class JoinResult:
    """The answer to one JoinGroup: an error code, or the generation, protocol and leader (and, for
    the leader, every member's metadata)."""

    error: int
    generation: int = -1
    protocol_type: str | None = None
    protocol_name: str | None = None
    leader: str = ""
    member_id: str = ""
    members: tuple[tuple[str, str | None, bytes], ...] = ()  # (member id, instance id, metadata), leader only


@dataclasses.dataclass(frozen=True, slots=True)
class SyncResult:
    """The answer to one SyncGroup: an error code, or the member's assignment."""

    error: int
    protocol_type: str | None = None
    protocol_name: str | None = None
    assignment: bytes = b""


@dataclasses.dataclass(eq=False)
class Member:
    """One member of a group: identity, timeouts, protocols, assignment, and its parked requests."""

    member_id: str
    group_instance_id: str | None
    client_id: str
    client_host: str
    session_timeout_ms: int
    rebalance_timeout_ms: int
    protocol_type: str
    protocols: tuple[tuple[str, bytes], ...]  # (name, metadata) in the member's preference order
    assignment: bytes = b""
    join_future: asyncio.Future | None = None  # set while a JoinGroup of this member is parked
    sync_future: asyncio.Future | None = None  # set while a SyncGroup of this member is parked
    expiry: asyncio.TimerHandle | None = None  # session timeout

    @property
    def awaiting_join(self) -> bool:
        """Whether a JoinGroup of this member is parked."""
        return self.join_future is not None and not self.join_future.done()

    @property
    def awaiting_sync(self) -> bool:
        """Whether a SyncGroup of this member is parked."""
        return self.sync_future is not None and not self.sync_future.done()

    def protocol_names(self) -> list[str]:
        """The member's protocol names in its order of preference."""
        return [name for name, _ in self.protocols]

    def metadata_for(self, protocol: str) -> bytes:
        """The metadata the member sent for ``protocol``; StopIteration if it did not name it."""
        return next(meta for name, meta in self.protocols if name == protocol)


class Group:
    """Members, generation, selected protocol and state of one group."""

    def __init__(self, group_id: str) -> None:
        self.group_id = group_id
        self.state = GroupState.EMPTY
        self.generation = 0
        self.protocol_type: str | None = None
        self.protocol_name: str | None = None
        self.leader_id: str | None = None
        self.members: dict[str, Member] = {}
        self.pending: dict[str, asyncio.TimerHandle] = {}  # ids handed out with MEMBER_ID_REQUIRED
        self.timer: asyncio.TimerHandle | None = None  # initial delay, rebalance timeout or sync timeout
        self.static_members: dict[str, str] = {}  # group instance id -> member id holding it
        self.delaying_initial_join = False  # the first rebalance waits for more members to arrive
        self.member_added_during_delay = False

    @classmethod
    def restored(cls, group_id: str, generation: int, protocol_type: str | None, protocol_name: str | None,
                 leader_id: str | None, members: list[Member]) -> Group:
        """A group as persisted at its last Stable (or Empty) point: Stable if it has members."""
        group = cls(group_id)
        group.generation = generation
        for m in members:
            group.add(m)
        if members:
            group.state = GroupState.STABLE
            group.protocol_type, group.protocol_name = protocol_type, protocol_name
            group.leader_id = leader_id if leader_id in group.members else members[0].member_id
        return group

    def transition(self, target: GroupState) -> None:
        """Move to ``target``; IllegalTransition (a coordinator bug) if TRANSITIONS forbids it."""
        self.state = TRANSITIONS.check(self.state, target, repr(self.group_id))

    def add(self, member: Member) -> None:
        """Add ``member``, registering its instance id; the first member becomes the leader."""
        self.members[member.member_id] = member
        if member.group_instance_id is not None:
            self.static_members[member.group_instance_id] = member.member_id
        if self.leader_id is None:
            self.leader_id = member.member_id

    def remove(self, member_id: str) -> None:
        """Remove the member if present; leadership passes to another member (None if none is left)."""
        member = self.members.pop(member_id, None)
        if member is not None and self.static_members.get(member.group_instance_id) == member_id:
            del self.static_members[member.group_instance_id]
        if self.leader_id == member_id:
            self.leader_id = next(iter(self.members), None)

    def replace_static(self, instance_id: str, new_member_id: str) -> Member:
        """Hand the place (assignment, leadership) of ``instance_id``'s member to ``new_member_id``."""
        member = self.members.pop(self.static_members[instance_id])
        was_leader = self.leader_id == member.member_id
        member.member_id = new_member_id
        self.members[new_member_id] = member
        self.static_members[instance_id] = new_member_id
        if was_leader:
            self.leader_id = new_member_id
        return member

    def fenced(self, instance_id: str | None, member_id: str) -> bool:
        """Whether a request from (``instance_id``, ``member_id``) comes from a replaced static member."""
        return instance_id is not None and self.static_members.get(instance_id, member_id) != member_id

    def cancel_timer(self) -> None:
        """Cancel the group's pending timer (initial delay, rebalance or sync timeout), if any."""
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def supports(self, protocol_type: str, names: list[str]) -> bool:
        """Whether a member with this protocol type and these protocols can be in the group."""
        if not names:
            return False
        if not self.members:
            return True
        return protocol_type == self.protocol_type and bool(self.candidates() & set(names))

    def candidates(self) -> set[str]:
        """Protocols every member supports."""
        sets = [set(m.protocol_names()) for m in self.members.values()]
        return set.intersection(*sets) if sets else set()

    def select_protocol(self) -> str:
        """Each member votes for its most preferred protocol that all support; most votes wins."""
        candidates = self.candidates()
        votes: dict[str, int] = {}
        for m in self.members.values():
            choice = next(name for name in m.protocol_names() if name in candidates)
            votes[choice] = votes.get(choice, 0) + 1
        return max(votes, key=lambda name: votes[name])

    def max_rebalance_timeout_ms(self) -> int:
        """The largest rebalance timeout of the members (0 without members)."""
        return max((m.rebalance_timeout_ms for m in self.members.values()), default=0)

    def all_joined(self) -> bool:
        """Whether every member has a JoinGroup parked and no handed-out member id is still expected."""
        return not self.pending and all(m.awaiting_join for m in self.members.values())
