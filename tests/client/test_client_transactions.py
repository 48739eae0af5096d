"""Transactions with the client against the real broker: commit and abort across topics and
partitions as a read_committed confluent-kafka consumer sees them, fencing, and KIP-939: prepare in
one process, commit or abort from another, idempotently."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading

import pytest
from confluent_kafka import Consumer as ConfluentConsumer
from confluent_kafka import Producer as ConfluentProducer
from confluent_kafka import TopicPartition

from tests.waiting import wait_until
from twophase.client import (Admin, Consumer, KafkaConnectionError, KafkaError, KafkaTimeout, PreparedTxn, PreparedTxnLost,
                             Producer, ProducerFenced, TransactionStateError, TransactionUnknown)
from twophase.wire.api_keys import ApiKey

from .conftest import confluent_drain, count_requests, drain, refuse_requests


def _confluent_values(broker, topics: list[str], isolation: str, expected: int) -> list[bytes]:
    c = ConfluentConsumer({"bootstrap.servers": broker.bootstrap, "group.id": f"g-{topics[0]}-{isolation}",
                           "auto.offset.reset": "earliest", "enable.auto.commit": False,
                           "isolation.level": isolation})
    c.subscribe(topics)
    try:
        return sorted(m[4] for m in confluent_drain(c, expected))
    finally:
        c.close()


def _our_values(broker, topics: dict[str, int], isolation: str, expected: int) -> list[bytes]:
    with Consumer(broker.bootstrap, isolation_level=isolation) as c:
        c.assign([(t, p) for t, n in topics.items() for p in range(n)])
        return sorted(m.value for m in drain(c, expected))


def test_commit_and_abort_across_topics_and_partitions(broker, topic):
    other = topic + "-b"
    Admin(broker.bootstrap).create_topics({topic: 3, other: 2})
    committed = []
    with Producer(broker.bootstrap, transactional_id=f"tx-{topic}") as p:
        p.init_transactions()
        for n in range(6):
            p.begin_transaction()
            values = [b"txn%d-%d" % (n, i) for i in range(20)]
            for i, v in enumerate(values):
                p.send(topic if i % 2 else other, value=v, key=b"%d" % i)
            if n % 2:
                p.abort_transaction()
            else:
                p.commit_transaction()
                committed += values
    assert _confluent_values(broker, [topic, other], "read_committed", len(committed)) == sorted(committed)
    assert _our_values(broker, {topic: 3, other: 2}, "read_committed", len(committed)) == sorted(committed)
    assert len(_our_values(broker, {topic: 3, other: 2}, "read_uncommitted", 120)) == 120


def test_a_second_instance_fences_the_first(broker, topic):
    tid = f"tx-{topic}"
    first = Producer(broker.bootstrap, transactional_id=tid)
    first.init_transactions()
    first.begin_transaction()
    first.send(topic, value=b"zombie", partition=0)
    first.flush()
    with Producer(broker.bootstrap, transactional_id=tid) as second:
        second.init_transactions()  # aborts the first one's open transaction
        second.begin_transaction()
        second.send(topic, value=b"live", partition=0)
        second.commit_transaction()
    with pytest.raises(ProducerFenced):
        first.commit_transaction()
    with pytest.raises(TransactionStateError):
        first.begin_transaction()  # fatal: the zombie can do nothing more
    first.close()
    assert _our_values(broker, {topic: 1}, "read_committed", 1) == [b"live"]


PREPARE = textwrap.dedent("""
    import sys
    from twophase.client import Producer
    bootstrap, tid, topic = sys.argv[1:4]
    p = Producer(bootstrap, transactional_id=tid, enable_2pc=True)
    p.init_transactions()
    p.begin_transaction()
    for i in range(30):
        p.send(topic, value=b"prepared-%d" % i, key=b"%d" % i)
    print(p.prepare_transaction().to_json(), flush=True)
    p.close()   # the process ends with its transaction prepared, not committed
