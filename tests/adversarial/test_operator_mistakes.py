"""A careless operator against the broker's data directory: a lost or damaged ``topics.json``, a deleted
lock, a second broker, damaged state files, and topic names that try to forge log lines.

Safe outcome: committed records are never removed by a broker that does not know it owns them; a
second broker on a directory in use is refused; a damaged state file stops the start with a message
naming it (exit 2, no traceback) and changes nothing on disk.
"""

from __future__ import annotations

import json
import logging
import os

import pytest
from kio.schema.errors import ErrorCode

from tests.broker.batches import batch
from tests.broker.conftest import (
    WireClient,
    create_topics_request,
    only_partition,
    produce_request,
)
from tests.client.conftest import drain
from twophase import cli
from twophase.broker import Broker
from twophase.broker.storage import DataDirLockedError
from twophase.client import Admin, Consumer, Producer


def produce(bootstrap: str, topic: str, values: list[bytes]) -> None:
    with Producer(bootstrap) as p:  # acks=all: acknowledged means fsynced under the default fsync
        for value in values:
            p.send(topic, value=value, partition=0)
        p.flush()


def read_all(bootstrap: str, topic: str, expected: int) -> list[bytes]:
    with Consumer(bootstrap) as c:
        c.assign([(topic, 0)])
        return [m.value for m in drain(c, expected)]


def snapshot(directory: str) -> dict[str, bytes]:
    """Every file under ``directory`` with its bytes."""
    out = {}
    for parent, _, files in os.walk(directory):
        for name in files:
            with open(os.path.join(parent, name), "rb") as f:
                out[os.path.relpath(os.path.join(parent, name), directory)] = f.read()
    return out


def test_lost_topics_json_and_auto_create_keep_the_committed_records(broker_factory, tmp_path, topic, caplog):
    data_dir = tmp_path / "data"
    first = broker_factory(data_dir=data_dir)  # auto-create on: the producer creates the topic
    produce(first.bootstrap, topic, [b"old-%d" % i for i in range(5)])
    first.stop()
    os.remove(data_dir / "topics.json")

    with caplog.at_level(logging.WARNING, logger="twophase.broker"):
        second = broker_factory(data_dir=data_dir)
    assert any(topic in r.getMessage() and "recovered" in r.getMessage() for r in caplog.records)
    produce(second.bootstrap, topic, [b"new"])  # the first producer after the loss: auto-create must not run
    assert read_all(second.bootstrap, topic, 6) == [b"old-%d" % i for i in range(5)] + [b"new"]
    assert topic in json.loads((data_dir / "topics.json").read_text())["topics"]


def test_a_second_broker_is_refused_even_after_the_lock_files_are_deleted(broker_factory, tmp_path, topic):
    data_dir = tmp_path / "data"
    first = broker_factory(data_dir=data_dir)
    produce(first.bootstrap, topic, [b"kept"])
    for name in os.listdir(data_dir):  # what an operator takes for a stale lock
        if name.startswith(".") and os.path.isfile(data_dir / name):
            os.remove(data_dir / name)
    with pytest.raises(DataDirLockedError, match="in use by another broker"):
        Broker(str(data_dir)).start()
    assert read_all(first.bootstrap, topic, 1) == [b"kept"]


