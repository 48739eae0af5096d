"""A group's life: deleted once Empty with no offsets, a rebalance nobody rejoins postponed, and
TxnOffsetCommit not subject to the group state. First on the coordinator alone, then on a real
broker with confluent-kafka and with hand-built requests.

Waits poll an observable condition with a deadline; a rebalance that must *not* complete is
watched until its rebalance timer has been armed again twice (two timeouts have passed).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import uuid

from confluent_kafka.admin import AdminClient

from tests.broker.conftest import MS, WireClient, create_topics_request, req, sub
from tests.broker.test_groups_coordinator import join, join_new, run
from tests.broker.test_groups_interop import (
    create_topic,
    group_consumer,
    poll_until,
    produce,
)
from tests.broker.test_groups_membership import join as join_static
from tests.broker.test_groups_wire import (
    commit_request,
    fetch_offsets_request,
    join_request,
    sync_request,
)
from tests.broker.test_txn_wire import end_txn, init_pid
from tests.waiting import async_wait_for as until
from tests.waiting import wait_until
from twophase.broker.broker import GROUPS_DIR
from twophase.broker.groups import (
    CommittedOffset,
    Group,
    GroupCoordinator,
    GroupState,
    MembershipStore,
)
from twophase.broker.groups.coordinator import (
    FENCED_INSTANCE_ID,
    ILLEGAL_GENERATION,
    INCONSISTENT_GROUP_PROTOCOL,
    MEMBER_ID_REQUIRED,
    NONE,
    REBALANCE_IN_PROGRESS,
    UNKNOWN_MEMBER_ID,
)

DEADLINE_S = 15.0


def rebalance_stays_pending(snapshot, poll):
    """Poll ``snapshot() -> (state, timer)`` until the rebalance timer was re-armed twice or the
    group left PreparingRebalance; ``poll(condition)`` waits for a condition."""
    timers = []

    def settled() -> bool:
        state, timer = snapshot()
        if timer is not None and timer not in timers:
            timers.append(timer)
        return state is not GroupState.PREPARING_REBALANCE or len(timers) >= 3

    return poll(settled)


# -- 1. group deletion, on the coordinator -------------------------------------------------------


def test_empty_groups_without_offsets_are_deleted_and_stay_deleted_after_a_restart(tmp_path):
    async def main():
        coord = GroupCoordinator(str(tmp_path))
        try:
            # A MEMBER_ID_REQUIRED id nobody comes back with: the group goes when the id expires...
            probe = await join(coord, group="probe", session_ms=1000)
            assert probe.error == MEMBER_ID_REQUIRED and "probe" in coord.groups
            await until(lambda: "probe" not in coord.groups)
            # ... or when the id leaves; a join refused for its protocols creates no group.
            pending = await join(coord, group="pending")
            assert coord.leave("pending", [pending.member_id]) == [NONE] and "pending" not in coord.groups
            assert (await join(coord, group="bad", protocols=[])).error == INCONSISTENT_GROUP_PROTOCOL
            assert "bad" not in coord.groups
            # A member that was Stable (its membership persisted) and leaves.
            a = await join_new(coord, group="left")
            await coord.sync("left", 1, a.member_id, None, None, {a.member_id: b"A"})
            assert set(MembershipStore(str(tmp_path)).load()) == {"left"}
            assert coord.leave("left", [a.member_id]) == [NONE]
            assert "left" not in coord.groups and coord.describe("left")[0] == "Dead"
            assert MembershipStore(str(tmp_path)).load() == {}
            # A group with committed offsets stays, Empty, with its generation.
            k = await join_new(coord, group="kept")
            await coord.sync("kept", 1, k.member_id, None, None, {})
            assert coord.commit_check("kept", 1, k.member_id) == NONE
            coord.commit_offsets("kept", {("t", 0): (5, -1, None)})
            assert coord.leave("kept", [k.member_id]) == [NONE]
            assert coord.groups["kept"].state is GroupState.EMPTY and coord.groups["kept"].generation == 2
            assert coord.list_groups() == [("kept", "", "Empty")]
        finally:
            coord.close()
        # An Empty group and an emptied offsets file saved by an older version: deleted when loaded.
        MembershipStore(str(tmp_path)).save(Group("stale"))
        (tmp_path / "offsets-emptied.json").write_text('{"version": 1, "group_id": "stale", "offsets": {}}')
        again = GroupCoordinator(str(tmp_path))
        try:
            assert set(again.groups) == {"kept"} and again.groups["kept"].generation == 2
            assert again.list_groups() == [("kept", "", "Empty")]
            assert set(MembershipStore(str(tmp_path)).load()) == {"kept"}
            assert not (tmp_path / "offsets-emptied.json").exists()
        finally:
            again.close()

    run(main())


def test_a_group_goes_with_its_last_committed_or_staged_offsets(tmp_path):
    async def main():
        coord = GroupCoordinator(str(tmp_path))
        try:
            # An Empty group whose committed offsets' topic is deleted (Broker.delete_topic does this).
            a = await join_new(coord, group="g")
            coord.commit_offsets("g", {("t", 0): (5, -1, None)})
            assert coord.leave("g", [a.member_id]) == [NONE] and coord.groups["g"].state is GroupState.EMPTY
            coord.commit_offsets("offsets-only", {("t", 1): (7, -1, None)})  # a simple (unmanaged) commit
            assert [gid for gid, _, _ in coord.list_groups()] == ["g", "offsets-only"]
            coord.offsets.delete_topic("t")
            assert "g" not in coord.groups and coord.list_groups() == []
            # Staged transactional offsets keep an Empty group until their transaction ends.
            coord.offsets.stage("s", 7, {("u", 0): CommittedOffset(1, -1, None, 0)})
            s = await join_new(coord, group="s")
            assert coord.leave("s", [s.member_id]) == [NONE] and coord.groups["s"].state is GroupState.EMPTY
            assert coord.list_groups() == [("s", "", "Empty")]
            coord.offsets.complete_pending("s", 7, commit=False)
            assert "s" not in coord.groups and coord.list_groups() == []
            assert os.listdir(tmp_path) == []  # no offsets or membership file left behind
        finally:
            coord.close()

    run(main())


# -- 2. a rebalance nobody rejoins, on the coordinator -------------------------------------------


async def static_member_alone_in_a_rebalance(coord, group: str, session_ms: int):
    """Static member "ia" Stable at generation 1, then a rebalance started by a dynamic member whose
    parked JoinGroup is cancelled (its client went away): "ia" is the only member, and away."""
    a = await join_static(coord, instance="ia", group=group, session_ms=session_ms, rebalance_ms=300)
    await coord.sync(group, 1, a.member_id, None, None, {a.member_id: b"A"}, "ia")
    g = coord.groups[group]
    dynamic = asyncio.create_task(join_static(coord, group=group, rebalance_ms=300))
    await until(lambda: len(g.members) == 2 and g.state is GroupState.PREPARING_REBALANCE)
    dynamic.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await dynamic
    assert list(g.members) == [a.member_id]
    return a, g


def test_a_rebalance_nobody_rejoins_is_postponed_and_a_static_member_keeps_its_place(tmp_path):
    async def main():
        coord = GroupCoordinator(str(tmp_path))
        try:
            a, g = await static_member_alone_in_a_rebalance(coord, "g", session_ms=60_000)
            await rebalance_stays_pending(lambda: (g.state, g.timer), until)
            # Two rebalance timeouts later: no generation nobody was told of, "ia" still a member.
            assert g.state is GroupState.PREPARING_REBALANCE and g.generation == 1
            assert list(g.members) == [a.member_id]
            assert coord.heartbeat("g", 1, a.member_id, "ia") == REBALANCE_IN_PROGRESS
            back = await join_static(coord, instance="ia", rebalance_ms=300)  # its process restarted
            assert back.error == NONE and back.generation == 2 and back.leader == back.member_id
            assert [m[1] for m in back.members] == ["ia"]
        finally:
            coord.close()

    run(main())


def test_a_postponed_rebalance_ends_when_the_silent_members_sessions_expire(tmp_path):
    async def main():
        coord = GroupCoordinator(str(tmp_path))
        try:
            _, g = await static_member_alone_in_a_rebalance(coord, "g", session_ms=1500)
            states = set()

            def deleted() -> bool:
                states.add(g.state)
                return "g" not in coord.groups

            await until(deleted)
            assert GroupState.COMPLETING_REBALANCE not in states and g.generation == 2  # straight to Empty
        finally:
            coord.close()

    run(main())


def test_a_new_static_member_gone_before_its_first_generation_times_out(tmp_path):
    async def main():
        coord = GroupCoordinator(str(tmp_path))
        try:
            parked = asyncio.create_task(join_static(coord, instance="ia", session_ms=1000, rebalance_ms=300,
                                                     delay_ms=100))
            await until(lambda: "g" in coord.groups and coord.groups["g"].members)
            g = coord.groups["g"]
            parked.cancel()  # its client went away during the initial delay; a static member stays
            with contextlib.suppress(asyncio.CancelledError):
                await parked
            assert len(g.members) == 1
            await until(lambda: "g" not in coord.groups)  # its session expired although it never had one
            assert g.generation == 1
        finally:
            coord.close()

    run(main())


# -- 3. TxnOffsetCommit and the group state, on the coordinator ----------------------------------


def test_a_transactional_commit_check_ignores_the_group_state_but_not_member_and_generation(tmp_path):
    async def main():
        coord = GroupCoordinator(str(tmp_path))
        try:
            a = await join(coord, known=False)  # v0-v3 style: CompletingRebalance until it syncs
            assert coord.groups["g"].state is GroupState.COMPLETING_REBALANCE
            assert coord.commit_check("g", 1, a.member_id) == REBALANCE_IN_PROGRESS
            assert coord.commit_check("g", 1, a.member_id, transactional=True) == NONE
            assert coord.commit_check("g", 0, a.member_id, transactional=True) == ILLEGAL_GENERATION
            assert coord.commit_check("g", 1, "nobody", transactional=True) == UNKNOWN_MEMBER_ID
            assert coord.commit_check("none", 1, a.member_id, transactional=True) == ILLEGAL_GENERATION
            s = await join_static(coord, instance="is", group="static")
            assert coord.commit_check("static", s.generation, "old", "is", transactional=True) == FENCED_INSTANCE_ID
            assert coord.commit_check("static", s.generation, s.member_id, "is", transactional=True) == NONE
        finally:
            coord.close()

    run(main())


# -- against a real broker -----------------------------------------------------------------------


def listed_groups(bootstrap: str) -> dict[str, str]:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    return {g.group_id: g.state.name for g in admin.list_consumer_groups(request_timeout=10).result().valid}


def consume_and_close(bootstrap: str, group: str, topic: str, commit: bool) -> None:
    """A confluent-kafka member of ``group`` reads the topic's 3 records, maybe commits, and closes (LeaveGroup)."""
    c = group_consumer(bootstrap, group)
    c.subscribe([topic])
    seen = []
    try:
        poll_until(lambda: len(seen) >= 3, [c], on_message=lambda _, m: seen.append(m))
        assert listed_groups(bootstrap)[group] == "STABLE"
        if commit:
            c.commit(asynchronous=False)
    finally:
        c.close()


