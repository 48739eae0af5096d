"""Static membership (KIP-345), membership persisted across restarts, and the initial rebalance
delay: first on the coordinator alone, then with real clients (confluent-kafka, kafka-python)."""

from __future__ import annotations

import asyncio
import gc
import socket
import threading
import uuid

import pytest
from confluent_kafka import Consumer, KafkaError

from tests.broker.test_groups_coordinator import PROTOCOLS, run
from tests.broker.test_groups_interop import KAFKA_PYTHON_FIRST_JOIN_DELAY_MS, create_topic, produce
from tests.waiting import async_wait_for as until
from tests.waiting import wait_until
from twophase.broker.groups import GroupCoordinator, GroupState
from twophase.broker.groups.coordinator import FENCED_INSTANCE_ID, NONE, REBALANCE_IN_PROGRESS, UNKNOWN_MEMBER_ID


async def join(coord, member_id="", instance=None, group="g", session_ms=10_000, rebalance_ms=1_000,
               protocols=PROTOCOLS, delay_ms=0):
    result = await coord.join(group, member_id, "client", "127.0.0.1", session_ms, rebalance_ms, "consumer",
                              protocols, require_known_member_id=True, group_instance_id=instance,
                              initial_rebalance_delay_ms=delay_ms)
    if result.error == 79:  # MEMBER_ID_REQUIRED (dynamic members only)
        result = await coord.join(group, result.member_id, "client", "127.0.0.1", session_ms, rebalance_ms,
                                  "consumer", protocols, require_known_member_id=True, group_instance_id=instance,
                                  initial_rebalance_delay_ms=delay_ms)
    return result


async def two_static_members(coord):
    """Members with instance ids "ia" (the leader) and "ib", Stable at generation 2 with assignments A and B."""
    a = await join(coord, instance="ia")
    assert a.error == NONE and a.generation == 1  # no MEMBER_ID_REQUIRED round for a static member
    await coord.sync("g", 1, a.member_id, None, None, {a.member_id: b"A"})
    b_join = asyncio.create_task(join(coord, instance="ib"))
    await until(lambda: coord.heartbeat("g", 1, a.member_id, "ia") == REBALANCE_IN_PROGRESS)
    a = await join(coord, a.member_id, "ia")
    b = await b_join
    assert a.generation == b.generation == 2 and a.leader == a.member_id
    b_sync = asyncio.create_task(coord.sync("g", 2, b.member_id, None, None, {}, "ib"))
    await coord.sync("g", 2, a.member_id, None, None, {a.member_id: b"A", b.member_id: b"B"}, "ia")
    assert (await b_sync).assignment == b"B"
    return a.member_id, b.member_id


# -- static membership on the coordinator -------------------------------------------------------


def test_a_restarted_static_member_takes_over_without_a_rebalance(tmp_path):
    async def main():
        coord = GroupCoordinator(str(tmp_path))
        try:
            old_a, b = await two_static_members(coord)
            again = await join(coord, instance="ia")  # the "ia" process restarted: no member id
            assert again.error == NONE and again.member_id != old_a and again.generation == 2
            # The old leader id: the new instance must not compute an assignment nobody would get.
            assert again.leader == old_a and again.members == ()
            group = coord.groups["g"]
            assert group.state is GroupState.STABLE and group.leader_id == again.member_id
            assert (await coord.sync("g", 2, again.member_id, None, None, {}, "ia")).assignment == b"A"
            assert coord.heartbeat("g", 2, b, "ib") == NONE  # b never hears of a rebalance
            # The replaced instance is fenced wherever it shows up.
            assert coord.heartbeat("g", 2, old_a, "ia") == FENCED_INSTANCE_ID
            assert (await coord.sync("g", 2, old_a, None, None, {}, "ia")).error == FENCED_INSTANCE_ID
            assert (await join(coord, old_a, "ia")).error == FENCED_INSTANCE_ID
            assert coord.commit_check("g", 2, old_a, "ia") == FENCED_INSTANCE_ID
            assert coord.leave("g", [old_a], ["ia"]) == [FENCED_INSTANCE_ID]
            assert coord.commit_check("g", 2, again.member_id, "ia") == NONE
            # A dynamic request with an unknown member id is just unknown.
            assert coord.heartbeat("g", 2, old_a) == UNKNOWN_MEMBER_ID
        finally:
            coord.close()

    run(main())


