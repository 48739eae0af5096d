"""Consumer groups with the client against the real broker: two members split partitions and
rebalance when one leaves; committed offsets are where the next member starts."""

from __future__ import annotations

import threading

from confluent_kafka import Consumer as ConfluentConsumer

from tests.waiting import wait_for
from twophase.client import Admin, Consumer, Producer

from .conftest import drain


def _consumer(broker, group: str) -> Consumer:
    return Consumer(broker.bootstrap, group_id=group, session_timeout_ms=6_000, heartbeat_interval_ms=200,
                    rebalance_timeout_ms=10_000, max_wait_ms=100)


class Member(threading.Thread):
    """One group member polling in its own thread (as each would in its own process)."""

    def __init__(self, consumer: Consumer, topic: str) -> None:
        super().__init__(daemon=True)
        self.consumer = consumer
        self.topic = topic
        self.messages: list = []
        self.assignment: list = []
        self.stop = threading.Event()
        self.commit_now = threading.Event()
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            self.consumer.subscribe([self.topic])
            while not self.stop.is_set():
                self.messages += self.consumer.poll(timeout_s=0.2)
                self.assignment = self.consumer.assignment()
                if self.commit_now.is_set():
                    self.consumer.commit()
                    self.commit_now.clear()
            self.consumer.close()
        except BaseException as exc:  # surfaced by the test
            self.error = exc

    def finish(self) -> None:
        self.stop.set()
        self.join(20)
        assert self.error is None, self.error


def test_two_members_split_partitions_and_rebalance_on_leave(broker, topic):
    Admin(broker.bootstrap).create_topics({topic: 4})
    with Producer(broker.bootstrap) as p:
        for i in range(40):
            p.send(topic, value=b"%d" % i, key=b"%d" % i)
    group = f"g-{topic}"
    a = Member(_consumer(broker, group), topic)
    b = Member(_consumer(broker, group), topic)
    wait_for(lambda: len(a.assignment) == 2 and len(b.assignment) == 2, timeout=30,
             what="a rebalance giving each member 2 partitions")
    assert sorted(a.assignment + b.assignment) == [(topic, p) for p in range(4)]
    wait_for(lambda: len(a.messages) + len(b.messages) >= 40, what="all records")
    for m in (a, b):
        m.commit_now.set()
    wait_for(lambda: not a.commit_now.is_set() and not b.commit_now.is_set(), what="commits")
    b.finish()  # LeaveGroup: a takes over all partitions at its next rejoin
    wait_for(lambda: len(a.assignment) == 4, timeout=30, what="the remaining member owning all partitions")
    with Producer(broker.bootstrap) as p:
        p.send(topic, value=b"after", key=b"x")
    wait_for(lambda: any(m.value == b"after" for m in a.messages), what="the new record")
    a.finish()
    values = [m.value for m in a.messages + b.messages]
    assert sorted(values) == sorted([b"%d" % i for i in range(40)] + [b"after"])  # committed: nothing re-read


def test_committed_offsets_resume_a_new_member(broker, topic):
    with Producer(broker.bootstrap) as p:
        for i in range(10):
            p.send(topic, value=b"%d" % i, partition=0)
    group = f"g-{topic}"
    with _consumer(broker, group) as c:
        c.subscribe([topic])
        first = wait_for(lambda: c.poll(timeout_s=0.5, max_records=4), timeout=30, what="first records")
        c.commit()  # only what poll returned counts as consumed
        assert c.committed([(topic, 0)]) == {(topic, 0): len(first)}
    with _consumer(broker, group) as c:
        c.assign([(topic, 0)])
        rest = drain(c, 10 - len(first))
    assert [m.value for m in first + rest] == [b"%d" % i for i in range(10)]


def test_a_confluent_member_and_ours_share_a_group(broker, topic):
    """Subscription and assignment bytes follow Kafka's ConsumerProtocol: librdkafka understands ours."""
    Admin(broker.bootstrap).create_topics({topic: 4})
    group = f"g-{topic}"
    ours = Member(_consumer(broker, group), topic)
    theirs = ConfluentConsumer({"bootstrap.servers": broker.bootstrap, "group.id": group,
                                "partition.assignment.strategy": "range", "auto.offset.reset": "earliest",
                                "session.timeout.ms": 6000, "heartbeat.interval.ms": 200})
    theirs.subscribe([topic])
    try:
        def split():
            theirs.poll(0.1)
            return len(ours.assignment) == 2 and len(theirs.assignment()) == 2

        wait_for(split, timeout=40, what="the range assignor giving each member 2 partitions")
        mine = set(ours.assignment)
        their_partitions = {(tp.topic, tp.partition) for tp in theirs.assignment()}
        assert mine | their_partitions == {(topic, p) for p in range(4)} and not mine & their_partitions
    finally:
        theirs.close()
        ours.finish()