""")


def _prepare_in_subprocess(broker, tid: str, topic: str) -> PreparedTxn:
    out = subprocess.run([sys.executable, "-c", PREPARE, broker.bootstrap, tid, topic], capture_output=True,
                         text=True, timeout=60, check=True)
    return PreparedTxn.from_json(out.stdout.strip().splitlines()[-1])


def test_prepared_in_one_process_committed_from_another_twice(broker, topic):
    Admin(broker.bootstrap).create_topics({topic: 3})
    tid = f"tx-{topic}"
    handle = _prepare_in_subprocess(broker, tid, topic)
    with Admin(broker.bootstrap) as admin:
        [open_txn] = admin.describe_transactions([tid])
    assert open_txn.state == "Ongoing" and open_txn.producer_id == handle.producer_id
    assert _confluent_values(broker, [topic], "read_committed", 0) == []  # invisible while prepared
    Producer.complete_prepared(broker.bootstrap, handle, commit=True)
    Producer.complete_prepared(broker.bootstrap, handle, commit=True)  # a retried commit is a no-op
    expected = sorted(b"prepared-%d" % i for i in range(30))
    assert _confluent_values(broker, [topic], "read_committed", 30) == expected
    with pytest.raises(Exception, match="already committed"):
        Producer.complete_prepared(broker.bootstrap, handle, commit=False)


def test_prepared_then_aborted_cannot_be_committed(broker, topic):
    tid = f"tx-{topic}"
    handle = _prepare_in_subprocess(broker, tid, topic)
    Producer.complete_prepared(broker.bootstrap, handle, commit=False)
    Producer.complete_prepared(broker.bootstrap, handle, commit=False)
    with pytest.raises(PreparedTxnLost):
        Producer.complete_prepared(broker.bootstrap, handle, commit=True)
    assert _our_values(broker, {topic: 1}, "read_committed", 0) == []
    assert len(_our_values(broker, {topic: 1}, "read_uncommitted", 30)) == 30


def test_admin_abort_of_a_prepared_transaction_loses_it(broker, topic):
    tid = f"tx-{topic}"
    handle = _prepare_in_subprocess(broker, tid, topic)
    with Admin(broker.bootstrap) as admin:
        assert [t.transactional_id for t in admin.list_transactions(states=["Ongoing"])] == [tid]
        admin.abort_transaction(tid)
        [after] = admin.describe_transactions([tid])
        assert after.state == "Empty" and after.producer_epoch > handle.producer_epoch  # aborted, fenced
    with pytest.raises(PreparedTxnLost):
        Producer.complete_prepared(broker.bootstrap, handle, commit=True)
    Producer.complete_prepared(broker.bootstrap, handle, commit=False)  # the abort asked for has happened
    assert _our_values(broker, {topic: 1}, "read_committed", 0) == []


def test_complete_prepared_of_an_unknown_id(broker):
    handle = PreparedTxn("never-used", producer_id=12345, producer_epoch=0)
    with pytest.raises(PreparedTxnLost):
        Producer.complete_prepared(broker.bootstrap, handle, commit=True)
    Producer.complete_prepared(broker.bootstrap, handle, commit=False)


def test_a_flushed_ordinary_transaction_is_completed_from_another_client(broker, topic):
    """Without enable_2pc, prepare_transaction flushes an ordinary transaction; complete_flushed ends
    it with EndTxn and the handle's producer id and epoch (classic two-phase commit, no KIP-939)."""
    with Producer(broker.bootstrap, transactional_id=f"tx-{topic}") as p:
        p.init_transactions()
        p.begin_transaction()
        p.send(topic, value=b"flushed")
        handle = p.prepare_transaction()
    assert _our_values(broker, {topic: 1}, "read_committed", 0) == []
    Producer.complete_flushed(broker.bootstrap, PreparedTxn.from_json(handle.to_json()), commit=True)
    Producer.complete_flushed(broker.bootstrap, handle, commit=True)   # idempotent
    assert _our_values(broker, {topic: 1}, "read_committed", 1) == [b"flushed"]
    with pytest.raises(KafkaError, match="already committed"):
        Producer.complete_flushed(broker.bootstrap, handle, commit=False)
    with pytest.raises(TransactionUnknown, match="no longer knows the id.*cannot be told"):
        Producer.complete_flushed(broker.bootstrap, PreparedTxn("never-used", 12345, 0), commit=True)


