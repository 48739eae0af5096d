"""Transactions with real clients: confluent-kafka (librdkafka), aiokafka and kafka-python
transactional producers, and read_committed / read_uncommitted consumers from all three.

Completion of reading is an event, not a pause: after the transactions under test, a committed
"end" record goes to every partition, and a consumer has seen everything once it has seen the
end record of each partition (records arrive in offset order per partition).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid

import pytest
from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaException, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

PARTITIONS = 3
END = b"end"


def create_topics(bootstrap: str, *topics: str, partitions: int = PARTITIONS) -> None:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    for f in admin.create_topics([NewTopic(t, partitions, 1) for t in topics]).values():
        f.result(timeout=30)


def txn_producer(bootstrap: str, transactional_id: str, **extra) -> Producer:
    p = Producer({"bootstrap.servers": bootstrap, "transactional.id": transactional_id, "linger.ms": 5, **extra})
    p.init_transactions(30)
    return p


def write_end_markers(bootstrap: str, topics, **extra) -> None:
    """One committed END record on every partition of ``topics``, from a producer of its own."""
    p = txn_producer(bootstrap, f"end-{uuid.uuid4().hex[:8]}", **extra)
    p.begin_transaction()
    for t in topics:
        for part in range(PARTITIONS):
            p.produce(t, value=END, partition=part)
    p.commit_transaction(30)


def read_confluent(bootstrap: str, topics, isolation: str, timeout: float = 30.0) -> list[bytes]:
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"read-{uuid.uuid4().hex[:8]}",
                  "enable.auto.commit": False, "isolation.level": isolation})
    c.assign([TopicPartition(t, p, OFFSET_BEGINNING) for t in topics for p in range(PARTITIONS)])
    values, ends = [], set()
    deadline = time.monotonic() + timeout
    try:
        while len(ends) < len(topics) * PARTITIONS:
            assert time.monotonic() < deadline, f"saw END on only {sorted(ends)}"
            m = c.poll(0.5)
            if m is None or m.error():
                continue
            if m.value() == END:
                ends.add((m.topic(), m.partition()))
            else:
                values.append(m.value())
    finally:
        c.close()
    return values


def read_kafka_python(bootstrap: str, topics, timeout: float = 30.0) -> list[bytes]:
    from kafka import KafkaConsumer
    from kafka import TopicPartition as KTP

    c = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, isolation_level="read_committed")
    c.assign([KTP(t, p) for t in topics for p in range(PARTITIONS)])
    c.seek_to_beginning()
    values, ends = [], set()
    deadline = time.monotonic() + timeout
    try:
        while len(ends) < len(topics) * PARTITIONS:
            assert time.monotonic() < deadline, f"saw END on only {sorted(ends)}"
            for tp, records in c.poll(timeout_ms=500).items():
                for r in records:
                    if r.value == END:
                        ends.add((tp.topic, tp.partition))
                    else:
                        values.append(r.value)
    finally:
        c.close()
    return values


def read_aiokafka(bootstrap: str, topics, timeout: float = 30.0) -> list[bytes]:
    from aiokafka import AIOKafkaConsumer
    from aiokafka import TopicPartition as ATP

    async def run():
        c = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False,
                             isolation_level="read_committed")
        await c.start()
        values, ends = [], set()
        try:
            c.assign([ATP(t, p) for t in topics for p in range(PARTITIONS)])
            await c.seek_to_beginning()
            async with asyncio.timeout(timeout):
                while len(ends) < len(topics) * PARTITIONS:
                    for tp, records in (await c.getmany(timeout_ms=500)).items():
                        for r in records:
                            if r.value == END:
                                ends.add((tp.topic, tp.partition))
                            else:
                                values.append(r.value)
        finally:
            await c.stop()
        return values

    return asyncio.run(run())


def test_committed_and_aborted_transactions_across_topics(broker, topic):
    topics = [topic + "-a", topic + "-b"]
    create_topics(broker.bootstrap, *topics)
    p = txn_producer(broker.bootstrap, "mixed")
    committed, everything = [], []
    for i in range(6):
        p.begin_transaction()
        values = [f"txn{i}-{t[-1]}{part}-{n}".encode() for t in topics for part in range(PARTITIONS) for n in range(3)]
        for v in values:
            t = topic + "-" + v.decode().split("-")[1][0]
            p.produce(t, value=v, partition=int(v.decode().split("-")[1][1]))
        everything += values
        if i % 2 == 0:
            p.commit_transaction(30)
            committed += values
        else:
            p.flush(30)  # the aborted data really is in the log
            p.abort_transaction(30)
    write_end_markers(broker.bootstrap, topics)
    assert sorted(read_confluent(broker.bootstrap, topics, "read_committed")) == sorted(committed)
    assert sorted(read_confluent(broker.bootstrap, topics, "read_uncommitted")) == sorted(everything)
    assert sorted(read_kafka_python(broker.bootstrap, topics)) == sorted(committed)
    assert sorted(read_aiokafka(broker.bootstrap, topics)) == sorted(committed)


def test_send_offsets_to_transaction(broker, topic):
    source, sink, group = topic + "-in", topic + "-out", f"g-{uuid.uuid4().hex[:6]}"
    create_topics(broker.bootstrap, source, sink)
    feeder = Producer({"bootstrap.servers": broker.bootstrap})
    for i in range(30):
        feeder.produce(source, value=str(i).encode(), partition=i % PARTITIONS)
    assert feeder.flush(30) == 0
    # A group member (KIP-447: the offsets carry its generation and member id, which the broker checks).
    c = Consumer({"bootstrap.servers": broker.bootstrap, "group.id": group, "enable.auto.commit": False,
                  "auto.offset.reset": "earliest", "isolation.level": "read_committed"})
    c.subscribe([source])
    p = txn_producer(broker.bootstrap, "copier")

    def copy(n: int, commit: bool) -> dict[int, int]:
        """Copy n source records in one transaction; returns the positions it sends as offsets."""
        p.begin_transaction()
        taken, deadline = 0, time.monotonic() + 30
        while taken < n:
            assert time.monotonic() < deadline
            m = c.poll(0.5)
            if m is None or m.error():
                continue
            p.produce(sink, value=m.value(), partition=m.partition())
            taken += 1
        positions = c.position([TopicPartition(source, q) for q in range(PARTITIONS)])
        p.send_offsets_to_transaction(positions, c.consumer_group_metadata(), 30)
        (p.commit_transaction if commit else p.abort_transaction)(30)
        return {tp.partition: tp.offset for tp in positions}

    first = copy(12, commit=True)
    copy(9, commit=False)
    committed = c.committed([TopicPartition(source, q) for q in range(PARTITIONS)], timeout=30)
    assert {tp.partition: tp.offset for tp in committed} == first  # the aborted offsets never land
    c.close()
    write_end_markers(broker.bootstrap, [sink])
    assert len(read_confluent(broker.bootstrap, [sink], "read_committed")) == 12


@pytest.mark.filterwarnings("ignore:Producer abort_transaction failed during close")  # the fenced zombie's
def test_second_producer_fences_the_first(broker, topic):
    create_topics(broker.bootstrap, topic)
    zombie = txn_producer(broker.bootstrap, "fenced-id")
    try:
        zombie.begin_transaction()
        zombie.produce(topic, value=b"zombie-1", partition=0)
        zombie.flush(30)
        successor = txn_producer(broker.bootstrap, "fenced-id")  # aborts zombie's transaction, bumps the epoch
        try:
            with pytest.raises(KafkaException) as failure:
                zombie.produce(topic, value=b"zombie-2", partition=1)
                zombie.commit_transaction(30)
            assert failure.value.args[0].fatal(), failure.value.args[0]
            successor.begin_transaction()
            successor.produce(topic, value=b"successor", partition=1)
            successor.commit_transaction(30)
        finally:
            successor.close()
    finally:
        # Closed here: the traceback ``failure`` holds keeps this frame, and with it the zombie, alive
        # until a garbage collection, retrying to connect (and opening pipes) after the broker is gone.
        zombie.close()
    write_end_markers(broker.bootstrap, [topic])
    assert read_confluent(broker.bootstrap, [topic], "read_committed") == [b"successor"]


KILLED_PRODUCER = textwrap.dedent("""
    import sys
    from confluent_kafka import Producer
    p = Producer({"bootstrap.servers": sys.argv[1], "transactional.id": sys.argv[2],
                  "transaction.timeout.ms": 3000})
    p.init_transactions(30)
    p.begin_transaction()
    p.produce(sys.argv[3], value=b"left-open", partition=0)
    p.flush(30)
    print("produced", flush=True)
    sys.stdin.read()   # until killed
