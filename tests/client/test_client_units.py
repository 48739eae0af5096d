"""Unit tests of the client's pure parts: partitioner, records, read_committed filtering, range
assignor, transaction state machine, prepared-transaction handles, errors."""

from __future__ import annotations

import logging
import struct
import time

import crc32c
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kafka.partitioner.default import murmur2 as kafka_python_murmur2
from kafka.record import MemoryRecords

from tests.broker.batches import batch as independent_batch
from tests.broker.batches import kafka_batch
from twophase.client.consumer import records_of
from twophase.client.errors import (
    ProducerFenced,
    RetriableError,
    TransactionStateError,
    error_for,
)
from twophase.client.group import decode_assignment, encode_subscription, range_assign
from twophase.client.partitioner import StickyPartitions, murmur2, murmur2_many, partition_for_key
from twophase.client.producer import Producer
from twophase.client.transactions import PreparedTxn, TxnState, TxnStateMachine
from twophase.states import IllegalTransition
from twophase.wire.compression import CODEC_NAMES
from twophase.wire.errors import CorruptRecordError, InvalidRecordError, KafkaError
from twophase.wire.records import (
    Record,
    control_batch,
    decode_batch_records,
    record_batch,
    set_base_offset,
    validate_batch,
)


def test_murmur2_matches_java_reference_values():
    # Values of Java's org.apache.kafka.common.utils.Utils.murmur2 (from Kafka's UtilsTest).
    cases = {b"21": -973932308, b"foobar": -790332482, b"a-little-bit-long-string": -985981536,
             b"a-little-bit-longer-string": -1486304829, b"": 275646681,
             b"lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8": -58897971, b"abc": 479470107}
    for key, java in cases.items():
        assert murmur2(key) == java & 0xFFFFFFFF, key


def test_murmur2_matches_kafka_python_on_many_keys():
    for i in range(2000):
        key = f"key-{i}".encode() * (i % 5 + 1)
        assert murmur2(key) == kafka_python_murmur2(key) & 0xFFFFFFFF
        assert partition_for_key(key, 7) == (kafka_python_murmur2(key) & 0x7FFFFFFF) % 7


@settings(max_examples=200, deadline=None)
@given(st.lists(st.binary(max_size=100), max_size=50))  # across VECTOR_KEY_BYTES
def test_murmur2_many_hashes_each_key_as_murmur2_does(keys):
    assert murmur2_many(keys) == [murmur2(key) for key in keys]


def test_murmur2_many_keeps_the_java_reference_values():
    cases = {b"21": -973932308, b"foobar": -790332482, b"": 275646681, b"abc": 479470107,
             b"lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8": -58897971}
    assert murmur2_many(list(cases)) == [java & 0xFFFFFFFF for java in cases.values()]


def test_sticky_partition_changes_only_after_a_batch_is_sent():
    sticky = StickyPartitions()
    first = sticky.partition("t", 5)
    assert all(sticky.partition("t", 5) == first for _ in range(20))
    sticky.batch_sent("t", first)
    assert 0 <= sticky.partition("t", 5) < 5


def test_record_batch_round_trips_and_kafka_python_reads_it():
    records = [(1_000, b"k", b"v", [("h", b"x"), ("n", None)]), (1_007, None, b"w", []), (999, b"k2", None, [])]
    for compression in CODEC_NAMES.values():  # kafka-python with python-snappy, lz4 and zstandard
        data = bytearray(record_batch(records, producer_id=5, producer_epoch=2, base_sequence=10,
                                      transactional=True, compression=compression))
        set_base_offset(data, 0, 100)
        header = validate_batch(data)
        assert (header.producer_id, header.producer_epoch, header.base_sequence) == (5, 2, 10)
        assert header.is_transactional and header.compression == compression and header.max_timestamp == 1_007
        assert decode_batch_records(data) == [
            Record(100, 1_000, b"k", b"v", (("h", b"x"), ("n", None))), Record(101, 1_007, None, b"w", ()),
            Record(102, 999, b"k2", None, ())]
        theirs = list(MemoryRecords(bytes(data)).next_batch())
        assert [(r.offset, r.timestamp, r.key, r.value, r.headers) for r in theirs] == [
            (100, 1_000, b"k", b"v", [("h", b"x"), ("n", None)]), (101, 1_007, None, b"w", []),
            (102, 999, b"k2", None, [])]