def test_confluent_group_closed_is_deleted_and_a_group_with_offsets_survives_a_restart(broker_factory, tmp_path,
                                                                                    topic):
    data_dir = tmp_path / "data"
    broker = broker_factory(data_dir=data_dir, group_initial_rebalance_delay_ms=0)
    create_topic(broker.bootstrap, topic, 1)
    produce(broker.bootstrap, topic, [b"a", b"b", b"c"], partitions=1)
    gone, kept = f"gone-{uuid.uuid4().hex[:8]}", f"kept-{uuid.uuid4().hex[:8]}"
    consume_and_close(broker.bootstrap, gone, topic, commit=False)
    consume_and_close(broker.bootstrap, kept, topic, commit=True)
    wait_until(lambda: gone not in listed_groups(broker.bootstrap))
    assert listed_groups(broker.bootstrap)[kept] == "EMPTY"
    broker.stop()
    assert set(MembershipStore(str(data_dir / GROUPS_DIR)).load()) == {kept}
    broker = broker_factory(data_dir=data_dir, group_initial_rebalance_delay_ms=0)
    assert listed_groups(broker.bootstrap) == {kept: "EMPTY"}
    assert broker.call(lambda: set(broker.groups.groups)) == {kept}


def test_wire_pending_member_ids_and_deleted_topics_leave_no_group_listed(broker_factory, topic):
    broker = broker_factory(group_initial_rebalance_delay_ms=0)
    with WireClient(broker.port) as c:
        c.request(create_topics_request((topic, 1, 1, None)))
        probe, simple = f"probe-{topic}", f"simple-{topic}"
        assert c.request(join_request(4, probe, session_ms=1000)).error_code.value == MEMBER_ID_REQUIRED
        assert c.request(commit_request(8, simple, -1, "", topic, {0: 5})).topics[0].partitions[0].error_code.value \
            == NONE

        def listed() -> set[str]:
            return {g.group_id for g in c.request(req(16, 4, states_filter=())).groups}

        assert listed() == {probe, simple}
        wait_until(lambda: probe not in listed())  # its MEMBER_ID_REQUIRED id expired
        deleted = c.request(req(20, 6, topics=(sub(20, 6, "DeleteTopicState", name=topic, topic_id=None),),
                                topic_names=(topic,), timeout=10_000 * MS))
        assert deleted.responses[0].error_code.value == NONE
        assert listed() == set()


