"""Attack: many partitions (issue 11, item 7).

Before the fix there was no limit on the partitions of a broker, topic creation ran on the event
loop (other clients stalled for seconds), and every partition held its segment files open, so a
broker with thousands of partitions ran out of descriptors and, under a lower ``ulimit -n``, would
not start again. Now creates beyond ``max_partitions`` are refused, a topic's files are made in a
worker thread, and segment files are opened only while used.
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import threading

from confluent_kafka import Producer as ConfluentProducer
from kio.schema.errors import ErrorCode

from tests.broker.batches import batch, decode
from tests.broker.conftest import (
    WireClient,
    create_topics_request,
    fetch_request,
    metadata_request,
    only_partition,
    produce_request,
    req,
)
from tests.waiting import wait_until
from twophase.broker.storage import LogManager
from twophase.client import Producer

API_VERSIONS = req(18, 3, client_software_name="partitions-test", client_software_version="1")


def topic_dirs(data_dir, name: str) -> list[str]:
    return [e for e in os.listdir(data_dir) if e.rpartition("-")[0] == name]


def test_creates_beyond_the_partition_limit_are_refused_and_leave_nothing(broker_factory, tmp_path, topic):
    data_dir = tmp_path / "data"
    broker = broker_factory(data_dir=data_dir, max_partitions=10, default_partitions=2)
    with WireClient(broker.port) as client:
        [created] = client.request(create_topics_request((f"{topic}-a", 6, -1, None))).topics
        assert created.error_code == ErrorCode.none
        # Three topics in one request: the second would make 13 partitions.
        response = client.request(create_topics_request(
            (f"{topic}-b", 2, -1, None), (f"{topic}-c", 3, -1, None), (f"{topic}-d", 2, -1, None)))
        b, c, d = response.topics
        assert b.error_code == ErrorCode.none
        assert c.error_code == ErrorCode.policy_violation
        assert "max_partitions" in c.error_message and "limit of 10" in c.error_message
        assert d.error_code == ErrorCode.none  # 10 exactly
        # validate_only meets the same limit.
        [checked] = client.request(create_topics_request((f"{topic}-e", 1, -1, None), validate_only=True)).topics
        assert checked.error_code == ErrorCode.policy_violation
        # Auto-creation too, by Metadata and by Produce.
        [auto] = client.request(metadata_request(12, [f"{topic}-f"])).topics
        assert auto.error_code == ErrorCode.policy_violation
        produced = only_partition(client.request(produce_request(f"{topic}-g", batch([b"x"]))))
        assert produced.error_code == ErrorCode.policy_violation
        # Nothing of the refused topics exists: not served, not on disk, not in topics.json.
        listed = {t.name: len(t.partitions) for t in client.request(metadata_request(12)).topics}
        assert listed == {f"{topic}-a": 6, f"{topic}-b": 2, f"{topic}-d": 2}
    with open(data_dir / "topics.json") as f:
        assert set(json.load(f)["topics"]) == set(listed)
    for refused in "cefg":
        assert topic_dirs(data_dir, f"{topic}-{refused}") == []


def hold_creation(monkeypatch) -> tuple[threading.Event, threading.Event]:
    """(entered, release): a topic's files are made only once ``release`` is set; ``entered`` says a
    create is being held."""
    entered, release = threading.Event(), threading.Event()
    create_files = LogManager.create_topic_files

    def held_create_files(self, name, info):
        # Held until the other client was answered: were this on the event loop, nobody would be.
        entered.set()
        release.wait(60)
        return create_files(self, name, info)

    monkeypatch.setattr(LogManager, "create_topic_files", held_create_files)
    return entered, release


def test_other_clients_are_served_while_a_topic_is_created(broker_factory, topic, monkeypatch):
    broker = broker_factory()
    entered, release = hold_creation(monkeypatch)
    creator = WireClient(broker.port, timeout=90)
    try:
        correlation = creator.send(create_topics_request((topic, 200, -1, None)))
        assert entered.wait(60), "the create never started"
        with WireClient(broker.port, timeout=30) as other:
            assert other.request(API_VERSIONS).error_code == ErrorCode.none
            # Nothing half-made is visible meanwhile, and the name is taken.
            assert topic not in {t.name for t in other.request(metadata_request(12)).topics}
            [again] = other.request(create_topics_request((topic, 1, -1, None))).topics
            assert again.error_code == ErrorCode.topic_already_exists
        release.set()
        [created] = creator.recv(type(create_topics_request((topic, 1, -1, None))), correlation).topics
        assert created.error_code == ErrorCode.none
        [described] = creator.request(metadata_request(12, [topic])).topics
        assert len(described.partitions) == 200
    finally:
        release.set()
        creator.close()


def test_other_clients_are_served_while_a_produce_auto_creates_its_topic(broker_factory, topic, monkeypatch):
    broker = broker_factory(default_partitions=50)
    entered, release = hold_creation(monkeypatch)
    producer = WireClient(broker.port, timeout=90)
    try:
        request = produce_request(topic, batch([b"first"]))
        correlation = producer.send(request)
        assert entered.wait(60), "the auto-create never started"
        with WireClient(broker.port, timeout=30) as other:
            assert other.request(API_VERSIONS).error_code == ErrorCode.none
        release.set()
        assert only_partition(producer.recv(type(request), correlation)).error_code == ErrorCode.none
        [described] = producer.request(metadata_request(12, [topic])).topics
        assert len(described.partitions) == 50
        fetched = only_partition(producer.request(fetch_request(topic, 0)))
        assert [value for *_, value in decode(fetched.records)] == [b"first"]
    finally:
        release.set()
        producer.close()


def test_concurrent_auto_creates_of_one_topic_are_told_to_retry_and_all_succeed(broker_factory, topic, monkeypatch):
    broker = broker_factory(default_partitions=2)
    entered, release = hold_creation(monkeypatch)
    refused = []  # auto-creates answered "being created" (LEADER_NOT_AVAILABLE)
    being_created = LogManager.being_created

    def counted(self, name):
        held = being_created(self, name)
        if held:
            refused.append(name)
        return held

    monkeypatch.setattr(LogManager, "being_created", counted)
    first = WireClient(broker.port, timeout=90)
    threads: list[threading.Thread] = []
    try:
        correlation = first.send(metadata_request(12, [topic]))
        assert entered.wait(60), "the auto-create never started"
        with WireClient(broker.port, timeout=30) as other:
            # A retriable answer while it is created (TOPIC_ALREADY_EXISTS would be final for a client).
            [described] = other.request(metadata_request(12, [topic])).topics
            assert described.error_code == ErrorCode.leader_not_available
            produced = only_partition(other.request(produce_request(topic, batch([b"raw"]))))
            assert produced.error_code == ErrorCode.leader_not_available
            # An explicit create is refused as Kafka does.
            [again] = other.request(create_topics_request((topic, 1, -1, None))).topics
            assert again.error_code == ErrorCode.topic_already_exists
        # Real clients auto-creating the same topic meanwhile retry until it exists.
        delivered: dict[str, object] = {}

        def ours() -> None:
            with Producer(broker.bootstrap) as producer:
                producer.send(topic, value=b"ours", partition=0)
                producer.flush()
            delivered["twophase"] = None

        def theirs() -> None:
            producer = ConfluentProducer({"bootstrap.servers": broker.bootstrap})
            producer.produce(topic, b"theirs", partition=1,
                             on_delivery=lambda err, msg: delivered.__setitem__("confluent", err))
            producer.flush(60)

        threads = [threading.Thread(target=ours, daemon=True), threading.Thread(target=theirs, daemon=True)]
        for thread in threads:
            thread.start()
        wait_until(lambda: refused.count(topic) >= 4, what="the clients told to retry")
        release.set()
        [created] = first.recv(type(metadata_request(12, [topic])), correlation).topics
        assert created.error_code == ErrorCode.none and len(created.partitions) == 2
        for thread in threads:
            thread.join(90)
        assert delivered == {"twophase": None, "confluent": None}
        for partition, value in ((0, b"ours"), (1, b"theirs")):
            fetched = only_partition(first.request(fetch_request(topic, 0, partition=partition)))
            assert [v for *_, v in decode(fetched.records)] == [value]
    finally:
        release.set()
        for thread in threads:
            thread.join(90)
        first.close()


def test_a_create_cancelled_twice_is_undone_once_its_files_are_made(broker_factory, topic, monkeypatch):
    broker = broker_factory()
    entered, release = hold_creation(monkeypatch)
    try:
        creating = broker.call(lambda: asyncio.ensure_future(broker.create_topic_async(topic, 3)))
        assert entered.wait(60), "the create never started"
        broker.call(creating.cancel)  # say its client went away...
        broker.call(lambda: None)  # (the task has taken the first cancellation)
        broker.call(creating.cancel)  # ...and then the broker stops
        wait_until(lambda: broker.call(creating.done), what="the create given up")
        assert broker.call(creating.cancelled)
    finally:
        release.set()
    # The name is given back and nothing of the topic stays once the thread has made its files.
    wait_until(lambda: not broker.call(broker.logs.being_created, topic), what="the name given back")
    assert topic not in broker.call(broker.topics)
    wait_until(lambda: topic_dirs(broker.data_dir, topic) == [], what="its directories removed")
    with WireClient(broker.port) as client:
        [created] = client.request(create_topics_request((topic, 2, -1, None))).topics
        assert created.error_code == ErrorCode.none


def test_a_broker_with_2000_partitions_restarts_and_serves_them_under_a_low_descriptor_limit(broker_cli, tmp_path):
    topics = [f"many-{i}" for i in range(20)]
    first = broker_cli("--fsync", "1000", data_dir=tmp_path / "data")
    with WireClient(first.port, timeout=120) as client:
        results = client.request(create_topics_request(*((name, 100, -1, None) for name in topics))).topics
        assert [r.error_code for r in results] == [ErrorCode.none] * 20
    first.stop()

    def low_descriptor_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))

    second = broker_cli("--fsync", "1000", data_dir=tmp_path / "data", preexec_fn=low_descriptor_limit)
    with WireClient(second.port, timeout=120) as client:
        listed = {t.name: len(t.partitions) for t in client.request(metadata_request(12)).topics}
        assert listed == {name: 100 for name in topics}
        # Every partition takes a record and gives it back: more partitions than descriptors are used.
        for name in topics:
            for p in range(100):
                response = client.request(produce_request(name, batch([f"{name}/{p}".encode()]), partition=p))
                assert only_partition(response).error_code == ErrorCode.none
        for name in topics:
            for p in range(100):
                fetched = only_partition(client.request(fetch_request(name, 0, partition=p)))
                assert [value for *_, value in decode(fetched.records)] == [f"{name}/{p}".encode()]
    assert "Too many open files" not in second.output()