def test_creating_a_topic_over_unknown_records_is_refused(broker_factory, tmp_path, topic, caplog):
    data_dir = tmp_path / "data"
    first = broker_factory(data_dir=data_dir)
    Admin(first.bootstrap).create_topics({topic: 2})
    with Producer(first.bootstrap) as p:
        p.send(topic, value=b"precious", partition=1)
        p.flush()
    first.stop()
    # Partition 0 gone and topics.json without the topic: partition 1 cannot be recovered as a topic.
    os.rename(data_dir / f"{topic}-0", tmp_path / "elsewhere")
    metadata = json.loads((data_dir / "topics.json").read_text())
    del metadata["topics"][topic]
    (data_dir / "topics.json").write_text(json.dumps(metadata))
    before = snapshot(str(data_dir / f"{topic}-1"))

    with caplog.at_level(logging.WARNING, logger="twophase.broker"):
        second = broker_factory(data_dir=data_dir)
    assert any(f"{topic}-1" in r.getMessage() and "left untouched" in r.getMessage() for r in caplog.records)
    with WireClient(second.port) as wire:
        [result] = wire.request(create_topics_request((topic, 1, 1, None))).topics
        assert result.error_code == ErrorCode.topic_already_exists
        assert f"{topic}-1" in result.error_message and "never overwritten" in result.error_message
        # Auto-create on produce meets the same refusal.
        assert only_partition(wire.request(produce_request(topic, batch([b"x"])))).error_code != 0
    assert topic not in second.topics()
    assert snapshot(str(data_dir / f"{topic}-1")) == before


def run_broker_cli(data_dir, capsys) -> tuple[int, str]:
    code = cli.main(["broker", "--data-dir", str(data_dir), "--port", "0"])
    return code, capsys.readouterr().err


@pytest.mark.parametrize("content, complaint", [
    pytest.param("{}", '"topics" object', id="no-topics"),
    pytest.param("[]", '"topics" object', id="a-list"),
    pytest.param('{"topics": []}', '"topics" object', id="topics-a-list"),
    pytest.param("{damaged", "unreadable", id="not-json"),
    pytest.param('{"topics": {"t": {"topic_id": "nope", "partitions": 1}}}', "topic 't'", id="bad-id"),
    pytest.param('{"topics": {"t": {"topic_id": "%s", "partitions": 0}}}', "partition count", id="no-partitions"),
    pytest.param('{"topics": {"t": {"topic_id": "%s", "partitions": 1, "config": {"x": 1}}}}', "unsupported",
                 id="bad-config"),
    pytest.param('{"topics": {"../../escaped": {"topic_id": "%s", "partitions": 1}}}', "characters outside",
                 id="traversal"),
    pytest.param('{"topics": {"a\\nFORGED LINE": {"topic_id": "%s", "partitions": 1}}}', "characters outside",
                 id="newline"),
])
def test_a_damaged_topics_json_stops_the_start_with_a_message(tmp_path, capsys, content, complaint):
    data_dir = tmp_path / "nested" / "data"
    data_dir.mkdir(parents=True)
    (data_dir / "topics.json").write_text(content.replace("%s", "00000000-0000-4000-8000-000000000001"))
    before = snapshot(str(tmp_path))
    code, err = run_broker_cli(data_dir, capsys)
    assert code == 2
    assert "topics.json" in err and complaint in err and "Traceback" not in err
    assert "\nFORGED" not in err
    assert snapshot(str(tmp_path)) == before  # nothing created, in or out of the data directory
    assert sorted(os.listdir(tmp_path)) == ["nested"]


@pytest.mark.parametrize("content", ["{}", "[]", '{"next_unreserved": "7"}', '{"next_unreserved": -1}', "{"])
def test_a_damaged_producer_ids_file_stops_the_start_with_a_message(tmp_path, capsys, content):
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    (data_dir / "producer-ids.json").write_text(content)
    code, err = run_broker_cli(data_dir, capsys)
    assert code == 2
    assert "producer-ids.json" in err and "Traceback" not in err
    assert (data_dir / "producer-ids.json").read_text() == content


def test_topic_names_cannot_forge_log_lines(broker, caplog):
    with caplog.at_level(logging.INFO, logger="twophase.broker"), WireClient(broker.port) as wire:
        response = wire.request(produce_request("x\n2026-01-01 ERROR forged", batch([b"v"])))
        assert only_partition(response).error_code == ErrorCode.invalid_topic_exception
    assert caplog.records, "the refusal is logged"
    assert not any("\n2026-01-01 ERROR forged" in r.getMessage() for r in caplog.records)