def static_join_request(group: str, instance: str | None, member_id: str = "", version: int = 5):
    protocol = sub(11, version, "JoinGroupRequestProtocol", name="range", metadata=b"\x00\x01")
    return req(11, version, group_id=group, session_timeout=60_000 * MS, rebalance_timeout=500 * MS,
               member_id=member_id, group_instance_id=instance, protocol_type="consumer", protocols=(protocol,),
               reason=None)


def test_wire_static_member_away_through_a_rebalance_keeps_its_place(broker_factory):
    broker = broker_factory(group_initial_rebalance_delay_ms=0)
    group = f"g-{uuid.uuid4().hex[:8]}"
    with WireClient(broker.port) as c:
        j = c.request(static_join_request(group, "static-a"))
        assert j.error_code.value == NONE and j.generation_id == 1
        assignment = sub(14, 5, "SyncGroupRequestAssignment", member_id=j.member_id, assignment=b"A")
        assert c.request(req(14, 5, group_id=group, generation_id=1, member_id=j.member_id,
                             group_instance_id="static-a", protocol_type="consumer", protocol_name="range",
                             assignments=(assignment,))).error_code.value == NONE
        # A dynamic member starts a rebalance and goes away while parked; static-a's process is down.
        with WireClient(broker.port) as d:
            first = d.request(static_join_request(group, None, version=4))
            d.send(static_join_request(group, None, first.member_id, version=4))
            wait_until(lambda: broker.call(lambda: len(broker.groups.groups[group].members)) == 2)
        g = broker.call(lambda: broker.groups.groups[group])
        wait_until(lambda: broker.call(lambda: len(g.members)) == 1)
        rebalance_stays_pending(lambda: broker.call(lambda: (g.state, g.timer)), wait_until)
        assert broker.call(lambda: (g.state, g.generation)) == (GroupState.PREPARING_REBALANCE, 1)
        # static-a restarts within its session timeout: it takes its place back, leader of generation 2.
        back = c.request(static_join_request(group, "static-a"))
        assert back.error_code.value == NONE and back.generation_id == 2 and back.leader == back.member_id


