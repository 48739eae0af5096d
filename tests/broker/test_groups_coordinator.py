"""The group coordinator on its own (no sockets): state machine, error codes, timers, offsets."""

from __future__ import annotations

import asyncio

import pytest

from tests.broker.virtualtime import run_virtual
from twophase.broker.groups import TRANSITIONS, Group, GroupCoordinator, GroupState
from twophase.broker.groups.coordinator import (
    ILLEGAL_GENERATION, INCONSISTENT_GROUP_PROTOCOL, MEMBER_ID_REQUIRED, NONE, REBALANCE_IN_PROGRESS,
    UNKNOWN_MEMBER_ID)
from twophase.states import IllegalTransition

PROTOCOLS = [("range", b"meta-range"), ("roundrobin", b"meta-rr")]


def run(coro):
    """Run a coordinator test on virtual time: its timers fire in order at their exact delays, however
    loaded the machine is (tests/broker/virtualtime.py)."""
    return run_virtual(coro)


async def join(coord, member_id="", group="g", session_ms=1000, rebalance_ms=2000, protocols=PROTOCOLS,
               known=True, protocol_type="consumer"):
    return await coord.join(group, member_id, "client", "127.0.0.1", session_ms, rebalance_ms, protocol_type,
                            protocols, require_known_member_id=known)


async def join_new(coord, **kw):
    first = await join(coord, **kw)
    assert first.error == MEMBER_ID_REQUIRED and first.member_id
    return await join(coord, first.member_id, **kw)


def test_transitions_are_explicit():
    g = Group("g")
    assert g.state is GroupState.EMPTY
    with pytest.raises(IllegalTransition):
        g.transition(GroupState.STABLE)
    g.transition(GroupState.PREPARING_REBALANCE)
    g.transition(GroupState.COMPLETING_REBALANCE)
    g.transition(GroupState.STABLE)
    with pytest.raises(IllegalTransition):
        g.transition(GroupState.EMPTY)
    assert TRANSITIONS.targets(GroupState.DEAD) == frozenset()
    assert all(TRANSITIONS.allows(state, GroupState.DEAD) for state in GroupState if state is not GroupState.DEAD)


def test_single_member_join_sync_heartbeat(tmp_path):
    async def main():
        coord = GroupCoordinator(str(tmp_path))
        try:
            r = await join_new(coord)
            assert r.error == NONE and r.generation == 1 and r.leader == r.member_id
            assert r.protocol_name == "range" and r.members == ((r.member_id, None, b"meta-range"),)
            assert coord.groups["g"].state is GroupState.COMPLETING_REBALANCE
            assert coord.heartbeat("g", 1, r.member_id) == NONE
            s = await coord.sync("g", 1, r.member_id, "consumer", "range", {r.member_id: b"assign"})
            assert s.error == NONE and s.assignment == b"assign"
            assert coord.groups["g"].state is GroupState.STABLE
            assert coord.heartbeat("g", 0, r.member_id) == ILLEGAL_GENERATION
            assert coord.heartbeat("g", 1, "nobody") == UNKNOWN_MEMBER_ID
            assert coord.heartbeat("other", 1, r.member_id) == UNKNOWN_MEMBER_ID
            assert (await coord.sync("g", 1, "nobody", None, None, {})).error == UNKNOWN_MEMBER_ID
            assert (await coord.sync("g", 7, r.member_id, None, None, {})).error == ILLEGAL_GENERATION
            bad = await join(coord, protocols=[("sticky", b"")])
            assert bad.error == INCONSISTENT_GROUP_PROTOCOL
            assert coord.leave("g", [r.member_id]) == [NONE]
            assert "g" not in coord.groups and coord.describe("g")[0] == "Dead"  # Empty, no offsets: deleted
        finally:
            coord.close()

    run(main())


