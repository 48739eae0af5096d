"""A damaged disk: index files emptied or cut, a flipped byte in a closed segment.

Each test writes through a real broker with real clients, stops it, damages the files in its data
directory the way a disk or an operator might, starts a broker again on that directory and reads with
twophase.client and confluent_kafka. Completion of reading is an event: the last committed record is
END, and a reader has seen everything once it has seen END (records arrive in offset order).
"""

from __future__ import annotations

import glob
import logging
import os
import uuid

from confluent_kafka import OFFSET_BEGINNING, TopicPartition
from confluent_kafka import Consumer as ConfluentConsumer

from tests.waiting import wait_until
from twophase.broker.storage.txnindex import ENTRY
from twophase.client import Admin, Consumer, Producer

END = b"end"
SMALL_SEGMENTS = {"segment.bytes": "1024"}  # the smallest allowed: a few transactions per segment


def partition_dir(broker, topic: str) -> str:
    return os.path.join(broker.data_dir, f"{topic}-0")


def write_transactions(bootstrap: str, topic: str, rounds: int) -> set[bytes]:
    """Per round one committed and one aborted transaction of three records each, then a committed END;
    returns the committed values (END aside)."""
    committed: set[bytes] = set()
    with Producer(bootstrap, transactional_id=f"txn-{uuid.uuid4().hex[:8]}") as producer:
        producer.init_transactions()
        for i in range(rounds):
            for outcome in ("committed", "aborted"):
                producer.begin_transaction()
                values = [f"{outcome}-{i}-{j}".encode() for j in range(3)]
                for value in values:
                    producer.send(topic, value, partition=0)
                if outcome == "committed":
                    producer.commit_transaction()
                    committed.update(values)
                else:
                    producer.abort_transaction()
        producer.begin_transaction()
        producer.send(topic, END, partition=0)
        producer.commit_transaction()
    return committed


def read_twophase(bootstrap: str, topic: str) -> list[bytes]:
    """Every value before END, read_committed, with twophase.client."""
    values: list[bytes] = []
    with Consumer(bootstrap, isolation_level="read_committed") as consumer:
        consumer.assign([(topic, 0)])

        def saw_end() -> bool:
            for m in consumer.poll(timeout_s=0.5):
                if m.value == END:
                    return True
                values.append(m.value)
            return False

        wait_until(saw_end, timeout=60, what="END through twophase.client")
    return values


def read_confluent(bootstrap: str, topic: str) -> list[bytes]:
    """Every value before END, read_committed, with confluent_kafka (librdkafka)."""
    values: list[bytes] = []
    consumer = ConfluentConsumer({"bootstrap.servers": bootstrap, "group.id": f"g-{uuid.uuid4().hex[:8]}",
                                  "enable.auto.commit": False, "isolation.level": "read_committed"})
    try:
        consumer.assign([TopicPartition(topic, 0, OFFSET_BEGINNING)])

        def saw_end() -> bool:
            m = consumer.poll(0.5)
            if m is None or m.error():
                return False
            if m.value() == END:
                return True
            values.append(m.value())
            return False

        wait_until(saw_end, timeout=60, what="END through confluent_kafka")
    finally:
        consumer.close()
    return values


def test_emptied_and_cut_transaction_indexes_are_rebuilt(broker_factory, tmp_path, topic, caplog):
    """Item 4: a closed segment's .txnindex emptied, another cut mid-entry; after a restart no aborted record
    reaches a read_committed reader, every committed one does, and the broker says it rebuilt them."""
    data_dir = tmp_path / "data"
    broker = broker_factory(data_dir=data_dir)
    with Admin(broker.bootstrap) as admin:
        admin.create_topics({topic: 1}, configs=SMALL_SEGMENTS)
    committed = write_transactions(broker.bootstrap, topic, rounds=20)
    directory = partition_dir(broker, topic)
    broker.stop()

    indexes = sorted(glob.glob(os.path.join(directory, "*.txnindex")))[:-1]  # closed segments only
    with_aborts = [path for path in indexes if os.path.getsize(path) >= 2 * ENTRY.size]
    assert len(with_aborts) >= 2, "the transactions must have rolled segments holding ABORT markers"
    emptied, cut = with_aborts[0], with_aborts[-1]
    os.truncate(emptied, 0)
    os.truncate(cut, ENTRY.size + ENTRY.size // 2)  # one whole entry, then half of the next

    caplog.set_level(logging.WARNING, logger="twophase.broker.storage")
    broker = broker_factory(data_dir=data_dir)
    rebuilt = {r.getMessage().split(":")[0] for r in caplog.records if "will be rebuilt" in r.getMessage()}
    assert {emptied, cut} <= rebuilt

    for read in (read_twophase, read_confluent):
        values = read(broker.bootstrap, topic)
        assert not [v for v in values if v.startswith(b"aborted")], read.__name__
        assert sorted(values) == sorted(committed), read.__name__
        assert len(values) == len(committed), read.__name__  # each once