def test_a_static_member_with_a_parked_join_is_fenced_by_its_replacement(tmp_path):
    async def main():
        coord = GroupCoordinator(str(tmp_path))
        try:
            old_a, b = await two_static_members(coord)
            parked = asyncio.create_task(join(coord, old_a, "ia", protocols=[("roundrobin", b"")]))  # a rebalance
            await until(lambda: coord.groups["g"].state is GroupState.PREPARING_REBALANCE)
            new_a = asyncio.create_task(join(coord, instance="ia"))
            assert (await parked).error == FENCED_INSTANCE_ID
            b_again = await join(coord, b, "ib")
            assert b_again.error == NONE and (await new_a).error == NONE
            assert b_again.generation == 3 and set(coord.groups["g"].static_members) == {"ia", "ib"}
        finally:
            coord.close()

    run(main())


def test_static_members_leave_by_instance_id_and_stay_through_a_missed_rebalance(tmp_path):
    async def main():
        coord = GroupCoordinator(str(tmp_path))
        try:
            a, b = await two_static_members(coord)
            # b misses a rebalance (its process is away): it is kept, with its place in the new generation.
            c = asyncio.create_task(join(coord, instance="ic", rebalance_ms=300))
            a_again = await join(coord, a, "ia", rebalance_ms=300)
            assert a_again.generation == 3 and {m[0] for m in a_again.members} == {a, b, (await c).member_id}
            # Administrative removal by instance id alone.
            assert coord.leave("g", [""], ["ib"]) == [NONE]
            assert b not in coord.groups["g"].members and "ib" not in coord.groups["g"].static_members
            assert coord.leave("g", [""], ["nobody"]) == [UNKNOWN_MEMBER_ID]
        finally:
            coord.close()

    run(main())


# -- persistence on the coordinator -------------------------------------------------------------


def test_membership_survives_a_coordinator_restart(tmp_path):
    async def main():
        coord = GroupCoordinator(str(tmp_path))
        a, b = await two_static_members(coord)
        coord.close()

        again = GroupCoordinator(str(tmp_path))
        try:
            group = again.groups["g"]
            assert group.state is GroupState.STABLE and group.generation == 2 and group.leader_id == a
            assert again.heartbeat("g", 2, a, "ia") == NONE and again.heartbeat("g", 2, b, "ib") == NONE
            assert again.commit_check("g", 2, b, "ib") == NONE
            assert (await again.sync("g", 2, b, None, None, {}, "ib")).assignment == b"B"
            assert again.heartbeat("g", 1, a, "ia") != NONE  # the generation is checked as before
            # Static ids are restored too: a restarted "ia" takes over without a rebalance.
            assert (await join(again, instance="ia")).generation == 2
            # A member that does not come back times out as usual (session timers restart on load).
            assert again.describe("g")[0] == "Stable"
        finally:
            again.close()

    run(main())


def test_restored_members_that_stay_away_time_out(tmp_path):
    async def main():
        coord = GroupCoordinator(str(tmp_path))
        a = await join(coord, session_ms=1000)
        await coord.sync("g", 1, a.member_id, None, None, {a.member_id: b"A"})
        coord.commit_offsets("g", {("t", 0): (1, -1, None)})  # an Empty group without offsets is deleted
        coord.close()
        again = GroupCoordinator(str(tmp_path))
        try:
            await until(lambda: "g" not in again.groups or again.groups["g"].state is GroupState.EMPTY)
            assert again.groups["g"].generation == 2
        finally:
            again.close()
        third = GroupCoordinator(str(tmp_path))  # the Empty group (and its generation) is persisted too
        try:
            assert third.groups["g"].state is GroupState.EMPTY and third.groups["g"].generation == 2
            assert (await join(third)).generation == 3
        finally:
            third.close()

    run(main())


# -- initial rebalance delay on the coordinator -------------------------------------------------