def test_decode_reads_batches_written_by_other_encoders():
    assert [(r.offset, r.key, r.value, r.headers) for r in decode_batch_records(independent_batch([b"a", b"b"]))] == [
        (0, None, b"a", (("h", b"x"),)), (1, None, b"b", (("h", b"x"),))]
    assert [r.value for r in decode_batch_records(kafka_batch([b"x", b"y"], compression=1))] == [b"x", b"y"]


def test_decode_rejects_garbage_and_unsupported_codecs():
    data = bytearray(record_batch([(0, None, b"v" * 50, [])]))
    data[-10:] = b"\xff" * 10
    with pytest.raises(InvalidRecordError):  # Kafka's INVALID_RECORD: the records do not parse
        decode_batch_records(data)
    with pytest.raises(CorruptRecordError, match="unknown compression codec 5"):
        decode_batch_records(_with_codec(5))
    with pytest.raises(ValueError):
        record_batch([])


def _with_codec(codec: int) -> bytes:
    data = bytearray(record_batch([(0, None, b"v", [])]))
    struct.pack_into(">h", data, 21, codec)
    struct.pack_into(">I", data, 17, crc32c.crc32c(bytes(data[21:])))
    return bytes(data)


def _at(offset: int, data: bytes) -> bytes:
    buf = bytearray(data)
    set_base_offset(buf, 0, offset)
    return bytes(buf)


def _txn(offset: int, pid: int, *values: bytes) -> bytes:
    return _at(offset, record_batch([(0, None, v, []) for v in values], producer_id=pid, producer_epoch=0,
                                    base_sequence=0, transactional=True))


def test_read_committed_skips_aborted_batches_and_control_batches():
    # pid 1 commits [0,1], pid 2 aborts [2,3] interleaved with pid 1's second transaction (4), which commits.
    data = (_txn(0, 1, b"c0", b"c1") + _at(2, control_batch(1, 0, True, 0, 0)) + _txn(3, 2, b"a0")
            + _txn(4, 1, b"c2") + _txn(5, 2, b"a1") + _at(6, control_batch(2, 0, False, 0, 0))
            + _txn(7, 2, b"c3") + _at(8, control_batch(1, 0, True, 0, 0)) + _at(9, control_batch(2, 0, True, 0, 0)))
    committed, position, corrupt, _ = records_of("t", 0, data, 0, [(2, 3)], read_committed=True)
    assert [m.value for m in committed] == [b"c0", b"c1", b"c2", b"c3"]
    assert position == 10 and corrupt is None
    everything, _, _, _ = records_of("t", 0, data, 0, [(2, 3)], read_committed=False)
    assert [m.value for m in everything] == [b"c0", b"c1", b"a0", b"c2", b"a1", b"c3"]


def test_records_before_the_position_and_a_truncated_tail_are_not_returned():
    data = _at(10, record_batch([(0, None, b"%d" % i, []) for i in range(5)]))
    tail = _at(15, record_batch([(0, None, b"late", [])]))
    messages, position, _, _ = records_of("t", 0, data + tail[:-3], 12, [], read_committed=False)
    assert [m.offset for m in messages] == [12, 13, 14] and position == 15


def test_range_assignor_splits_each_topic_over_its_subscribers():
    out = range_assign({"m2": ["a", "b"], "m1": ["a"], "m3": ["b"]}, {"a": [0, 1, 2], "b": [0, 1, 2, 3]})
    assert decode_assignment(out["m1"]) == [("a", 0), ("a", 1)]
    assert decode_assignment(out["m2"]) == [("a", 2), ("b", 0), ("b", 1)]
    assert decode_assignment(out["m3"]) == [("b", 2), ("b", 3)]
    assert encode_subscription(["b", "a"])[:2] == b"\x00\x00"


