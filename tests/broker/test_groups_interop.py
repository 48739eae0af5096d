"""Consumer groups with real clients: confluent-kafka (librdkafka), kafka-python and aiokafka.

Every wait is a poll loop with a deadline on an observable condition (assignment, records,
committed offsets); nothing sleeps a fixed time as synchronisation.
"""

from __future__ import annotations

import asyncio
import os
import queue
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from tests.waiting import wait_until

PARTITIONS = 3

# kafka-python 3.0.12 never completes a rejoin that a metadata change started if poll() times out
# while the JoinGroup is in flight: heartbeats stay off and the member times out with no partitions.
# A group's first member joins before its topic's metadata arrives (so it rejoins at once) unless
# the coordinator holds the first join briefly, as Kafka's group.initial.rebalance.delay.ms does.
KAFKA_PYTHON_FIRST_JOIN_DELAY_MS = 500


@pytest.fixture
def broker(broker_factory):
    # No initial rebalance delay: these groups form one member at a time (test_groups_membership tests the delay).
    return broker_factory(group_initial_rebalance_delay_ms=0)


def create_topic(bootstrap: str, topic: str, partitions: int = PARTITIONS) -> None:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.create_topics([NewTopic(topic, partitions, 1)])[topic].result(timeout=30)


def produce(bootstrap: str, topic: str, values, partitions: int = PARTITIONS) -> None:
    p = Producer({"bootstrap.servers": bootstrap})
    for i, v in enumerate(values):
        p.produce(topic, value=v, partition=i % partitions)
    assert p.flush(30) == 0


def group_consumer(bootstrap: str, group: str, **extra) -> Consumer:
    return Consumer({"bootstrap.servers": bootstrap, "group.id": group, "auto.offset.reset": "earliest",
                     "enable.auto.commit": False, "session.timeout.ms": 6000,
                     "heartbeat.interval.ms": 500, **extra})


def poll_until(condition, consumers, timeout: float = 30.0, on_message=None) -> None:
    """Poll every consumer (their callbacks and rebalances run inside poll) until ``condition()`` holds."""

    def polled() -> bool:
        if condition():
            return True
        for c in consumers:
            m = c.poll(0.1)
            if m is not None and not m.error() and on_message is not None:
                on_message(c, m)
        return False

    wait_until(polled, timeout=timeout, interval=0, what="the consumers to reach the condition")


def partitions_of(c: Consumer) -> set[int]:
    return {tp.partition for tp in c.assignment()}


def test_confluent_subscribe_consume_commit_and_resume(broker, topic):
    create_topic(broker.bootstrap, topic)
    produce(broker.bootstrap, topic, [f"a{i}".encode() for i in range(60)])
    group = f"g-{uuid.uuid4().hex[:8]}"
    c = group_consumer(broker.bootstrap, group)
    c.subscribe([topic])
    seen = []
    try:
        poll_until(lambda: len(seen) >= 60, [c], on_message=lambda _, m: seen.append(m.value()))
        assert partitions_of(c) == {0, 1, 2}
        c.commit(asynchronous=False)
        committed = c.committed([TopicPartition(topic, p) for p in range(PARTITIONS)], timeout=10)
        assert sorted(tp.offset for tp in committed) == [20, 20, 20]
    finally:
        c.close()
    assert sorted(seen) == sorted(f"a{i}".encode() for i in range(60))

    produce(broker.bootstrap, topic, [f"b{i}".encode() for i in range(30)])
    c2 = group_consumer(broker.bootstrap, group)
    c2.subscribe([topic])
    seen2 = []
    try:
        poll_until(lambda: len(seen2) >= 30, [c2], on_message=lambda _, m: seen2.append(m.value()))
        # Nothing seen twice: drain what else arrives within a short window.
        end = time.monotonic() + 1.0
        while time.monotonic() < end:
            m = c2.poll(0.1)
            if m is not None and not m.error():
                seen2.append(m.value())
        c2.commit(asynchronous=False)
    finally:
        c2.close()
    assert sorted(seen2) == sorted(f"b{i}".encode() for i in range(30))


