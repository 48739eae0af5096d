"""LogManager: topics, metadata persistence, name validation, locking, periodic work."""

from __future__ import annotations

import errno
import json
import os
import uuid

import pytest

from twophase.broker.storage import (
    DataDirLockedError,
    LogConfig,
    LogManager,
    TopicInfo,
    run_flushes,
)
from twophase.broker.storage import manager as manager_module
from twophase.broker.storage.manager import DELETING_MARKER
from twophase.wire.errors import (
    InvalidConfigError,
    InvalidPartitionsError,
    InvalidTopicError,
    TopicAlreadyExistsError,
    UnknownTopicOrPartitionError,
)

from .batches import batch, decode


@pytest.fixture
def data_dir(tmp_path):
    return str(tmp_path / "data")


def test_create_append_reopen(data_dir):
    manager = LogManager(data_dir)
    info = manager.create_topic("orders", 3, config={"retention.ms": "3600000", "segment_bytes": 4096})
    assert isinstance(info.topic_id, uuid.UUID) and info.partitions == 3
    manager.partition("orders", 2).append(batch([b"hello"]), 0)
    assert sorted(os.listdir(data_dir)) == ["orders-0", "orders-1", "orders-2", "topics.json"]
    manager.close()

    reopened = LogManager(data_dir)
    overrides = {"retention_ms": 3600000, "segment_bytes": 4096}
    assert reopened.topics() == {"orders": TopicInfo(info.topic_id, 3, overrides)}
    config = reopened.topic_config("orders")
    assert (config.retention_ms, config.segment_bytes) == (3600000, 4096)
    assert reopened.partition("orders", 2).config == config
    assert [v for *_, v in decode(reopened.partition("orders", 2).read(0, 1000))] == [b"hello"]
    reopened.close()


def test_metadata_file_is_plain_json(data_dir):
    manager = LogManager(data_dir)
    info = manager.create_topic("a", 1)
    with open(os.path.join(data_dir, "topics.json")) as f:
        assert json.load(f)["topics"]["a"] == {"topic_id": str(info.topic_id), "partitions": 1, "config": {}}
    assert not [n for n in os.listdir(data_dir) if n.endswith(".tmp")]
    manager.close()


@pytest.mark.parametrize("name", ["", ".", "..", "a" * 250, "has space", "slash/es", "ünï", "colon:"])
def test_invalid_topic_names(data_dir, name):
    manager = LogManager(data_dir)
    with pytest.raises(InvalidTopicError) as info:
        manager.create_topic(name, 1)
    assert info.value.code == 17
    assert manager.topics() == {}


def test_valid_unusual_names(data_dir):
    manager = LogManager(data_dir)
    for name in ["a" * 249, "...", "__consumer_offsets", "with-dash-0", "A.b_c-9"]:
        manager.create_topic(name, 2)
    manager.partition("with-dash-0", 1).append(batch([b"x"]), 0)
    manager.close()
    reopened = LogManager(data_dir)
    assert reopened.partition("with-dash-0", 1).high_watermark == 1  # dir "with-dash-0-1"
    assert len(reopened.topics()) == 5


def test_duplicate_and_colliding_topics(data_dir):
    manager = LogManager(data_dir)
    manager.create_topic("a.b", 1)
    with pytest.raises(TopicAlreadyExistsError) as info:
        manager.create_topic("a.b", 1)
    assert info.value.code == 36
    with pytest.raises(InvalidTopicError):
        manager.create_topic("a_b", 1)


def test_bad_partitions_and_config(data_dir):
    manager = LogManager(data_dir)
    with pytest.raises(InvalidPartitionsError):
        manager.create_topic("t", 0)
    with pytest.raises(InvalidConfigError) as info:
        manager.create_topic("t", 1, config={"cleanup.policy": "compact"})
    assert info.value.code == 40
    with pytest.raises(InvalidConfigError):
        manager.create_topic("t", 1, config={"retention.ms": "soon"})
    with pytest.raises(InvalidConfigError):
        manager.create_topic("t", 1, config={"segment.bytes": "10"})
    assert manager.topics() == {}


def test_unknown_topic_or_partition(data_dir):
    manager = LogManager(data_dir)
    manager.create_topic("t", 2)
    for topic, p in [("t", 2), ("t", -1), ("nope", 0)]:
        with pytest.raises(UnknownTopicOrPartitionError) as info:
            manager.partition(topic, p)
        assert info.value.code == 3
    with pytest.raises(UnknownTopicOrPartitionError):
        manager.delete_topic("nope")