""")


def test_transaction_of_a_killed_producer_blocks_readers_only_until_its_timeout(broker_factory, topic):
    b = broker_factory(transaction_check_interval_ms=200)
    create_topics(b.bootstrap, topic)
    proc = subprocess.Popen([sys.executable, "-c", KILLED_PRODUCER, b.bootstrap, "killed", topic],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert proc.stdout.readline() == b"produced\n"
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    other = txn_producer(b.bootstrap, "survivor")
    other.begin_transaction()
    other.produce(topic, value=b"after", partition=0)
    other.commit_transaction(30)
    c = Consumer({"bootstrap.servers": b.bootstrap, "group.id": "blocked", "isolation.level": "read_committed"})
    c.assign([TopicPartition(topic, 0, OFFSET_BEGINNING)])
    try:
        seen = []
        deadline = time.monotonic() + 20
        while not seen:
            assert time.monotonic() < deadline, "the open transaction was never aborted"
            m = c.poll(0.2)
            if m is not None and not m.error():
                seen.append(m.value())
                seen_at_ms = time.time() * 1000
                killed = b.call(lambda: b.transactions.describe("killed"))
    finally:
        c.close()
    # The committed record behind the open transaction showed only once the broker aborted it.
    assert seen == [b"after"]
    assert killed.state == "CompleteAbort"
    assert seen_at_ms >= killed.start_ms + 3000


def test_aiokafka_and_kafka_python_transactional_producers(broker, topic):
    """aiokafka speaks v0 of every transactional API, kafka-python up to v3."""
    from aiokafka import AIOKafkaProducer
    from kafka import KafkaProducer

    create_topics(broker.bootstrap, topic)

    async def aiokafka_run():
        p = AIOKafkaProducer(bootstrap_servers=broker.bootstrap, transactional_id="aio")
        await p.start()
        try:
            for commit in (True, False):
                await p.begin_transaction()
                for part in range(PARTITIONS):
                    await p.send(topic, value=f"aio-{commit}-{part}".encode(), partition=part)
                await p.flush()
                await (p.commit_transaction() if commit else p.abort_transaction())
        finally:
            await p.stop()

    asyncio.run(aiokafka_run())
    kp = KafkaProducer(bootstrap_servers=broker.bootstrap, transactional_id="kpy")
    kp.init_transactions()
    for commit in (True, False):
        kp.begin_transaction()
        for part in range(PARTITIONS):
            kp.send(topic, value=f"kpy-{commit}-{part}".encode(), partition=part)
        kp.flush()
        (kp.commit_transaction if commit else kp.abort_transaction)()
    kp.close()
    write_end_markers(broker.bootstrap, [topic])
    expected = [f"{who}-True-{part}".encode() for who in ("aio", "kpy") for part in range(PARTITIONS)]
    assert sorted(read_confluent(broker.bootstrap, [topic], "read_committed")) == sorted(expected)
    assert len(read_confluent(broker.bootstrap, [topic], "read_uncommitted")) == 2 * len(expected)