def test_initial_delay_waits_for_members_and_extends_while_they_arrive(tmp_path):
    async def main():
        coord = GroupCoordinator(str(tmp_path))
        loop = asyncio.get_running_loop()
        try:
            # Virtual time (see run): the timers fire at their exact delays, so the delays are asserted exactly.
            start = loop.time()
            first = asyncio.create_task(join(coord, delay_ms=1_000, rebalance_ms=5_000))
            await asyncio.sleep(0.3)  # inside the delay
            assert not first.done()
            second = asyncio.create_task(join(coord, delay_ms=1_000, rebalance_ms=5_000))  # extends it by 1 s
            a, b = await first, await second
            assert a.generation == b.generation == 1 and len(a.members or b.members) == 2
            assert loop.time() - start == pytest.approx(2.0)  # the delay, once extended: not 0.3 + 1
            # Only the first rebalance of an empty group is delayed.
            await coord.sync("g", 1, a.leader, None, None, {})
            start = loop.time()
            third = asyncio.create_task(join(coord, delay_ms=400))
            await until(lambda: coord.groups["g"].state is GroupState.PREPARING_REBALANCE)
            results = await asyncio.gather(third, join(coord, a.member_id, delay_ms=400),
                                           join(coord, b.member_id, delay_ms=400))
            assert [r.generation for r in results] == [2, 2, 2]
            assert loop.time() - start < 0.4  # no 400 ms delay ran (the polling above takes 10 ms steps)
        finally:
            coord.close()

    run(main())


def test_initial_delay_is_bounded_by_the_rebalance_timeout(tmp_path):
    async def main():
        coord = GroupCoordinator(str(tmp_path))
        loop = asyncio.get_running_loop()
        try:
            start = loop.time()
            joins, first_done_at = [], []
            for _ in range(8):  # a member every 100 ms would extend a 300 ms delay forever
                joins.append(asyncio.create_task(join(coord, rebalance_ms=600, delay_ms=300)))
                if len(joins) == 1:
                    joins[0].add_done_callback(lambda _: first_done_at.append(loop.time() - start))
                await asyncio.sleep(0.1)
            first = await joins[0]
            assert first.error == NONE and first.generation == 1
            # Virtual time (see run): 300 ms delay + one extension of 300 ms, then the 600 ms rebalance timeout is spent.
            assert first_done_at == [pytest.approx(0.6)]
        finally:
            coord.close()

    run(main())


# -- real clients -------------------------------------------------------------------------------


def static_consumer(bootstrap: str, group: str, instance: str) -> Consumer:
    return Consumer({"bootstrap.servers": bootstrap, "group.id": group, "group.instance.id": instance,
                     "auto.offset.reset": "earliest", "enable.auto.commit": False, "session.timeout.ms": 10_000,
                     "heartbeat.interval.ms": 300, "log_level": 0})


def poll_assigned(consumers, condition, timeout: float = 30.0, errors: list | None = None) -> None:
    """Poll every consumer (rebalances run inside poll) until ``condition()`` holds."""

    def polled() -> bool:
        if condition():
            return True
        for c in consumers:
            m = c.poll(0.05)
            if m is not None and m.error() and errors is not None:
                errors.append(m.error())
        return False

    wait_until(polled, timeout=timeout, interval=0, what="the consumers' assignment")


def polled_until(kafka_python_consumer, condition, what: str) -> None:
    """Poll a kafka-python consumer (its group protocol runs inside poll) until ``condition()`` holds."""

    def polled() -> bool:
        if condition():
            return True
        kafka_python_consumer.poll(100)
        return False

    wait_until(polled, timeout=30, interval=0, what=what)


def generation(broker, group: str) -> int:
    return broker.call(lambda: broker.groups.groups[group].generation)


