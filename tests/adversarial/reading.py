"""What a consumer sees after an attack: every value of a partition up to an END record.

Reading to the end is an event, not a pause: a committed END record goes to every partition
(from a transactional producer of its own), and a partition is read once its END arrived.
read_committed consumers only get records below the last stable offset, so an END arriving
also proves the LSO moved past everything before it.

Example::

    seen = read_committed(broker.bootstrap, topic, partitions=2)   # {partition: [values before END]}
    values = read_until_end(broker.bootstrap, topic)               # END written by the test itself
"""

from __future__ import annotations

import uuid

from tests.waiting import wait_until
from twophase.client import Consumer, Producer

END = b"end"


def commit_end_records(bootstrap: str, topic: str, partitions: int) -> None:
    """One committed END record on each partition of ``topic``."""
    with Producer(bootstrap, transactional_id=f"end-{uuid.uuid4().hex[:8]}") as p:
        p.init_transactions()
        p.begin_transaction()
        for partition in range(partitions):
            p.send(topic, END, partition=partition)
        p.commit_transaction()


def read_committed(bootstrap: str, topic: str, partitions: int, timeout: float = 60.0) -> dict[int, list[bytes]]:
    """Commit END records, then read every partition with read_committed up to its END: the values before it."""
    commit_end_records(bootstrap, topic, partitions)
    seen: dict[int, list[bytes]] = {p: [] for p in range(partitions)}
    ended: set[int] = set()
    with Consumer(bootstrap, isolation_level="read_committed") as c:
        c.assign([(topic, p) for p in range(partitions)])
        for p in range(partitions):
            c.seek(topic, p, 0)

        def all_ended() -> bool:
            for m in c.poll(timeout_s=0.2):
                if m.partition in ended:
                    continue
                if m.value == END:
                    ended.add(m.partition)
                else:
                    seen[m.partition].append(m.value)
            return len(ended) == partitions

        wait_until(all_ended, timeout=timeout, what=f"END on every partition of {topic} (saw {sorted(ended)})")
    return seen


def read_until_end(bootstrap: str, topic: str, partition: int = 0,
                   isolation_level: str = "read_uncommitted", timeout: float = 60.0) -> list[bytes]:
    """The values of ``topic``-``partition`` before its first END record (which the test wrote), with
    twophase.client; every record arrives in offset order, so seeing END means all before it were seen."""
    with Consumer(bootstrap, isolation_level=isolation_level) as consumer:
        consumer.assign([(topic, partition)])
        return values_until_end(consumer, timeout, f"END of {topic}-{partition} through twophase.client")


def values_until_end(consumer: Consumer, timeout: float, what: str) -> list[bytes]:
    """The values an assigned twophase.client consumer polls before the first END record."""
    values: list[bytes] = []

    def saw_end() -> bool:
        for m in consumer.poll(timeout_s=0.5):
            if m.value == END:
                return True
            values.append(m.value)
        return False

    wait_until(saw_end, timeout=timeout, what=what)
    return values
