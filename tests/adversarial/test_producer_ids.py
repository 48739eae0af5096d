"""Issue 11 item 1: producer ids are sequential, so a client can guess the next one.

The attack: a plain (non-transactional) Produce with the next producer id, epoch 32767 and
sequence 0. Before the fix it was stored; the transactional producer that then got that id was
fenced, its coordinator's abort marker was refused ("epoch 1 is older than current 32767"), the
transaction stayed in PrepareAbort and the other partition's LSO at 0 for good. Now Produce takes
only producer ids the broker issued, as it issued them, and a coordinator marker is never refused
for its epoch (data planted before the fix cannot keep one out either).
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid

import pytest
from confluent_kafka import Producer as ConfluentProducer
from kio.schema.errors import ErrorCode

from tests.adversarial.reading import read_committed
from tests.broker.batches import batch
from tests.broker.conftest import MS, only_partition, produce_request, req
from twophase.client import Admin, Producer
from twophase.client.cli import main as txns
from twophase.client.connection import Connection
from twophase.client.transactions import init_producer_id
from twophase.wire.errors import KafkaError

MAX_EPOCH = 32767


def idempotent_producer_id(client) -> int:
    """A producer id from InitProducerId without a transactional id, as an idempotent producer gets one."""
    response = client.request(req(22, 4, transactional_id=None, transaction_timeout=60_000 * MS,
                                  producer_id=-1, producer_epoch=-1))
    assert response.error_code == ErrorCode.none and response.producer_epoch == 0
    return response.producer_id


def claim(client, topic: str, producer_id: int, epoch: int = MAX_EPOCH, partition: int = 0, sequence: int = 0):
    """The attack: a non-transactional batch claiming ``producer_id`` at ``epoch``; the partition's answer."""
    records = batch([b"hijack"], producer_id=producer_id, producer_epoch=epoch, base_sequence=sequence)
    return only_partition(client.request(produce_request(topic, records, partition=partition)))


@pytest.fixture
def two_partitions(broker, topic) -> str:
    with Admin(broker.bootstrap) as admin:
        admin.create_topics({topic: 2})
    return topic


def describe(broker, transactional_id: str):
    with Admin(broker.bootstrap) as admin:
        [d] = admin.describe_transactions([transactional_id])
    return d


def transactional_producer_id(broker, transactional_id: str) -> tuple[int, int]:
    d = describe(broker, transactional_id)
    return d.producer_id, d.producer_epoch


def test_a_guessed_producer_id_is_refused_and_the_producer_that_gets_it_commits_and_aborts(broker, wire,
                                                                                          two_partitions):
    client = wire()
    issued = idempotent_producer_id(client)
    for guess in range(issued + 1, issued + 6):
        answer = claim(client, two_partitions, guess)
        assert answer.error_code == ErrorCode.unknown_producer_id, (guess, answer)
        assert "not issued" in answer.error_message
    with Producer(broker.bootstrap, transactional_id="victim") as p:
        p.init_transactions()
        assert transactional_producer_id(broker, "victim") == (issued + 1, 0)  # the id the attack claimed
        p.begin_transaction()
        p.send(two_partitions, b"aborted-0", partition=0)
        p.send(two_partitions, b"aborted-1", partition=1)
        p.abort_transaction()
        p.begin_transaction()
        p.send(two_partitions, b"committed-0", partition=0)
        p.send(two_partitions, b"committed-1", partition=1)
        p.commit_transaction()
    assert read_committed(broker.bootstrap, two_partitions, 2) == {0: [b"committed-0"], 1: [b"committed-1"]}


def test_a_transactional_ids_producer_id_takes_no_plain_batches(broker, wire, two_partitions):
    """Epoch 0 and sequence 0 on the victim's own id would make its first batch look like a retry."""
    client = wire()
    with Producer(broker.bootstrap, transactional_id="victim") as p:
        p.init_transactions()
        producer_id, epoch = transactional_producer_id(broker, "victim")
        for claimed_epoch in (epoch, MAX_EPOCH):
            answer = claim(client, two_partitions, producer_id, claimed_epoch)
            assert answer.error_code == ErrorCode.invalid_producer_id_mapping, answer
        p.begin_transaction()
        p.send(two_partitions, b"mine", partition=0)
        p.commit_transaction()
    assert read_committed(broker.bootstrap, two_partitions, 2) == {0: [b"mine"], 1: []}


def test_an_idempotent_id_takes_a_bumped_epoch_as_the_java_producer_sends_it(broker, wire, two_partitions):
    """KIP-360: the Java producer bumps an idempotent id's epoch itself; Kafka takes it, so does this
    broker (a bump fences only that id's own producer, never a transactional one)."""
    client = wire()
    issued = idempotent_producer_id(client)
    assert claim(client, two_partitions, issued, epoch=0).error_code == ErrorCode.none
    assert claim(client, two_partitions, issued, epoch=1).error_code == ErrorCode.none