def test_confluent_static_member_restarts_without_a_rebalance_and_a_duplicate_is_fenced(broker_factory, topic):
    broker = broker_factory(group_initial_rebalance_delay_ms=500)
    create_topic(broker.bootstrap, topic, 4)
    group = f"static-{uuid.uuid4().hex[:8]}"
    revoked_b = []
    a = static_consumer(broker.bootstrap, group, "ia")
    b = static_consumer(broker.bootstrap, group, "ib")
    a.subscribe([topic])
    b.subscribe([topic], on_revoke=lambda c, parts: revoked_b.append(parts))
    poll_assigned([a, b], lambda: len(a.assignment()) + len(b.assignment()) == 4 and a.assignment() and b.assignment())
    gen = generation(broker, group)
    a_parts, b_parts = set(a.assignment()), set(b.assignment())
    revoked_b.clear()
    a.close()  # a static member sends no LeaveGroup: the broker keeps its place
    assert broker.call(lambda: len(broker.groups.groups[group].members)) == 2

    a2 = static_consumer(broker.bootstrap, group, "ia")
    a2.subscribe([topic])
    poll_assigned([a2, b], lambda: len(a2.assignment()) > 0)
    assert set(a2.assignment()) == a_parts and set(b.assignment()) == b_parts
    assert generation(broker, group) == gen and revoked_b == []

    # A second process with the same instance id takes over; a2 is fenced (a fatal error for librdkafka).
    errors = []
    a3 = static_consumer(broker.bootstrap, group, "ia")
    a3.subscribe([topic])
    try:
        poll_assigned([a3, a2, b], lambda: a3.assignment() and any(e.code() == KafkaError._FATAL for e in errors),
                      errors=errors)
        assert "fenced" in next(e for e in errors if e.code() == KafkaError._FATAL).str().lower()
        assert set(a3.assignment()) == a_parts and generation(broker, group) == gen and revoked_b == []
    finally:
        for c in (a3, b):
            c.close()
        threading.Thread(target=a2.close, daemon=True).start()  # a fenced consumer may take long to close


def test_kafka_python_static_member_rejoins_with_its_assignment(broker_factory, topic):
    from kafka import KafkaConsumer

    broker = broker_factory(group_initial_rebalance_delay_ms=KAFKA_PYTHON_FIRST_JOIN_DELAY_MS)
    create_topic(broker.bootstrap, topic, 2)
    produce(broker.bootstrap, topic, [b"x", b"y"], partitions=2)
    group = f"kp-static-{uuid.uuid4().hex[:8]}"

    def consumer():
        return KafkaConsumer(topic, bootstrap_servers=broker.bootstrap, group_id=group, group_instance_id="kp-1",
                             auto_offset_reset="earliest", enable_auto_commit=False, session_timeout_ms=10_000,
                             heartbeat_interval_ms=300)

    first = consumer()
    got = []

    def got_both() -> bool:
        for records in first.poll(200).values():
            got.extend(r.value for r in records)
        return len(got) >= 2

    wait_until(got_both, timeout=30, interval=0, what="both records")
    first.commit()
    gen, member = generation(broker, group), broker.call(lambda: next(iter(broker.groups.groups[group].members)))
    first.close(autocommit=False)  # static: no LeaveGroup
    second = consumer()
    try:
        polled_until(second, lambda: len(second.assignment()) == 2, what="both partitions assigned again")
        assert generation(broker, group) == gen
        assert broker.call(lambda: list(broker.groups.groups[group].members)) != [member]  # replaced, not added
        assert broker.call(lambda: len(broker.groups.groups[group].members)) == 1
    finally:
        second.close(autocommit=False)
    assert sorted(got) == [b"x", b"y"]


def test_confluent_members_keep_their_generation_across_a_broker_restart(broker_factory, tmp_path, topic):
    data_dir = tmp_path / "restart"
    broker = broker_factory(data_dir=data_dir, group_initial_rebalance_delay_ms=0)
    port = broker.port
    create_topic(broker.bootstrap, topic, 2)
    group = f"restart-{uuid.uuid4().hex[:8]}"
    revoked = []
    c = Consumer({"bootstrap.servers": broker.bootstrap, "group.id": group, "auto.offset.reset": "earliest",
                  "enable.auto.commit": False, "session.timeout.ms": 10_000, "heartbeat.interval.ms": 300,
                  "log_level": 0})
    c.subscribe([topic], on_revoke=lambda _, parts: revoked.append(parts))
    try:
        poll_assigned([c], lambda: len(c.assignment()) == 2)
        gen = generation(broker, group)
        broker.stop()
        broker = broker_factory(data_dir=data_dir, port=port, group_initial_rebalance_delay_ms=0)
        assert generation(broker, group) == gen
        produce(broker.bootstrap, topic, [f"after-{i}".encode() for i in range(4)], partitions=2)
        seen = []

        def got_four() -> bool:
            m = c.poll(0.1)
            if m is not None and not m.error():
                seen.append(m.value())
            return len(seen) >= 4

        wait_until(got_four, timeout=30, interval=0, what="the 4 records produced after the restart")
        c.commit(asynchronous=False)  # the old member id and generation still commit
        assert generation(broker, group) == gen and revoked == []
        assert broker.call(lambda: broker.groups.groups[group].state) is GroupState.STABLE
    finally:
        c.close()
    assert sorted(seen) == [f"after-{i}".encode() for i in range(4)]


