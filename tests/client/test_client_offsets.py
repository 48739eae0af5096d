"""Offsets for readers that must not skip silently: Admin.list_offsets (earliest, latest, last stable offset,
many partitions in one request per broker) and Consumer(auto_offset_reset="none") raising OffsetOutOfRange."""

from __future__ import annotations

import struct

import crc32c
import pytest

from tests.broker.conftest import with_deleted_head
from twophase.client import (
    EARLIEST,
    LATEST,
    Admin,
    Consumer,
    KafkaError,
    OffsetOutOfRange,
    Producer,
)
from twophase.client.connection import Connection
from twophase.client.consumer import records_of
from twophase.wire.api_keys import ApiKey
from twophase.wire.records import ATTR_LOG_APPEND_TIME, record_batch


def test_list_offsets_earliest_latest_and_the_last_stable_offset_in_one_request(broker, topic, monkeypatch):
    broker.create_topic(topic, 3, {"segment.bytes": "1024", "retention.bytes": "1"})
    with Producer(broker.bootstrap) as p:
        for i in range(60):
            p.send(topic, value=bytes(100), partition=0)
            p.flush()  # a batch each: segments roll and retention deletes the closed ones
        p.send(topic, value=b"x", partition=1)
    with Producer(broker.bootstrap, transactional_id=f"{topic}-open") as txn:
        txn.init_transactions()
        txn.begin_transaction()
        txn.send(topic, value=b"open", partition=2)
        txn.flush()
        with Producer(broker.bootstrap) as p:
            p.send(topic, value=b"after", partition=2)
        requests = []
        original = Connection.request
        monkeypatch.setattr(Connection, "request", lambda self, r, timeout_s=None, while_waiting=None: (
            requests.append(r.__api_key__), original(self, r, timeout_s, while_waiting))[1])
        parts = [(topic, 0), (topic, 1), (topic, 2)]
        with Admin(broker.bootstrap) as admin:
            earliest = admin.list_offsets(parts, EARLIEST)
            assert requests.count(ApiKey.LIST_OFFSETS) == 1
            latest = admin.list_offsets(parts, LATEST)
            stable = admin.list_offsets(parts, LATEST, "read_committed")
            with pytest.raises(ValueError, match="isolation_level"):
                admin.list_offsets(parts, LATEST, "committed")
        txn.abort_transaction()
    assert earliest[(topic, 0)] == broker.partition_log(topic, 0).log_start_offset > 0
    assert earliest[(topic, 1)] == earliest[(topic, 2)] == 0
    assert latest == {(topic, 0): 60, (topic, 1): 1, (topic, 2): 2}
    assert stable == {(topic, 0): 60, (topic, 1): 1, (topic, 2): 0}, "read_committed stops at the open transaction"


def test_auto_offset_reset_none_raises_out_of_range_and_keeps_the_position(broker, topic):
    start = with_deleted_head(broker, topic)
    with Consumer(broker.bootstrap, auto_offset_reset="none") as c:
        c.assign([(topic, 0)])
        with pytest.raises(KafkaError, match="auto_offset_reset is none"):
            c.poll(timeout_s=1)
        c.seek(topic, 0, 0)
        for _ in range(2):  # again at each poll until the caller seeks
            with pytest.raises(OffsetOutOfRange) as caught:
                c.poll(timeout_s=5)
            assert (caught.value.topic, caught.value.partition, caught.value.offset) == (topic, 0, 0)
            assert c.position(topic, 0) == 0
        c.seek(topic, 0, EARLIEST)
        assert [m.offset for m in c.poll(timeout_s=5)][0] == start
    with Consumer(broker.bootstrap) as c:  # the default still resets, to earliest
        c.assign([(topic, 0)])
        c.seek(topic, 0, 0)
        assert c.poll(timeout_s=5)[0].offset == start
    with pytest.raises(ValueError, match="earliest, latest or none"):
        Consumer(broker.bootstrap, auto_offset_reset="smallest")


def test_the_timestamp_type_of_a_message_is_its_batchs():
    """Kafka's LogAppendTime batches (attribute bit 3, set by a broker configured so) give every record
    the batch's max timestamp and timestamp type 1; others are CreateTime, 0."""
    created = record_batch([(1_000, b"k", b"v", ()), (1_005, b"k", b"w", ())])
    appended = bytearray(created)
    struct.pack_into(">h", appended, 21, struct.unpack_from(">h", appended, 21)[0] | ATTR_LOG_APPEND_TIME)
    struct.pack_into(">q", appended, 35, 9_999)  # maxTimestamp: the broker's append time
    struct.pack_into(">I", appended, 17, crc32c.crc32c(bytes(appended[21:])))
    struct.pack_into(">q", appended, 0, 2)  # its base offset: after the first batch
    read = records_of("t", 0, created + bytes(appended), 0, [], read_committed=True)
    assert [(m.timestamp_ms, m.timestamp_type) for m in read.messages] == [(1_000, 0), (1_005, 0)] + [(9_999, 1)] * 2