def test_transaction_state_machine_refuses_undeclared_transitions():
    s = TxnStateMachine()
    with pytest.raises(IllegalTransition, match="uninitialized -> in_transaction"):
        s.transition(TxnState.IN_TRANSACTION)
    for target in (TxnState.READY, TxnState.IN_TRANSACTION, TxnState.PREPARED, TxnState.COMMITTING, TxnState.READY):
        s.transition(target)
    with pytest.raises(TransactionStateError, match="cannot send in transaction state ready .needs in_transaction"):
        s.require(TxnState.IN_TRANSACTION, action="send")
    s.transition(TxnState.FATAL_ERROR)
    s.transition(TxnState.FATAL_ERROR)  # reachable from every state
    with pytest.raises(IllegalTransition):
        s.transition(TxnState.READY)


def test_prepared_txn_handle_round_trips_through_json():
    handle = PreparedTxn("app-run-1", producer_id=7, producer_epoch=3)
    assert PreparedTxn.from_json(handle.to_json()) == handle
    with pytest.raises(ValueError, match="not a PreparedTxn"):
        PreparedTxn.from_json('{"transactional_id": "x"}')


def test_error_codes_map_to_exception_kinds():
    assert isinstance(error_for(90, "x"), ProducerFenced)
    assert isinstance(error_for(47, "x"), ProducerFenced)
    assert isinstance(error_for(51, "x"), RetriableError)        # CONCURRENT_TRANSACTIONS
    assert isinstance(error_for(88, "x"), RetriableError)        # UNSTABLE_OFFSET_COMMIT
    e = error_for(48, "EndTxn")
    assert type(e) is KafkaError and not e.retriable and "INVALID_TXN_STATE (48)" in str(e)


def test_broker_and_client_errors_share_one_base_with_the_code():
    import twophase.client
    from twophase.wire.errors import KafkaStorageError

    assert twophase.client.KafkaError is KafkaError
    assert all(issubclass(cls, KafkaError) for cls in (ProducerFenced, RetriableError, TransactionStateError,
                                                        CorruptRecordError, KafkaStorageError))
    assert error_for(90, "x").code == 90 and KafkaStorageError("disk").code == 56
    assert KafkaError("gave up").code == -1  # no code: UNKNOWN_SERVER_ERROR
    assert KafkaError("answered", 48).code == 48 and str(CorruptRecordError("bad crc", 7)) == "bad crc (at byte 7)"


def test_a_send_hands_new_partitions_to_a_sender_that_is_idle_again_before_the_sender_looks(caplog):
    """The sender wakes for a new partition, adds it and goes back to waiting before the sending thread
    gets the lock back (a sender without a network round trip, as a fast broker makes it): the send must
    see that the sender woke, not wait for a second while it waits again."""
    producer = Producer("127.0.0.1:9", transactional_id="t", linger_ms=0)  # never connects: _send is replaced
    producer._cluster.partitions = lambda topic, create=False: [0, 1, 2, 3]

    def send_at_once(batches, adding):
        with producer._cond:
            producer._txn_partitions.update(adding)
            for batch in batches:
                producer._queues[(batch.topic, batch.partition)].popleft()

    producer._send = send_at_once
    producer._txn.transition(TxnState.READY)
    producer._txn.transition(TxnState.IN_TRANSACTION)
    try:
        with caplog.at_level(logging.WARNING, logger="twophase.client"):
            for partition in (0, 1, 2, 3, 0, 1):
                while not producer._sender_waiting:  # idle: this send hands a new partition over
                    time.sleep(0.001)
                with producer._cond:
                    producer._txn_partitions.clear()  # a new transaction holds no partition yet
                producer.send("t", b"v", partition=partition)
        assert [r.getMessage() for r in caplog.records] == []
    finally:
        producer.close()