def test_wire_txn_offset_commit_during_completing_rebalance_is_accepted(broker_factory, topic):
    broker = broker_factory(group_initial_rebalance_delay_ms=0)
    group = f"g-{uuid.uuid4().hex[:8]}"
    with WireClient(broker.port) as w:
        w.request(create_topics_request((topic, 1, 1, None)))
        j = w.request(join_request(3, group))  # v3: no MEMBER_ID_REQUIRED round, no SyncGroup yet
        assert broker.call(lambda: broker.groups.groups[group].state) is GroupState.COMPLETING_REBALANCE
        r = init_pid(w, "tx")
        pid, epoch = r.producer_id, r.producer_epoch
        assert w.request(req(25, 3, transactional_id="tx", producer_id=pid, producer_epoch=epoch,
                             group_id=group)).error_code.value == NONE
        part = sub(28, 3, "TxnOffsetCommitRequestPartition", partition_index=0, committed_offset=5,
                   committed_leader_epoch=-1, committed_metadata="")
        committed = w.request(req(28, 3, transactional_id="tx", group_id=group, producer_id=pid, producer_epoch=epoch,
                                  generation_id=j.generation_id, member_id=j.member_id, group_instance_id=None,
                                  topics=(sub(28, 3, "TxnOffsetCommitRequestTopic", name=topic, partitions=(part,)),)))
        assert [p.error_code.value for t in committed.topics for p in t.partitions] == [NONE]
        assert end_txn(w, "tx", pid, epoch, True).value == NONE
        fetched = w.request(fetch_offsets_request(7, group, topic, [0]))
        assert fetched.topics[0].partitions[0].committed_offset == 5
        # The group goes on: the member syncs its generation.
        assert w.request(sync_request(3, group, j.generation_id, j.member_id,
                                      [(j.member_id, b"A")])).error_code.value == NONE
