"""Attack: many partitions (issue 11, item 7).

Before the fix there was no limit on the partitions of a broker, topic creation ran on the event
loop (other clients stalled for seconds), and every partition held its segment files open, so a
broker with thousands of partitions ran out of descriptors and, under a lower ``ulimit -n``, would
not start again. Now creates beyond ``max_partitions`` are refused, a topic's files are made in a
worker thread, and segment files are opened only while used.
"""

from __future__ import annotations

import json
import os
import resource
import threading

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
from twophase.broker.storage import LogManager

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


def test_other_clients_are_served_while_a_topic_is_created(broker_factory, topic, monkeypatch):
    broker = broker_factory()
    entered, release = threading.Event(), threading.Event()
    create_files = LogManager.create_topic_files

    def held_create_files(self, name, info):
        # Held until the other client was answered: were this on the event loop, nobody would be.
        entered.set()
        release.wait(60)
        return create_files(self, name, info)

    monkeypatch.setattr(LogManager, "create_topic_files", held_create_files)
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