def test_delete_topic_and_recreate(data_dir):
    manager = LogManager(data_dir)
    old = manager.create_topic("t", 2)
    manager.partition("t", 0).append(batch([b"old"]), 0)
    manager.delete_topic("t")
    assert manager.topics() == {} and not os.path.exists(os.path.join(data_dir, "t-0"))
    new = manager.create_topic("t", 1)
    assert new.topic_id != old.topic_id
    assert manager.partition("t", 0).high_watermark == 0
    manager.close()
    assert set(LogManager(data_dir).topics()) == {"t"}


def test_directories_topics_json_does_not_name_are_recovered_not_removed(data_dir, caplog):
    manager = LogManager(data_dir)
    manager.create_topic("t", 2, {"retention.ms": "1000"})
    manager.partition("t", 1).append(batch([b"old"]), 0)
    manager.create_topic("empty", 1)
    manager.close()
    # topics.json lost its entries (a crash in a delete after the metadata update looks the same).
    with open(os.path.join(data_dir, "topics.json"), "w") as f:
        json.dump({"version": 1, "topics": {}}, f)
    reopened = LogManager(data_dir)
    assert {name: info.partitions for name, info in reopened.topics().items()} == {"t": 2}
    assert reopened.topics()["t"].config == {}  # the overrides were in the lost entry
    assert reopened.partition("t", 1).high_watermark == 1
    assert "'t' (2 partitions)" in caplog.text and "recovered" in caplog.text
    with pytest.raises(TopicAlreadyExistsError):
        reopened.create_topic("t", 1)
    reopened.create_topic("empty", 3)  # held no records: nothing to recover, its leftovers are replaced
    reopened.close()
    assert set(LogManager(data_dir).topics()) == {"t", "empty"}  # written back to topics.json


def test_a_delete_cut_short_by_a_crash_is_finished_at_start(data_dir, caplog):
    manager = LogManager(data_dir)
    manager.create_topic("t", 2)
    for p in range(2):
        manager.partition("t", p).append(batch([b"old"]), 0)
    manager.close()
    # The crash came after topics.json dropped the topic and the first partition was marked.
    with open(os.path.join(data_dir, "topics.json"), "w") as f:
        json.dump({"version": 1, "topics": {}}, f)
    open(os.path.join(data_dir, "t-0", DELETING_MARKER), "w").close()
    reopened = LogManager(data_dir)
    assert reopened.topics() == {} and not {"t-0", "t-1"} & set(os.listdir(data_dir))
    assert "finishing the delete of topic 't' a crash cut short" in caplog.text
    reopened.create_topic("t", 1)
    assert reopened.partition("t", 0).high_watermark == 0


def test_empty_leftovers_are_replaced_records_never(data_dir):
    manager = LogManager(data_dir)
    manager.create_topic("t", 1)
    manager.close()
    os.makedirs(os.path.join(data_dir, "t-3"))  # a create interrupted before topics.json named it: empty
    open(os.path.join(data_dir, "t-3", "00000000000000000000.log"), "wb").close()
    reopened = LogManager(data_dir)
    reopened.delete_topic("t")
    reopened.create_topic("t", 4)  # t-3 held no records: replaced
    reopened.partition("t", 3).append(batch([b"kept"]), 0)
    reopened.close()
    with open(os.path.join(data_dir, "topics.json"), "w") as f:
        json.dump({"version": 1, "topics": {}}, f)
    os.rename(os.path.join(data_dir, "t-0"), os.path.join(data_dir, "moved"))  # t cannot be recovered now
    again = LogManager(data_dir)
    assert "t" not in again.topics()
    with pytest.raises(TopicAlreadyExistsError, match="t-3"):
        again.create_topic("t", 1)
    assert again.check_new_topic("u", 1) == {}
    assert os.path.getsize(os.path.join(data_dir, "t-3", "00000000000000000000.log")) > 0


def test_data_dir_lock(data_dir):
    manager = LogManager(data_dir)
    with pytest.raises(DataDirLockedError):
        LogManager(data_dir)
    manager.close()
    LogManager(data_dir).close()