def test_second_member_triggers_rebalance_and_heartbeat_says_so(tmp_path):
    async def main():
        coord = GroupCoordinator(str(tmp_path))
        try:
            a = await join_new(coord)
            await coord.sync("g", a.generation, a.member_id, None, None, {a.member_id: b"all"})
            first = await join(coord)
            assert first.error == MEMBER_ID_REQUIRED
            b_task = asyncio.create_task(join(coord, first.member_id))
            await asyncio.sleep(0)
            assert not b_task.done()  # parked until a rejoins
            assert coord.groups["g"].state is GroupState.PREPARING_REBALANCE
            assert coord.heartbeat("g", a.generation, a.member_id) == REBALANCE_IN_PROGRESS
            a2 = await join(coord, a.member_id)
            b = await b_task
            assert a2.generation == b.generation == 2
            assert a2.leader == a.member_id == b.leader and len(a2.members) == 2 and b.members == ()
            b_sync = asyncio.create_task(coord.sync("g", 2, b.member_id, None, None, {}))
            await asyncio.sleep(0)
            assert not b_sync.done()  # waits for the leader's assignment
            a_sync = await coord.sync("g", 2, a.member_id, None, None, {a.member_id: b"A", b.member_id: b"B"})
            assert (a_sync.assignment, (await b_sync).assignment) == (b"A", b"B")
        finally:
            coord.close()

    run(main())


def test_session_timeout_removes_a_silent_member(tmp_path):
    async def main():
        coord = GroupCoordinator(str(tmp_path))
        try:
            a = await join_new(coord, session_ms=1000)
            await coord.sync("g", 1, a.member_id, None, None, {})
            b = await join(coord, known=False, session_ms=5000)  # v0-v3 style: no MEMBER_ID_REQUIRED round
            # a never heartbeats: its session expires, the rebalance completes with b alone.
            assert b.error == NONE and b.generation == 2 and b.leader == b.member_id
            assert list(coord.groups["g"].members) == [b.member_id]
            assert coord.heartbeat("g", 2, a.member_id) == UNKNOWN_MEMBER_ID
        finally:
            coord.close()

    run(main())


def test_rebalance_timeout_drops_members_that_do_not_rejoin(tmp_path):
    async def main():
        coord = GroupCoordinator(str(tmp_path))
        try:
            a = await join_new(coord, session_ms=30_000, rebalance_ms=500)
            await coord.sync("g", 1, a.member_id, None, None, {})
            loop = asyncio.get_running_loop()
            start = loop.time()

            async def keep_alive():  # a heartbeats but never rejoins
                while True:
                    coord.heartbeat("g", 1, a.member_id)
                    await asyncio.sleep(0.1)

            hb = asyncio.create_task(keep_alive())
            b = await join(coord, known=False, session_ms=30_000, rebalance_ms=500)
            hb.cancel()
            assert b.error == NONE and list(coord.groups["g"].members) == [b.member_id]
            assert loop.time() - start == pytest.approx(0.5)  # b waited out exactly the rebalance timeout
        finally:
            coord.close()

    run(main())


def test_offsets_are_durable(tmp_path):
    async def main():
        coord = GroupCoordinator(str(tmp_path))
        assert coord.commit_check("g", -1, "") == NONE  # simple commit, no group management
        coord.commit_offsets("g", {("t", 0): (5, -1, "m"), ("t", 1): (7, 3, None)})
        coord.commit_offsets("g", {("t", 0): (6, -1, None)})
        coord.close()
        again = GroupCoordinator(str(tmp_path))
        assert again.committed("g", "t", 0).offset == 6
        assert again.committed("g", "t", 1).offset == 7 and again.committed("g", "t", 1).leader_epoch == 3
        assert again.committed("g", "t", 2) is None
        assert sorted(again.all_committed("g")) == [("t", 0), ("t", 1)]
        assert again.commit_check("g", 3, "someone") == ILLEGAL_GENERATION
        again.close()

    run(main())