def test_confluent_consumers_starting_together_form_one_generation_with_the_delay(broker_factory, topic):
    broker = broker_factory(group_initial_rebalance_delay_ms=1500)
    create_topic(broker.bootstrap, topic, 4)
    group = f"delay-{uuid.uuid4().hex[:8]}"
    consumers = [Consumer({"bootstrap.servers": broker.bootstrap, "group.id": group, "log_level": 0,
                           "session.timeout.ms": 10_000, "heartbeat.interval.ms": 300}) for _ in range(3)]
    try:
        for c in consumers:
            c.subscribe([topic])
        poll_assigned(consumers, lambda: all(c.assignment() for c in consumers))
        assert generation(broker, group) == 1  # one rebalance for all three
    finally:
        for c in consumers:
            c.close()


def test_kafka_python_member_keeps_its_generation_across_a_broker_restart(broker_factory, tmp_path, topic):
    from kafka import KafkaConsumer

    data_dir = tmp_path / "restart-kp"
    broker = broker_factory(data_dir=data_dir, group_initial_rebalance_delay_ms=KAFKA_PYTHON_FIRST_JOIN_DELAY_MS)
    port = broker.port
    create_topic(broker.bootstrap, topic, 2)
    group = f"kp-restart-{uuid.uuid4().hex[:8]}"
    c = KafkaConsumer(topic, bootstrap_servers=broker.bootstrap, group_id=group, auto_offset_reset="earliest",
                      enable_auto_commit=False, session_timeout_ms=10_000, heartbeat_interval_ms=300)
    try:
        polled_until(c, lambda: len(c.assignment()) == 2, what="both partitions assigned")
        gen, members = generation(broker, group), broker.call(lambda: list(broker.groups.groups[group].members))
        broker.stop()
        broker = broker_factory(data_dir=data_dir, port=port,
                                group_initial_rebalance_delay_ms=KAFKA_PYTHON_FIRST_JOIN_DELAY_MS)
        produce(broker.bootstrap, topic, [b"a", b"b", b"c", b"d"], partitions=2)
        seen = []

        def got_four() -> bool:
            for records in c.poll(100).values():
                seen.extend(r.value for r in records)
            return len(seen) >= 4

        wait_until(got_four, timeout=30, interval=0, what="the 4 records produced after the restart")
        c.commit()  # old member id and generation
        assert generation(broker, group) == gen
        assert broker.call(lambda: list(broker.groups.groups[group].members)) == members
    finally:
        c.close(autocommit=False)
        close_unconnected_sockets()
    assert sorted(seen) == [b"a", b"b", b"c", b"d"]


def close_unconnected_sockets() -> None:
    """Close socket objects that were never bound or connected (local address 0.0.0.0, port 0 or not).

    kafka-python 3.0 can leave the socket of a reconnect it began while the broker was down (refused,
    then never closed) referenced by its network loop after ``close()``: the check for leaked
    descriptors then fails the test, and a later test warns when the socket is collected. No socket of
    this test's broker or clients is unbound, so closing these objects (not their raw descriptors,
    whose numbers may be reused) touches nothing else."""
    for obj in gc.get_objects():
        if isinstance(obj, socket.socket) and obj.family in (socket.AF_INET, socket.AF_INET6) and obj.fileno() >= 0:
            try:
                unbound = obj.getsockname()[0] in ("0.0.0.0", "::")
            except OSError:
                continue
            if unbound:
                obj.close()