def test_flush_due_and_retention(data_dir):
    manager = LogManager(data_dir, LogConfig(flush=100, segment_bytes=1024, retention_ms=1000))
    manager.create_topic("t", 2)
    for i in range(30):
        manager.partition("t", i % 2).append(batch([b"x" * 50], timestamp=0), 0)
    due = manager.flush_due(now_ms=10_000)
    assert len(due) == 2
    assert run_flushes(due) == []
    assert manager.flush_due(now_ms=10_001) == []
    assert manager.enforce_retention(now_ms=10_000) > 0
    assert manager.partition("t", 0).log_start_offset == manager.partition("t", 0).high_watermark == 15


def test_a_log_without_a_spare_descriptor_stays_unsynced_and_is_flushed_later(data_dir, monkeypatch):
    manager = LogManager(data_dir, LogConfig(flush=100))
    manager.create_topic("t", 2)
    for p in range(2):
        manager.partition("t", p).append(batch([b"x"]), 0)

    def no_descriptors(fd):
        raise OSError(errno.EMFILE, "Too many open files")

    with monkeypatch.context() as patch:
        patch.setattr(os, "dup", no_descriptors)
        assert manager.flush_due(now_ms=10_000) == []  # postponed, nothing handed out, nothing leaked
    due = manager.flush_due(now_ms=10_100)
    assert len(due) == 2 and run_flushes(due) == []
    manager.close()


def test_default_config():
    config = LogConfig()
    assert (config.segment_bytes, config.index_interval_bytes, config.retention_bytes) == (64 << 20, 4096, -1)
    assert (config.retention_ms, config.flush, config.flush_interval_ms) == (7 * 24 * 3600 * 1000, "always", None)
    assert LogConfig(flush=250).flush_interval_ms == 250
    assert config.with_overrides({"flush.ms": "50"}).flush == 50
    with pytest.raises(InvalidConfigError):
        LogConfig(flush="sometimes")


class Crash(BaseException):
    """The process dying at this point: no except-clause of the code runs (only finally-clauses)."""


@pytest.mark.parametrize("crash_at", ["first mark", "second mark", "topics.json save"])
def test_a_crash_early_in_a_topic_delete_never_brings_the_topic_back_renamed(data_dir, monkeypatch, crash_at):
    """Before topics.json drops the topic the delete has not happened: the topic stays as it was (same id,
    configs, records). Before, a crash between that save and the first delete mark recovered the topic
    at the next start with a new id and default configs."""
    manager = LogManager(data_dir)
    created = manager.create_topic("t", 2, {"retention.ms": "1000000"})
    for p in range(2):
        manager.partition("t", p).append(batch([b"old"]), 0)
    marks = []
    real_mark = manager_module._mark_for_deletion

    def mark(directory: str) -> None:
        marks.append(directory)
        if (crash_at, len(marks)) in (("first mark", 1), ("second mark", 2)):
            raise Crash()
        real_mark(directory)

    monkeypatch.setattr(manager_module, "_mark_for_deletion", mark)
    if crash_at == "topics.json save":
        monkeypatch.setattr(manager, "_save_metadata", lambda topics: (_ for _ in ()).throw(Crash()))
    with pytest.raises(Crash):
        manager.delete_topic("t")
    manager.close()
    monkeypatch.undo()

    reopened = LogManager(data_dir)
    try:
        assert reopened.topics() == {"t": created}
        for p in range(2):
            assert [v for *_, v in decode(reopened.partition("t", p).read(0, 1 << 20))] == [b"old"]
            assert DELETING_MARKER not in os.listdir(os.path.join(data_dir, f"t-{p}"))
    finally:
        reopened.close()


def test_a_failed_topics_json_save_leaves_the_topic_and_no_delete_marks(data_dir, monkeypatch):
    manager = LogManager(data_dir)
    manager.create_topic("t", 1)
    manager.partition("t", 0).append(batch([b"old"]), 0)

    def full(topics):
        raise OSError(errno.ENOSPC, "No space left on device")  # before topics.json was replaced

    monkeypatch.setattr(manager, "_save_metadata", full)
    with pytest.raises(OSError):
        manager.delete_topic("t")
    monkeypatch.undo()
    assert "t" in manager.topics() and manager.partition("t", 0).high_watermark == 1
    assert DELETING_MARKER not in os.listdir(os.path.join(data_dir, "t-0"))
    manager.close()
    reopened = LogManager(data_dir)
    assert "t" in reopened.topics()
    reopened.close()