def test_confluent_two_members_split_then_one_leaves(broker, topic):
    create_topic(broker.bootstrap, topic)
    group = f"g-{uuid.uuid4().hex[:8]}"
    c1, c2 = group_consumer(broker.bootstrap, group), group_consumer(broker.bootstrap, group)
    closed = False
    try:
        c1.subscribe([topic])
        poll_until(lambda: partitions_of(c1) == {0, 1, 2}, [c1])
        c2.subscribe([topic])
        poll_until(lambda: partitions_of(c1) and partitions_of(c2)
                   and partitions_of(c1) | partitions_of(c2) == {0, 1, 2}
                   and not partitions_of(c1) & partitions_of(c2), [c1, c2])
        c2.close()
        closed = True
        poll_until(lambda: partitions_of(c1) == {0, 1, 2}, [c1], timeout=20)
    finally:
        c1.close()
        if not closed:
            c2.close()


KILLED_MEMBER = textwrap.dedent("""
    import sys
    from confluent_kafka import Consumer
    bootstrap, group, topic = sys.argv[1:4]
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": group, "auto.offset.reset": "earliest",
                  "enable.auto.commit": False, "session.timeout.ms": 6000, "heartbeat.interval.ms": 500})
    def on_assign(consumer, partitions):
        print("ASSIGNED", ",".join(str(tp.partition) for tp in partitions), flush=True)
    c.subscribe([topic], on_assign=on_assign)
    while True:
        c.poll(0.2)
""")