def test_real_idempotent_and_transactional_clients_still_produce(broker, two_partitions):
    delivered = []
    plain = ConfluentProducer({"bootstrap.servers": broker.bootstrap, "enable.idempotence": True})
    plain.produce(two_partitions, b"idempotent", partition=1, on_delivery=lambda err, m: delivered.append(err))
    assert plain.flush(30) == 0 and delivered == [None]
    txn = ConfluentProducer({"bootstrap.servers": broker.bootstrap, "transactional.id": f"c-{uuid.uuid4().hex[:6]}"})
    txn.init_transactions(30)
    txn.begin_transaction()
    txn.produce(two_partitions, b"transactional", partition=0)
    txn.commit_transaction(30)
    assert read_committed(broker.bootstrap, two_partitions, 2) == {0: [b"transactional"], 1: [b"idempotent"]}


def test_data_planted_with_a_high_epoch_cannot_keep_the_coordinators_marker_out(broker_factory, tmp_path, topic,
                                                                                 caplog, capsys):
    """Data a broker stored before the Produce check (the attack as it was) must not wedge anything:
    the coordinator's abort marker wins, the LSO moves, and after a restart too."""
    data = tmp_path / "data"
    broker = broker_factory(data_dir=data, default_partitions=2)
    with Admin(broker.bootstrap) as admin:
        admin.create_topics({topic: 2})
    with contextlib.closing(Connection("127.0.0.1", broker.port)) as conn:
        next_id = init_producer_id(conn, None, 60_000).producer_id + 1  # what the next InitProducerId gets
    hijack = batch([b"hijack"], producer_id=next_id, producer_epoch=MAX_EPOCH, base_sequence=0)
    # Straight into storage, as the unchecked Produce of an older broker stored it.
    broker.call(lambda: broker.logs.partition(topic, 0).append(hijack, int(time.time() * 1000)))

    victim = Producer(broker.bootstrap, transactional_id="victim")
    try:
        victim.init_transactions()
        assert transactional_producer_id(broker, "victim") == (next_id, 0)
        victim.begin_transaction()
        victim.send(topic, b"lost-1", partition=1)
        victim.send(topic, b"refused-0", partition=0)  # storage: epoch 0 is older than 32767
        with pytest.raises(KafkaError):
            victim.commit_transaction()
    finally:
        victim.close()
    with caplog.at_level(logging.WARNING, "twophase.broker.storage.producers"):
        # The operator's abort (CONCURRENT_TRANSACTIONS for good, before): the marker gets in.
        capsys.readouterr()
        assert txns(["--bootstrap-server", broker.bootstrap, "--timeout", "10", "abort", "victim"]) == 0
        assert "victim: was Ongoing" in capsys.readouterr().out
        with Producer(broker.bootstrap, transactional_id="victim") as p:
            p.init_transactions()
            p.begin_transaction()
            p.send(topic, b"committed-0", partition=0)
            p.send(topic, b"committed-1", partition=1)
            p.commit_transaction()
    assert any("marker with epoch" in r.getMessage() for r in caplog.records)
    expected = {0: [b"hijack", b"committed-0"], 1: [b"committed-1"]}
    assert read_committed(broker.bootstrap, topic, 2) == expected
    assert describe(broker, "victim").state == "CompleteCommit"
    broker.stop()
    again = broker_factory(data_dir=data)
    assert read_committed(again.bootstrap, topic, 2) == expected  # up to the first END, as before


def test_a_completion_that_keeps_failing_logs_its_error_once_not_every_retry(broker, two_partitions, caplog,
                                                                             monkeypatch):
    """One stuck transaction must not flood the log: a failing completion is retried by every check
    and every client retry, and its ERROR comes once per interval."""
    p = Producer(broker.bootstrap, transactional_id="stuck")
    try:
        p.init_transactions()
        p.begin_transaction()
        p.send(two_partitions, b"x", partition=0)
        p.flush()
        plog = broker.call(lambda: broker.logs.partition(two_partitions, 0))

        def refuse(*args, **kwargs):
            raise KafkaError("disk gone", ErrorCode.kafka_storage_error)

        monkeypatch.setattr(plog, "append_marker", refuse)
        with caplog.at_level(logging.ERROR, "twophase.broker.txn"):
            p.abort_transaction()  # answered once the decision is durable; the marker keeps failing
            for _ in range(20):
                broker.call(lambda: broker.transactions.check(int(time.time() * 1000)))
        errors = [r for r in caplog.records if r.levelno >= logging.ERROR and "'stuck'" in r.getMessage()]
        assert len(errors) == 1, [r.getMessage() for r in errors]
        monkeypatch.undo()
        broker.call(lambda: broker.transactions.check(int(time.time() * 1000)))
        assert describe(broker, "stuck").state == "CompleteAbort"
    finally:
        p.close()