def test_prepare_needs_an_open_transaction(broker, topic):
    with Producer(broker.bootstrap, transactional_id=f"tx2-{topic}", enable_2pc=True) as p:
        p.init_transactions()
        with pytest.raises(TransactionStateError, match="in transaction state ready"):
            p.prepare_transaction()
        with pytest.raises(TransactionStateError):
            p.send(topic, value=b"outside a transaction")


def test_read_committed_waits_for_the_open_transaction(broker, topic):
    with Producer(broker.bootstrap) as plain:
        plain.send(topic, value=b"before", partition=0)
    txn = Producer(broker.bootstrap, transactional_id=f"tx-{topic}")
    txn.init_transactions()
    txn.begin_transaction()
    txn.send(topic, value=b"in-txn", partition=0)
    txn.flush()
    with Producer(broker.bootstrap) as plain:
        plain.send(topic, value=b"after-open", partition=0)  # above the LSO until the commit
    with Consumer(broker.bootstrap, isolation_level="read_committed") as c:
        c.assign([(topic, 0)])
        assert [m.value for m in drain(c, 1)] == [b"before"]
        txn.commit_transaction()
        assert [m.value for m in drain(c, 2)] == [b"in-txn", b"after-open"]
    txn.close()


def test_a_failed_send_makes_the_transaction_abort_only(broker, topic, monkeypatch):
    with Producer(broker.bootstrap, transactional_id=f"tx-{topic}", retries=1) as p:
        p.init_transactions()
        p.begin_transaction()
        p.send(topic, value=b"ok", partition=0)
        p.flush()
        refuse_requests(monkeypatch, ApiKey.PRODUCE, "network down (test)")
        p.send(topic, value=b"lost", partition=0)
        with pytest.raises(KafkaConnectionError):
            p.commit_transaction()
        monkeypatch.undo()
        with pytest.raises(TransactionStateError, match="abortable_error"):
            p.commit_transaction()
        _abort_then_commit_another(p, topic)
    assert _our_values(broker, {topic: 1}, "read_committed", 1) == [b"next"]


def _abort_then_commit_another(p: Producer, topic: str) -> None:
    """After a failed commit: abort, then commit a transaction of b"next" to partition 0."""
    p.abort_transaction()
    p.begin_transaction()
    p.send(topic, value=b"next", partition=0)
    p.commit_transaction()


def test_the_first_send_to_a_partition_adds_it_to_the_transaction_while_its_batch_lingers(broker, topic, monkeypatch):
    Admin(broker.bootstrap).create_topics({topic: 2})
    requests = count_requests(monkeypatch)
    tid = f"tx-{topic}"
    with Producer(broker.bootstrap, transactional_id=tid, linger_ms=600_000) as p:
        p.init_transactions()
        for n in range(2):
            p.begin_transaction()
            p.send(topic, value=b"v%d" % n, partition=1)
            wait_until(lambda: broker.transactions.describe(tid).partitions == ((topic, 1),),
                       what="the partition in the transaction")
            assert requests[ApiKey.PRODUCE] == n  # the batch is still lingering
            p.send(topic, value=b"w%d" % n, partition=1)  # the partition is added once per transaction
            p.commit_transaction()
    assert requests[ApiKey.ADD_PARTITIONS_TO_TXN] == 2 and requests[ApiKey.PRODUCE] == 2
    assert _our_values(broker, {topic: 2}, "read_committed", 4) == [b"v0", b"v1", b"w0", b"w1"]


def test_a_partition_the_transaction_could_not_add_fails_its_records(broker, topic, monkeypatch):
    with Producer(broker.bootstrap, transactional_id=f"tx-{topic}", linger_ms=600_000, request_timeout_ms=500) as p:
        p.init_transactions()
        refuse_requests(monkeypatch, ApiKey.ADD_PARTITIONS_TO_TXN, "network down (test)")
        p.begin_transaction()
        p.send(topic, value=b"lost", partition=0)
        with pytest.raises(KafkaTimeout, match="AddPartitionsToTxn"):
            p.commit_transaction()
        monkeypatch.undo()
        _abort_then_commit_another(p, topic)
    assert _our_values(broker, {topic: 1}, "read_committed", 1) == [b"next"]


