"""The group coordinator: JoinGroup/SyncGroup/Heartbeat/LeaveGroup/OffsetCommit/OffsetFetch logic.

Handlers in :mod:`twophase.broker.apis` translate wire messages to calls here and results back;
nothing here knows about kio. Everything runs on the broker's event loop (construct it there
too): a JoinGroup or SyncGroup that has to wait for other members awaits a future, and session
timeouts, rebalance timeouts, sync timeouts and the initial rebalance delay are
``loop.call_later`` timers (no polling).

Beyond the basic protocol, as Kafka's classic coordinator does:

- static membership (KIP-345): a member joining with a ``group_instance_id`` the group already
  knows takes over that member's place (assignment, leadership) under a new member id without a
  rebalance while the group is Stable; requests naming the instance id with the replaced member
  id get FENCED_INSTANCE_ID. Static members skip the MEMBER_ID_REQUIRED round and are not
  dropped for missing a rebalance (only by their session timeout or a LeaveGroup);
- the initial rebalance delay (group.initial.rebalance.delay.ms): the first rebalance of an
  empty group waits that long, and again (up to the rebalance timeout) while new members keep
  arriving, so a group whose consumers start together forms in one generation;
- membership persisted (:mod:`.membership`) whenever the group becomes Stable or Empty and
  reloaded on start, so after a broker restart members heartbeat and commit with their old
  member id and generation;
- a rebalance in which no member rejoined is postponed (another rebalance timeout) rather than
  completed with a generation nobody was told about; session timeouts remove the silent members;
- group deletion (Kafka's group metadata cleanup, done here as soon as it applies): a group that
  is Empty, has no member id handed out with MEMBER_ID_REQUIRED and no committed or staged offsets
  is forgotten, in memory and on disk.

Example::

    coordinator = GroupCoordinator("/data/groups")
    result = await coordinator.join("g", "", "client", "127.0.0.1", 10_000, 60_000, "consumer",
                                    [("range", b"...")], require_known_member_id=True)
    # result.error == MEMBER_ID_REQUIRED; join again with result.member_id
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

from .group import Group, GroupState, JoinResult, Member, SyncResult
from .membership import MembershipStore
from .offsets import CommittedOffset, OffsetStore

log = logging.getLogger("twophase.broker.groups")

NONE = 0
OFFSET_METADATA_TOO_LARGE = 12
COORDINATOR_NOT_AVAILABLE = 15
ILLEGAL_GENERATION = 22
INCONSISTENT_GROUP_PROTOCOL = 23
INVALID_GROUP_ID = 24
UNKNOWN_MEMBER_ID = 25
INVALID_SESSION_TIMEOUT = 26
REBALANCE_IN_PROGRESS = 27
MEMBER_ID_REQUIRED = 79
FENCED_INSTANCE_ID = 82

MIN_SESSION_TIMEOUT_MS = 1_000
MAX_SESSION_TIMEOUT_MS = 1_800_000
MAX_METADATA_BYTES = 4096
DEFAULT_REBALANCE_TIMEOUT_MS = 60_000


class GroupCoordinator:
    """The classic consumer-group protocol: membership, rebalances and committed offsets.

    Groups and offsets are persisted under ``directory``. Construct and call it
    on the broker's event loop: join() and sync() are coroutines that may wait
    for the other members. Requests are answered with Kafka error codes (0 is
    NONE), not exceptions.

    Usage::

        coordinator = GroupCoordinator("/data/groups")
        joined = await coordinator.join("g", "", "client", "127.0.0.1", 10_000, 60_000, "consumer",
                                        [("range", b"...")], require_known_member_id=False)
        synced = await coordinator.sync("g", joined.generation, joined.member_id, "consumer",
                                        joined.protocol_name, {joined.member_id: b"assignment"})
        coordinator.heartbeat("g", joined.generation, joined.member_id)     # 0, or 27 while rebalancing
        coordinator.commit_offsets("g", {("t", 0): (42, -1, None)})
        coordinator.committed("g", "t", 0).offset                           # 42, also after a restart
        coordinator.close()
    """
    def __init__(self, directory: str, *, min_session_timeout_ms: int = MIN_SESSION_TIMEOUT_MS,
                 max_session_timeout_ms: int = MAX_SESSION_TIMEOUT_MS) -> None:
        self.offsets = OffsetStore(directory, on_forgotten=self._offsets_forgotten)
        self.membership = MembershipStore(directory)
        self.groups: dict[str, Group] = self.membership.load()
        self.min_session_timeout_ms = min_session_timeout_ms
        self.max_session_timeout_ms = max_session_timeout_ms
        self._closed = False
        for group in list(self.groups.values()):
            self._maybe_delete(group)  # saved Empty before its offsets went away
        for group in self.groups.values():
            # As after a coordinator failover in Kafka: every member gets a fresh session.
            for m in group.members.values():
                self._heartbeat_received(group, m)
        restored = [g for g in self.groups.values() if g.members]
        if restored:
            log.info("restored %d groups with %d members", len(restored), sum(len(g.members) for g in restored))

    def close(self) -> None:
        """Cancel every timer and answer every parked request (the broker is stopping)."""
        self._closed = True
        for group in self.groups.values():
            group.cancel_timer()
            for handle in group.pending.values():
                handle.cancel()
            for m in group.members.values():
                if m.expiry is not None:
                    m.expiry.cancel()
                _resolve(m.join_future, JoinResult(COORDINATOR_NOT_AVAILABLE, member_id=m.member_id))
                _resolve(m.sync_future, SyncResult(COORDINATOR_NOT_AVAILABLE))
            group.transition(GroupState.DEAD)
        self.groups.clear()

    # -- JoinGroup -------------------------------------------------------------------------------

    async def join(self, group_id: str, member_id: str, client_id: str, client_host: str,
                   session_timeout_ms: int, rebalance_timeout_ms: int, protocol_type: str,
                   protocols: list[tuple[str, bytes]], *, require_known_member_id: bool,
                   group_instance_id: str | None = None, initial_rebalance_delay_ms: int = 0) -> JoinResult:
        """Join (or rejoin) ``group_id``; waits until the rebalance completes. ``initial_rebalance_delay_ms``
        applies when this join starts the first rebalance of an empty group."""
        if self._closed:
            return JoinResult(COORDINATOR_NOT_AVAILABLE, member_id=member_id)
        if not group_id:
            return JoinResult(INVALID_GROUP_ID, member_id=member_id)
        if not self.min_session_timeout_ms <= session_timeout_ms <= self.max_session_timeout_ms:
            return JoinResult(INVALID_SESSION_TIMEOUT, member_id=member_id)
        names = [name for name, _ in protocols]
        group = self.groups.get(group_id)
        if member_id == "" or (group is not None and member_id in group.pending):
            if group is None:
                group = Group(group_id)
            if not group.supports(protocol_type, names):
                return JoinResult(INCONSISTENT_GROUP_PROTOCOL, member_id=member_id)
            self.groups.setdefault(group_id, group)
            if member_id == "":
                member_id = f"{group_instance_id or client_id or 'member'}-{uuid.uuid4()}"
                if group_instance_id is not None and group_instance_id in group.static_members:
                    return await self._replace_static(group, group_instance_id, member_id, client_id, client_host,
                                                      session_timeout_ms, rebalance_timeout_ms, protocols)
                if require_known_member_id and group_instance_id is None:  # static members skip KIP-394
                    # KIP-394: hand out the id first; the member joins for real with it.
                    loop = asyncio.get_running_loop()
                    group.pending[member_id] = loop.call_later(session_timeout_ms / 1000, self._expire_pending,
                                                               group, member_id)
                    return JoinResult(MEMBER_ID_REQUIRED, member_id=member_id)
            else:
                group.pending.pop(member_id).cancel()
            member = Member(member_id, group_instance_id, client_id, client_host, session_timeout_ms,
                            rebalance_timeout_ms, protocol_type, tuple(protocols))
            return await self._add_and_park(group, member, initial_rebalance_delay_ms)
        if group is not None and group.fenced(group_instance_id, member_id):
            return JoinResult(FENCED_INSTANCE_ID, member_id=member_id)
        if group is None or member_id not in group.members:
            return JoinResult(UNKNOWN_MEMBER_ID, member_id=member_id)
        member = group.members[member_id]
        if group.state in (GroupState.EMPTY, GroupState.DEAD):
            return JoinResult(UNKNOWN_MEMBER_ID, member_id=member_id)
        if not group.supports(protocol_type, names):
            return JoinResult(INCONSISTENT_GROUP_PROTOCOL, member_id=member_id)
        member.client_id, member.client_host = client_id, client_host
        member.session_timeout_ms, member.rebalance_timeout_ms = session_timeout_ms, rebalance_timeout_ms
        same = tuple(protocols) == member.protocols
        if group.state is GroupState.COMPLETING_REBALANCE and same:
            return self._join_result(group, member)
        if group.state is GroupState.STABLE and same and member_id != group.leader_id:
            self._heartbeat_received(group, member)
            return self._join_result(group, member)
        member.protocols = tuple(protocols)
        fut = self._park_join(member)
        if group.state is GroupState.PREPARING_REBALANCE:
            self._maybe_complete_join(group)
        else:
            self._prepare_rebalance(group, f"member {member_id} rejoined")
        return await self._await_join(group, member, fut)

    async def _add_and_park(self, group: Group, member: Member, initial_rebalance_delay_ms: int) -> JoinResult:
        group.add(member)
        if len(group.members) == 1:
            group.protocol_type = member.protocol_type
        group.member_added_during_delay = group.delaying_initial_join
        fut = self._park_join(member)
        # Its session starts now: a static member whose join is cancelled stays, and must time out.
        self._heartbeat_received(group, member)
        log.info("group %s: member %s (%s, %s%s) joins", group.group_id, member.member_id, member.client_id,
                 member.client_host, f", instance {member.group_instance_id}" if member.group_instance_id else "")
        if group.state is GroupState.EMPTY and initial_rebalance_delay_ms > 0:
            self._start_initial_delay(group, initial_rebalance_delay_ms)
        elif group.state is GroupState.PREPARING_REBALANCE:
            self._maybe_complete_join(group)
        else:
            self._prepare_rebalance(group, f"member {member.member_id} joined")
        return await self._await_join(group, member, fut)

    async def _replace_static(self, group: Group, instance_id: str, member_id: str, client_id: str,
                              client_host: str, session_timeout_ms: int, rebalance_timeout_ms: int,
                              protocols: list[tuple[str, bytes]]) -> JoinResult:
        """A known static member restarted: the new instance takes the old one's place (KIP-345)."""
        old = group.members[group.static_members[instance_id]]
        old_id, leader = old.member_id, group.leader_id
        _resolve(old.join_future, JoinResult(FENCED_INSTANCE_ID, member_id=old_id))
        _resolve(old.sync_future, SyncResult(FENCED_INSTANCE_ID))
        old.join_future = old.sync_future = None
        member = group.replace_static(instance_id, member_id)
        member.client_id, member.client_host = client_id, client_host
        member.session_timeout_ms, member.rebalance_timeout_ms = session_timeout_ms, rebalance_timeout_ms
        member.protocols = tuple(protocols)
        log.info("group %s: static member %s rejoins as %s (was %s)", group.group_id, instance_id, member_id, old_id)
        self._heartbeat_received(group, member)
        if group.state is GroupState.STABLE and group.select_protocol() == group.protocol_name:
            self._save(group)
            # The old leader id, so a replaced leader does not compute an assignment a Stable group
            # would never hand out; the member gets its kept assignment from SyncGroup.
            return JoinResult(NONE, group.generation, group.protocol_type, group.protocol_name, leader or "",
                              member_id)
        fut = self._park_join(member)
        if group.state is GroupState.PREPARING_REBALANCE:
            self._maybe_complete_join(group)
        else:
            self._prepare_rebalance(group, f"static member {instance_id} rejoined as {member_id}")
        return await self._await_join(group, member, fut)

    def _start_initial_delay(self, group: Group, delay_ms: int) -> None:
        group.cancel_timer()
        group.transition(GroupState.PREPARING_REBALANCE)
        group.delaying_initial_join, group.member_added_during_delay = True, False
        remaining_ms = max(group.max_rebalance_timeout_ms() - delay_ms, 0)
        group.timer = asyncio.get_running_loop().call_later(delay_ms / 1000, self._initial_delay_expired, group,
                                                            delay_ms, remaining_ms)
        log.info("group %s: first rebalance in %d ms (waiting for more members)", group.group_id, delay_ms)

    def _initial_delay_expired(self, group: Group, delay_ms: int, remaining_ms: int) -> None:
        group.timer = None
        if group.member_added_during_delay and remaining_ms > 0:
            # More members are arriving: wait again, but never beyond the rebalance timeout.
            group.member_added_during_delay = False
            delay_ms = min(delay_ms, remaining_ms)
            group.timer = asyncio.get_running_loop().call_later(delay_ms / 1000, self._initial_delay_expired, group,
                                                                delay_ms, remaining_ms - delay_ms)
            return
        group.delaying_initial_join = False
        self._complete_join(group)

    async def _await_join(self, group: Group, member: Member, fut: asyncio.Future) -> JoinResult:
        """Wait for the rebalance to complete. A parked join that is cancelled (its client went
        away) takes a dynamic member out of the group, so the others need not wait for it; a static
        member stays (it is expected back under its instance id)."""
        try:
            return await fut
        except asyncio.CancelledError:
            if not self._closed and member.join_future is fut and group.members.get(member.member_id) is member \
                    and member.group_instance_id is None:
                log.info("group %s: member %s went away during the rebalance", group.group_id, member.member_id)
                self._remove(group, member, f"member {member.member_id} went away")
            raise

    def _park_join(self, member: Member) -> asyncio.Future:
        if member.awaiting_join:  # a duplicate JoinGroup: the older one is answered and dropped
            _resolve(member.join_future, JoinResult(REBALANCE_IN_PROGRESS, member_id=member.member_id))
        member.join_future = asyncio.get_running_loop().create_future()
        return member.join_future

    def _join_result(self, group: Group, member: Member) -> JoinResult:
        members = ()
        if member.member_id == group.leader_id:
            members = tuple((m.member_id, m.group_instance_id, m.metadata_for(group.protocol_name))
                            for m in group.members.values())
        return JoinResult(NONE, group.generation, group.protocol_type, group.protocol_name,
                          group.leader_id or "", member.member_id, members)

    def _prepare_rebalance(self, group: Group, reason: str) -> None:
        if group.state is GroupState.COMPLETING_REBALANCE:
            for m in group.members.values():
                _resolve(m.sync_future, SyncResult(REBALANCE_IN_PROGRESS))
                m.sync_future = None
        group.cancel_timer()
        group.transition(GroupState.PREPARING_REBALANCE)
        timeout_ms = group.max_rebalance_timeout_ms() or DEFAULT_REBALANCE_TIMEOUT_MS
        group.timer = asyncio.get_running_loop().call_later(timeout_ms / 1000, self._rebalance_timeout, group)
        log.info("group %s: rebalance (generation %d): %s", group.group_id, group.generation, reason)
        self._maybe_complete_join(group)

    def _maybe_complete_join(self, group: Group) -> None:
        if group.state is GroupState.PREPARING_REBALANCE and not group.delaying_initial_join and group.all_joined():
            self._complete_join(group)

    def _rebalance_timeout(self, group: Group) -> None:
        group.timer = None
        if group.state is GroupState.PREPARING_REBALANCE:
            self._complete_join(group)

    def _complete_join(self, group: Group) -> None:
        group.cancel_timer()
        group.delaying_initial_join = False
        for m in [m for m in group.members.values() if not m.awaiting_join and m.group_instance_id is None]:
            log.info("group %s: member %s did not rejoin in time; removed", group.group_id, m.member_id)
            self._drop(group, m)
        if group.members and not any(m.awaiting_join for m in group.members.values()):
            # Nobody rejoined (static members whose processes are away): as Kafka does, wait another
            # rebalance timeout instead of starting a generation nobody knows about; the members'
            # session timeouts remove them meanwhile (_expire -> _remove -> _maybe_complete_join).
            timeout_ms = group.max_rebalance_timeout_ms() or DEFAULT_REBALANCE_TIMEOUT_MS
            group.timer = asyncio.get_running_loop().call_later(timeout_ms / 1000, self._rebalance_timeout, group)
            log.info("group %s: no member rejoined; rebalance postponed by %d ms", group.group_id, timeout_ms)
            return
        group.generation += 1
        if not group.members:
            group.protocol_name = group.protocol_type = None
            group.leader_id = None
            group.transition(GroupState.EMPTY)
            log.info("group %s: empty (generation %d)", group.group_id, group.generation)
            if not self._maybe_delete(group):
                self._save(group)
            return
        group.protocol_name = group.select_protocol()
        if not group.members[group.leader_id].awaiting_join:
            # The leader must be someone who gets this JoinGroup answer (a static member may be away).
            group.leader_id = next((m.member_id for m in group.members.values() if m.awaiting_join), group.leader_id)
        group.transition(GroupState.COMPLETING_REBALANCE)
        log.info("group %s: generation %d with %d members, protocol %s, leader %s", group.group_id,
                 group.generation, len(group.members), group.protocol_name, group.leader_id)
        for m in group.members.values():
            _resolve(m.join_future, self._join_result(group, m))
            m.join_future = None
            m.assignment = b""
            self._heartbeat_received(group, m)
        timeout_ms = group.max_rebalance_timeout_ms() or DEFAULT_REBALANCE_TIMEOUT_MS
        group.timer = asyncio.get_running_loop().call_later(timeout_ms / 1000, self._sync_timeout, group)

    def _sync_timeout(self, group: Group) -> None:
        group.timer = None
        if group.state is not GroupState.COMPLETING_REBALANCE:
            return
        for m in [m for m in group.members.values() if not m.awaiting_sync]:
            log.info("group %s: member %s sent no SyncGroup in time; removed", group.group_id, m.member_id)
            self._drop(group, m)
        self._prepare_rebalance(group, "sync timeout")

    # -- SyncGroup -------------------------------------------------------------------------------

    async def sync(self, group_id: str, generation: int, member_id: str, protocol_type: str | None,
                   protocol_name: str | None, assignments: dict[str, bytes],
                   group_instance_id: str | None = None) -> SyncResult:
        """SyncGroup: the leader hands out ``assignments``; wait for it and return this member's.

        Returns at once with an error code (UNKNOWN_MEMBER_ID, ILLEGAL_GENERATION,
        REBALANCE_IN_PROGRESS...) when the member, generation or state do not fit.
        """
        group = self.groups.get(group_id)
        if group is not None and group.fenced(group_instance_id, member_id):
            return SyncResult(FENCED_INSTANCE_ID)
        if group is None or member_id not in group.members:
            return SyncResult(UNKNOWN_MEMBER_ID)
        if generation != group.generation:
            return SyncResult(ILLEGAL_GENERATION)
        if (protocol_type is not None and protocol_type != group.protocol_type) or \
                (protocol_name is not None and protocol_name != group.protocol_name):
            return SyncResult(INCONSISTENT_GROUP_PROTOCOL)
        member = group.members[member_id]
        if group.state is GroupState.PREPARING_REBALANCE:
            return SyncResult(REBALANCE_IN_PROGRESS)
        if group.state is GroupState.STABLE:
            self._heartbeat_received(group, member)
            return SyncResult(NONE, group.protocol_type, group.protocol_name, member.assignment)
        if group.state is not GroupState.COMPLETING_REBALANCE:
            return SyncResult(UNKNOWN_MEMBER_ID)
        if member.awaiting_sync:
            _resolve(member.sync_future, SyncResult(REBALANCE_IN_PROGRESS))
        fut = member.sync_future = asyncio.get_running_loop().create_future()
        self._heartbeat_received(group, member)
        if member_id == group.leader_id:
            group.cancel_timer()
            for m in group.members.values():
                m.assignment = assignments.get(m.member_id, b"")
            group.transition(GroupState.STABLE)
            log.info("group %s: stable at generation %d", group.group_id, group.generation)
            self._save(group)
            for m in group.members.values():
                _resolve(m.sync_future, SyncResult(NONE, group.protocol_type, group.protocol_name, m.assignment))
                m.sync_future = None
                self._heartbeat_received(group, m)
        return await fut

    # -- Heartbeat, LeaveGroup -------------------------------------------------------------------

    def heartbeat(self, group_id: str, generation: int, member_id: str, group_instance_id: str | None = None) -> int:
        """Renew the member's session; returns an error code, REBALANCE_IN_PROGRESS while it must rejoin."""
        group = self.groups.get(group_id)
        if group is not None and group.fenced(group_instance_id, member_id):
            return FENCED_INSTANCE_ID
        if group is None or group.state is GroupState.EMPTY or member_id not in group.members:
            return UNKNOWN_MEMBER_ID
        if group.state is GroupState.DEAD:
            return COORDINATOR_NOT_AVAILABLE
        if generation != group.generation:
            return ILLEGAL_GENERATION
        self._heartbeat_received(group, group.members[member_id])
        return REBALANCE_IN_PROGRESS if group.state is GroupState.PREPARING_REBALANCE else NONE

    def leave(self, group_id: str, member_ids: list[str], instance_ids: list[str | None] | None = None) -> list[int]:
        """One error code per member. ``instance_ids`` (LeaveGroup v3+) pair each member id with
        its group instance id; an empty member id with an instance id removes that static
        member, whoever holds it (KIP-345's administrative removal)."""
        group = self.groups.get(group_id)
        codes = []
        for member_id, instance_id in zip(member_ids, instance_ids or [None] * len(member_ids), strict=True):
            if member_id == "" and instance_id is not None and group is not None:
                member_id = group.static_members.get(instance_id, "")
            if group is not None and member_id in group.pending:
                group.pending.pop(member_id).cancel()
                codes.append(NONE)
                self._maybe_complete_join(group)
                self._maybe_delete(group)
            elif group is not None and group.fenced(instance_id, member_id):
                codes.append(FENCED_INSTANCE_ID)
            elif group is None or member_id not in group.members:
                codes.append(UNKNOWN_MEMBER_ID)
            else:
                log.info("group %s: member %s leaves", group_id, member_id)
                self._remove(group, group.members[member_id], f"member {member_id} left")
                codes.append(NONE)
        return codes

    # -- membership bookkeeping ------------------------------------------------------------------

    def _heartbeat_received(self, group: Group, member: Member) -> None:
        if member.expiry is not None:
            member.expiry.cancel()
        member.expiry = asyncio.get_running_loop().call_later(member.session_timeout_ms / 1000, self._expire,
                                                             group, member)

    def _expire(self, group: Group, member: Member) -> None:
        member.expiry = None
        if group.members.get(member.member_id) is not member:
            return
        if member.awaiting_join or member.awaiting_sync:
            self._heartbeat_received(group, member)  # parked requests keep a member alive
            return
        log.info("group %s: member %s session timed out after %d ms", group.group_id, member.member_id,
                 member.session_timeout_ms)
        self._remove(group, member, f"member {member.member_id} session timed out")

    def _expire_pending(self, group: Group, member_id: str) -> None:
        if group.pending.pop(member_id, None) is not None:
            self._maybe_complete_join(group)
            self._maybe_delete(group)

    def _drop(self, group: Group, member: Member) -> None:
        """Forget ``member`` without touching the group state."""
        if member.expiry is not None:
            member.expiry.cancel()
            member.expiry = None
        _resolve(member.join_future, JoinResult(UNKNOWN_MEMBER_ID, member_id=member.member_id))
        _resolve(member.sync_future, SyncResult(UNKNOWN_MEMBER_ID))
        group.remove(member.member_id)

    def _remove(self, group: Group, member: Member, reason: str) -> None:
        self._drop(group, member)
        if group.state in (GroupState.STABLE, GroupState.COMPLETING_REBALANCE):
            self._prepare_rebalance(group, reason)
        else:
            self._maybe_complete_join(group)

    def _maybe_delete(self, group: Group) -> bool:
        """Delete ``group`` if it is Empty with no pending member id and no committed or staged
        offsets (Kafka's cleanupGroupMetadata); whether it was deleted."""
        if group.state is not GroupState.EMPTY or group.pending or self.offsets.has_offsets(group.group_id) \
                or self.groups.get(group.group_id) is not group:
            return False
        group.cancel_timer()
        group.transition(GroupState.DEAD)
        del self.groups[group.group_id]
        try:
            self.membership.delete(group.group_id)
        except OSError:
            # A restart reloads it Empty and deletes it then.
            log.exception("group %s: could not delete its membership file", group.group_id)
        log.info("group %s: deleted (empty, no offsets)", group.group_id)
        return True

    def _offsets_forgotten(self, group_id: str) -> None:
        group = self.groups.get(group_id)
        if group is not None:
            self._maybe_delete(group)

    def _save(self, group: Group) -> None:
        try:
            self.membership.save(group)
        except OSError:
            # Only a restart would notice (its members would rejoin): not worth failing the group for.
            log.exception("group %s: could not persist its membership", group.group_id)

    # -- ListGroups, DescribeGroups --------------------------------------------------------------

    def list_groups(self) -> list[tuple[str, str, str]]:
        """(group id, protocol type, state name) of every group, including offset-only ones."""
        listed = {gid: (gid, g.protocol_type or "", g.state.value) for gid, g in self.groups.items()}
        for gid in self.offsets.groups():
            listed.setdefault(gid, (gid, "", GroupState.EMPTY.value))
        return sorted(listed.values())

    def describe(self, group_id: str) -> tuple[str, str, str, list[tuple[str, str | None, str, str, bytes, bytes]]]:
        """(state, protocol type, protocol name, members as (id, instance id, client id, host,
        metadata, assignment)); an unknown group is described as Dead with no members, as Kafka does."""
        group = self.groups.get(group_id)
        if group is None:
            state = GroupState.EMPTY if group_id in self.offsets.groups() else GroupState.DEAD
            return state.value, "", "", []
        members = []
        for m in group.members.values():
            metadata = m.metadata_for(group.protocol_name) if group.protocol_name in m.protocol_names() else b""
            members.append((m.member_id, m.group_instance_id, m.client_id, m.client_host, metadata,
                            m.assignment if group.state is GroupState.STABLE else b""))
        return group.state.value, group.protocol_type or "", group.protocol_name or "", members

    # -- offsets ---------------------------------------------------------------------------------

    def commit_check(self, group_id: str, generation: int, member_id: str, group_instance_id: str | None = None,
                     *, transactional: bool = False) -> int:
        """The error for an OffsetCommit from this member/generation, or NONE if it may commit. A
        ``transactional`` (TxnOffsetCommit) check is of the member and generation only: as in Kafka,
        the group state is not enforced for those, and they do not count as a heartbeat."""
        group = self.groups.get(group_id)
        if group is not None and group.fenced(group_instance_id, member_id):
            return FENCED_INSTANCE_ID
        if group is None or group.state is GroupState.EMPTY:
            # Not managed by this coordinator's group protocol (or not any more): simple commits only.
            if generation < 0:
                return NONE
            return ILLEGAL_GENERATION if group is None else UNKNOWN_MEMBER_ID
        if group.state is GroupState.DEAD:
            return COORDINATOR_NOT_AVAILABLE
        if member_id not in group.members:
            return UNKNOWN_MEMBER_ID
        if generation != group.generation:
            return ILLEGAL_GENERATION
        if transactional:
            return NONE
        if group.state is GroupState.COMPLETING_REBALANCE:
            return REBALANCE_IN_PROGRESS
        self._heartbeat_received(group, group.members[member_id])
        return NONE

    def commit_offsets(self, group_id: str, offsets: dict[tuple[str, int], tuple[int, int, str | None]]) -> None:
        """Store (offset, leader epoch, metadata) per (topic, partition), durably; the caller checked the member."""
        now_ms = int(time.time() * 1000)
        self.offsets.commit(group_id, {key: CommittedOffset(o, e, m, now_ms) for key, (o, e, m) in offsets.items()})

    def committed(self, group_id: str, topic: str, partition: int) -> CommittedOffset | None:
        """The offset ``group_id`` committed for the partition, or None."""
        return self.offsets.get(group_id, topic, partition)

    def all_committed(self, group_id: str) -> dict[tuple[str, int], CommittedOffset]:
        """Every offset ``group_id`` committed, by (topic, partition)."""
        return self.offsets.all(group_id)


def _resolve(fut: asyncio.Future | None, result) -> None:
    if fut is not None and not fut.done():
        fut.set_result(result)