def test_confluent_member_killed_partitions_move_after_session_timeout(broker, topic):
    create_topic(broker.bootstrap, topic)
    group = f"g-{uuid.uuid4().hex[:8]}"
    proc = subprocess.Popen([sys.executable, "-c", KILLED_MEMBER, broker.bootstrap, group, topic],
                            stdout=subprocess.PIPE, text=True)
    lines: queue.Queue[str] = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True)
    reader.start()
    survivor = group_consumer(broker.bootstrap, group)
    try:
        # The subprocess member owns every partition first.
        line = lines.get(timeout=30)
        assert line.split()[1].split(",") == ["0", "1", "2"], line
        survivor.subscribe([topic])
        assigned_in_child: list[str] = []

        def child_reassigned() -> bool:
            while not lines.empty():
                assigned_in_child.append(lines.get())
            return bool(assigned_in_child)

        poll_until(lambda: child_reassigned() and partitions_of(survivor)
                   and len(partitions_of(survivor)) < PARTITIONS, [survivor])
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        # Within the session timeout (6 s) and a rebalance, long before the deadline.
        poll_until(lambda: partitions_of(survivor) == {0, 1, 2}, [survivor], timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        reader.join(10)  # it ends at the pipe's end of file
        proc.stdout.close()
        survivor.close()


def test_committed_offsets_survive_a_broker_restart(broker_factory, tmp_path, topic):
    data_dir = tmp_path / "restart"
    b = broker_factory(data_dir=data_dir, group_initial_rebalance_delay_ms=0)
    create_topic(b.bootstrap, topic)
    produce(b.bootstrap, topic, [f"x{i}".encode() for i in range(30)])
    group = f"g-{uuid.uuid4().hex[:8]}"
    c = group_consumer(b.bootstrap, group)
    c.subscribe([topic])
    seen = []
    try:
        poll_until(lambda: len(seen) >= 30, [c], on_message=lambda _, m: seen.append(m.value()))
        c.commit(asynchronous=False)
    finally:
        c.close()
    b.stop()

    b2 = broker_factory(data_dir=data_dir, group_initial_rebalance_delay_ms=0)
    produce(b2.bootstrap, topic, [f"y{i}".encode() for i in range(9)])
    c2 = group_consumer(b2.bootstrap, group)
    try:
        committed = c2.committed([TopicPartition(topic, p) for p in range(PARTITIONS)], timeout=10)
        assert [tp.offset for tp in committed] == [10, 10, 10]
        c2.subscribe([topic])
        seen2 = []
        poll_until(lambda: len(seen2) >= 9, [c2], on_message=lambda _, m: seen2.append(m.value()))
    finally:
        c2.close()
    assert sorted(seen2) == sorted(f"y{i}".encode() for i in range(9))


def test_kafka_python_group_consume_commit(broker_factory, topic):
    from kafka import KafkaConsumer
    from kafka import TopicPartition as KTP

    broker = broker_factory(group_initial_rebalance_delay_ms=KAFKA_PYTHON_FIRST_JOIN_DELAY_MS)
    create_topic(broker.bootstrap, topic)
    produce(broker.bootstrap, topic, [f"k{i}".encode() for i in range(30)])
    group = f"g-{uuid.uuid4().hex[:8]}"

    def consumer():
        c = KafkaConsumer(bootstrap_servers=broker.bootstrap, group_id=group, auto_offset_reset="earliest",
                          enable_auto_commit=False, session_timeout_ms=6000, heartbeat_interval_ms=500)
        c.subscribe([topic])
        return c

    c = consumer()
    seen = []
    try:
        def got_all() -> bool:
            for records in c.poll(timeout_ms=200).values():
                seen.extend(r.value for r in records)
            return len(seen) >= 30

        wait_until(got_all, timeout=30, interval=0, what="30 records")
        c.commit()
        assert [c.committed(KTP(topic, p)) for p in range(PARTITIONS)] == [10, 10, 10]
    finally:
        c.close()
    assert sorted(seen) == sorted(f"k{i}".encode() for i in range(30))

    produce(broker.bootstrap, topic, [b"later"])
    c = consumer()
    try:
        again = []

        def got_one() -> bool:
            for records in c.poll(timeout_ms=200).values():
                again.extend(r.value for r in records)
            return bool(again)

        wait_until(got_one, timeout=30, interval=0, what="the later record")
        assert again == [b"later"]
    finally:
        c.close()


def test_aiokafka_group_consume_commit(broker, topic):
    from aiokafka import AIOKafkaConsumer
    from aiokafka.structs import TopicPartition as ATP

    create_topic(broker.bootstrap, topic)
    produce(broker.bootstrap, topic, [f"a{i}".encode() for i in range(30)])
    group = f"g-{uuid.uuid4().hex[:8]}"

    async def consume(expected: int) -> list[bytes]:
        c = AIOKafkaConsumer(topic, bootstrap_servers=broker.bootstrap, group_id=group,
                             auto_offset_reset="earliest", enable_auto_commit=False, session_timeout_ms=6000,
                             heartbeat_interval_ms=500)
        await c.start()
        seen: list[bytes] = []
        try:
            async with asyncio.timeout(30):
                while len(seen) < expected:
                    for records in (await c.getmany(timeout_ms=200)).values():
                        seen.extend(r.value for r in records)
            await c.commit()
            committed = [await c.committed(ATP(topic, p)) for p in range(PARTITIONS)]
        finally:
            await c.stop()
        return seen, committed

    seen, committed = asyncio.run(consume(30))
    assert sorted(seen) == sorted(f"a{i}".encode() for i in range(30))
    assert committed == [10, 10, 10]
    produce(broker.bootstrap, topic, [b"later"])
    seen, committed = asyncio.run(consume(1))
    assert seen == [b"later"] and sorted(committed) == [10, 10, 11]


def test_confluent_admin_lists_and_describes_groups(broker, topic):
    create_topic(broker.bootstrap, topic)
    group = f"g-{uuid.uuid4().hex[:8]}"
    c = group_consumer(broker.bootstrap, group)
    c.subscribe([topic])
    admin = AdminClient({"bootstrap.servers": broker.bootstrap})
    try:
        poll_until(lambda: partitions_of(c) == {0, 1, 2}, [c])
        listed = admin.list_consumer_groups(request_timeout=10).result()
        assert group in {g.group_id for g in listed.valid}
        described = admin.describe_consumer_groups([group], request_timeout=10)[group].result()
        assert described.state.name == "STABLE" and len(described.members) == 1
        assert {tp.partition for tp in described.members[0].assignment.topic_partitions} == {0, 1, 2}
    finally:
        c.close()