def test_committed_offsets_wait_for_a_pending_transactional_commit(broker, topic):
    """OffsetFetch with require_stable: UNSTABLE_OFFSET_COMMIT is retried until the transaction ends."""
    group = f"g-{topic}"
    with Producer(broker.bootstrap) as p:
        p.send(topic, value=b"x", partition=0)
    meta_source = ConfluentConsumer({"bootstrap.servers": broker.bootstrap, "group.id": group})
    theirs = ConfluentProducer({"bootstrap.servers": broker.bootstrap, "transactional.id": f"tx-{topic}"})
    theirs.init_transactions(10)
    theirs.begin_transaction()
    theirs.send_offsets_to_transaction([TopicPartition(topic, 0, 1)], meta_source.consumer_group_metadata(), 10)
    committing = threading.Event()  # set before the commit starts: the offset cannot be stable before

    def commit() -> None:
        committing.set()
        theirs.commit_transaction(10)

    commit_after = threading.Timer(1.0, commit)
    commit_after.start()
    with Consumer(broker.bootstrap, group_id=group) as ours:
        assert ours.committed([(topic, 0)]) == {(topic, 0): 1}
    assert committing.is_set()  # it waited for the commit rather than answering -1
    commit_after.join()
    meta_source.close()


def test_a_newer_instances_transaction_is_never_committed_from_an_old_handle(broker, topic):
    tid = f"tx-{topic}"
    handle = _prepare_in_subprocess(broker, tid, topic)
    newer = Producer(broker.bootstrap, transactional_id=tid, enable_2pc=True)
    newer.init_transactions()  # aborts the prepared transaction
    newer.begin_transaction()
    newer.send(topic, value=b"newer", partition=0)
    newer.flush()
    with pytest.raises(PreparedTxnLost, match="not the prepared"):
        Producer.complete_prepared(broker.bootstrap, handle, commit=True)
    newer.close()
    assert _our_values(broker, {topic: 1}, "read_committed", 0) == []


def test_a_commit_that_timed_out_can_be_retried(broker, topic, monkeypatch):
    with Producer(broker.bootstrap, transactional_id=f"tx-{topic}", request_timeout_ms=1_000) as p:
        p.init_transactions()
        p.begin_transaction()
        p.send(topic, value=b"v", partition=0)
        refuse_requests(monkeypatch, ApiKey.END_TXN, "coordinator unreachable (test)")
        with pytest.raises(KafkaTimeout, match="EndTxn"):
            p.commit_transaction()
        monkeypatch.undo()
        p.commit_transaction()
        p.begin_transaction()  # and the producer goes on
        p.abort_transaction()
    assert _our_values(broker, {topic: 1}, "read_committed", 1) == [b"v"]


def test_concurrent_completions_of_one_handle_both_succeed(broker, topic):
    handle = _prepare_in_subprocess(broker, f"tx-{topic}", topic)
    errors = []

    def complete():
        try:
            Producer.complete_prepared(broker.bootstrap, handle, commit=True)
        except Exception as exc:  # collected for the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=complete) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []
    assert len(_our_values(broker, {topic: 1}, "read_committed", 30)) == 30


def test_our_read_committed_consumer_filters_confluent_transactions(broker, topic):
    Admin(broker.bootstrap).create_topics({topic: 2})
    theirs = ConfluentProducer({"bootstrap.servers": broker.bootstrap, "transactional.id": f"tx-{topic}",
                                "linger.ms": 5})
    theirs.init_transactions(10)
    committed = []
    for n in range(6):
        theirs.begin_transaction()
        values = [b"t%d-%d" % (n, i) for i in range(15)]
        for i, v in enumerate(values):
            theirs.produce(topic, value=v, partition=i % 2)
        if n % 3 == 1:
            theirs.flush(10)  # written, then aborted (librdkafka drops what is still queued on abort)
            theirs.abort_transaction(10)
        else:
            theirs.commit_transaction(10)
            committed += values
    assert _our_values(broker, {topic: 2}, "read_committed", len(committed)) == sorted(committed)
    assert len(_our_values(broker, {topic: 2}, "read_uncommitted", 90)) == 90
