"""LogSink with Spark's Kafka sink columns (``columns="kafka"``), row by row and an Arrow batch at a
time, against the real built-in broker; an independent confluent-kafka read_committed consumer
(examples.log_sink_query.read_topic) counts every record. No Spark here."""

from __future__ import annotations

import time
import uuid
from datetime import datetime, timezone

import pyarrow as pa
import pytest

from examples.log_sink_query import read_topic
from sinks.log import LogSink
from sinks.log_columns import HEADERS_TYPE, kafka_record, validate_kafka_schema
from tests.broker.conftest import broker, broker_factory, topic  # noqa: F401  (fixtures)
from twophase.client import Producer
from twophase.client.partitioner import partition_for_key
from twophase.sink import Record, TxnContext

HEADERS = pa.list_(pa.struct([("key", pa.string()), ("value", pa.binary())]))


def ctx(attempt=0, partition=0) -> TxnContext:
    return TxnContext("app", "q-1", "r1", 0, partition, attempt)


def timestamps(bootstrap, topic):
    """value -> timestamp (ms) of every committed record of ``topic``."""
    return {m.value(): m.timestamp()[1] for m in read_topic(bootstrap, topic)}


def seen(bootstrap, topic, isolation="read_committed"):
    """(partition, key, value, headers) of every record of ``topic``, sorted."""
    return sorted(((m.partition(), m.key(), m.value(), tuple(m.headers() or ()))
                   for m in read_topic(bootstrap, topic, isolation=isolation)),
                  key=lambda r: (r[0], r[1] or b"", r[2] or b"", r[3]))


def new_topics(broker, n, partitions=3):
    names = [f"t-{uuid.uuid4().hex[:10]}" for _ in range(n)]
    for name in names:
        broker.create_topic(name, partitions)
    return names


def three_topic_batch(topics, rows=300):
    return pa.RecordBatch.from_pydict({
        "key": pa.array([f"k{i}".encode() for i in range(rows)], pa.binary()),
        "value": pa.array([f"v{i}" for i in range(rows)], pa.string()),
        "topic": pa.array([topics[i % 3] for i in range(rows)], pa.string()),
    })


def write_batches(sink, context, *batches):
    txn = sink.begin_transaction(context)
    for batch in batches:
        sink.write_batch(txn, batch)
    return sink.pre_commit(txn)


def test_write_batch_across_three_topics_is_one_transaction_committed_at_once(broker):
    topics = new_topics(broker, 3)
    sink = LogSink(broker.bootstrap, columns="kafka")
    batch = three_topic_batch(topics)
    handle = write_batches(sink, ctx(), batch.slice(0, 100), batch.slice(100))
    assert handle.records == 300
    assert [len(seen(broker.bootstrap, t, "read_uncommitted")) for t in topics] == [100, 100, 100]  # durable
    assert [seen(broker.bootstrap, t) for t in topics] == [[], [], []]                              # invisible
    sink.commit(handle)
    for n, t in enumerate(topics):
        assert sorted(value for _, _, value, _ in seen(broker.bootstrap, t)) == sorted(
            f"v{i}".encode() for i in range(n, 300, 3))


def test_an_aborted_multi_topic_transaction_leaves_nothing_visible_anywhere(broker):
    topics = new_topics(broker, 3)
    sink = LogSink(broker.bootstrap, columns="kafka")
    sink.abort(write_batches(sink, ctx(), three_topic_batch(topics)))
    assert [len(seen(broker.bootstrap, t, "read_uncommitted")) for t in topics] == [100, 100, 100]
    assert [seen(broker.bootstrap, t) for t in topics] == [[], [], []]


def test_per_row_key_partition_headers_and_tombstones(broker):
    [out] = new_topics(broker, 1, partitions=4)
    batch = pa.RecordBatch.from_pydict({
        "value": pa.array([b"a", None, b"c", b"d"], pa.binary()),
        "key": pa.array(["k1", "k2", None, "k4"], pa.string()),
        "partition": pa.array([3, 0, 2, None], pa.int32()),
        "headers": pa.array([[{"key": "h", "value": b"1"}, {"key": "h", "value": None}], None, [], None], HEADERS),
        "extra": pa.array([1, 2, 3, 4]),   # ignored, as Spark ignores other columns
    })
    sink = LogSink(broker.bootstrap, out, columns="kafka")
    sink.commit(write_batches(sink, ctx(), batch))
    assert seen(broker.bootstrap, out) == sorted([
        (3, b"k1", b"a", (("h", b"1"), ("h", None))),
        (0, b"k2", None, ()),                       # a null value is a tombstone
        (2, None, b"c", ()),
        (partition_for_key(b"k4", 4), b"k4", b"d", ()),
    ], key=lambda r: (r[0], r[1] or b"", r[2] or b"", r[3]))


def test_string_and_binary_values_write_the_same_bytes(broker):
    [out] = new_topics(broker, 1, partitions=1)
    sink = LogSink(broker.bootstrap, out, columns="kafka")
    text = ["é", "plain", ""]
    as_string = pa.RecordBatch.from_pydict({"value": pa.array(text, pa.string())})
    as_binary = pa.RecordBatch.from_pydict({"value": pa.array([t.encode() for t in text], pa.binary())})
    as_large = pa.RecordBatch.from_pydict({"value": pa.array(text, pa.large_string())})
    sink.commit(write_batches(sink, ctx(), as_string, as_binary, as_large))
    assert sorted(m.value() for m in read_topic(broker.bootstrap, out)) == sorted([t.encode() for t in text] * 3)


def test_the_sinks_topic_overrides_the_topic_column_as_sparks_topic_option_does(broker):
    out, other = new_topics(broker, 2, partitions=1)
    sink = LogSink(broker.bootstrap, out, columns="kafka")
    batch = pa.RecordBatch.from_pydict({"value": [b"x", b"y"], "topic": [other, None]})
    sink.commit(write_batches(sink, ctx(), batch))
    assert len(seen(broker.bootstrap, out)) == 2 and seen(broker.bootstrap, other) == []


def test_write_and_write_batch_produce_identical_records(broker):
    by_row, by_batch = new_topics(broker, 2, partitions=3)
    columns = {
        "key": [b"a", b"b", None, b"d", None],
        "value": ["1", None, "3", "4", "5"],
        "partition": pa.array([None, None, 1, 2, 0], pa.int32()),
        "headers": pa.array([[{"key": "x", "value": b"y"}], None, [], None, [{"key": "z", "value": None}]], HEADERS),
    }
    rows = pa.RecordBatch.from_pydict(columns)
    row_sink = LogSink(broker.bootstrap, by_row, columns="kafka", provenance=True)
    batch_sink = LogSink(broker.bootstrap, by_batch, columns="kafka", provenance=True)
    txn = row_sink.begin_transaction(ctx())
    for row in rows.to_pylist():
        row_sink.write(txn, Record(row))
    row_sink.commit(row_sink.pre_commit(txn))
    batch_sink.commit(write_batches(batch_sink, ctx(), rows))
    written = seen(broker.bootstrap, by_row)
    assert len(written) == 5 and written == seen(broker.bootstrap, by_batch)
    assert all(("twophase.epoch", b"0") in headers for _, _, _, headers in written)


def test_a_timestamp_column_sets_the_record_timestamps_row_and_batch_alike(broker):
    by_row, by_batch = new_topics(broker, 2, partitions=1)
    moment = datetime(2026, 1, 2, 3, 4, 5, 678_901, tzinfo=timezone.utc)
    ms = 1767323045678  # moment in ms, truncated
    spark_like = pa.RecordBatch.from_pydict({   # to_arrow_schema(TimestampType): microseconds, UTC
        "value": [b"ts", b"none"], "timestamp": pa.array([moment, None], pa.timestamp("us", tz="UTC"))})
    as_double = pa.RecordBatch.from_pydict({"value": [b"seconds"], "timestamp": [ms / 1000]})
    for t in (by_row, by_batch):
        sink = LogSink(broker.bootstrap, t, columns="kafka")
        txn = sink.begin_transaction(ctx())
        for batch in (spark_like, as_double):
            if t == by_batch:
                sink.write_batch(txn, batch)
            else:
                for row in batch.to_pylist():
                    sink.write(txn, Record(row))
        sink.commit(sink.pre_commit(txn))
    for t in (by_row, by_batch):
        stamps = timestamps(broker.bootstrap, t)
        assert (stamps[b"ts"], stamps[b"seconds"]) == (ms, ms)
        assert abs(stamps[b"none"] - time.time() * 1000) < 3_600_000   # the time of the write
    naive_local = datetime.fromtimestamp(ms / 1000)       # how PySpark hands a timestamp to foreach
    assert kafka_record({"value": b"v", "timestamp": naive_local}, "t")[5] == ms


def test_a_timestamp_before_1970_is_refused(broker):
    [out] = new_topics(broker, 1, partitions=1)
    sink = LogSink(broker.bootstrap, out, columns="kafka")
    txn = sink.begin_transaction(ctx())
    try:
        with pytest.raises(ValueError, match="timestamp before 1970"):
            sink.write_batch(txn, pa.RecordBatch.from_pydict({"value": [b"v"], "timestamp": [-1.5]}))
        with pytest.raises(ValueError, match="timestamp before 1970"):
            sink.write(txn, {"value": b"v", "timestamp": datetime(1969, 12, 31, tzinfo=timezone.utc)})
    finally:
        sink.abort_transaction(txn)


def test_extract_columns_write_batch_matches_write(broker):
    by_row, by_batch = new_topics(broker, 2, partitions=2)
    data = [{"id": i, "name": f"n{i}"} for i in range(20)]
    batch = pa.RecordBatch.from_pylist(data)
    row_sink = LogSink(broker.bootstrap, by_row, key="id", headers={"src": "t"})
    batch_sink = LogSink(broker.bootstrap, by_batch, key="id", headers={"src": "t"})
    txn = row_sink.begin_transaction(ctx())
    for row in data:
        row_sink.write(txn, row)
    row_sink.commit(row_sink.pre_commit(txn))
    batch_sink.commit(write_batches(batch_sink, ctx(), batch))
    assert len(seen(broker.bootstrap, by_row)) == 20
    assert seen(broker.bootstrap, by_row) == seen(broker.bootstrap, by_batch)


def test_a_row_without_topic_is_refused_before_anything_is_sent(broker):
    [out] = new_topics(broker, 1, partitions=1)
    sink = LogSink(broker.bootstrap, columns="kafka")
    txn = sink.begin_transaction(ctx())
    try:
        with pytest.raises(ValueError, match="topic option required when no 'topic' attribute is present"):
            sink.write_batch(txn, pa.RecordBatch.from_pydict({"value": [b"x"]}))
        with pytest.raises(ValueError, match="null topic present in the data"):
            sink.write_batch(txn, pa.RecordBatch.from_pydict({"value": [b"x", b"y"], "topic": [out, None]}))
        with pytest.raises(ValueError, match="topic option required"):
            sink.write(txn, {"value": b"x"})
        with pytest.raises(ValueError, match="null topic present"):
            sink.write(txn, {"value": b"x", "topic": None})
        assert txn.records == 0
    finally:
        sink.abort_transaction(txn)
    assert seen(broker.bootstrap, out, "read_uncommitted") == []


def test_a_partition_the_topic_lacks_is_an_error(broker):
    [out] = new_topics(broker, 1, partitions=2)
    sink = LogSink(broker.bootstrap, out, columns="kafka")
    txn = sink.begin_transaction(ctx())
    try:
        with pytest.raises(ValueError, match=r"has partitions 0..1, not 5"):
            sink.write_batch(txn, pa.RecordBatch.from_pydict({"value": [b"x"], "partition": pa.array([5], pa.int32())}))
        with pytest.raises(ValueError, match=r"has partitions 0..1, not -1"):
            sink.write(txn, {"value": b"x", "partition": -1})
    finally:
        sink.abort_transaction(txn)


@pytest.mark.parametrize("schema, message", [
    ([("value", pa.int64())], "value attribute unsupported type bigint. value must be a(n) string or binary"),
    ([("key", pa.int32()), ("value", pa.binary())], "key attribute unsupported type int. key must be a(n) "
                                                     "string or binary"),
    ([("value", pa.binary()), ("partition", pa.int64())], "partition attribute unsupported type bigint. "
                                                           "partition must be a(n) int"),
    ([("value", pa.binary()), ("headers", pa.map_(pa.string(), pa.binary()))],
     f"headers attribute unsupported type map<string,binary>. headers must be a(n) {HEADERS_TYPE}"),
    ([("value", pa.binary()), ("headers", pa.list_(pa.struct([("key", pa.string()), ("value", pa.string())])))],
     "headers attribute unsupported type array<struct<key:string,value:string>>"),
    ([("key", pa.binary())], "Required attribute 'value' not found"),
    ([("value", "binary"), ("partition", "bigint")], "partition must be a(n) int"),   # Spark's type names
    ([("value", pa.binary()), ("timestamp", pa.int64())], "timestamp attribute unsupported type bigint. "
                                                           "timestamp must be a(n) double or timestamp"),
    ([("value", pa.binary()), ("timestamp", pa.timestamp("us"))], "unsupported type timestamp_ntz"),
])
def test_bad_column_types_are_refused_with_sparks_messages(schema, message):
    with pytest.raises(ValueError) as e:
        validate_kafka_schema(schema if isinstance(schema[0][1], str) else pa.schema(schema), "out")
    assert message in str(e.value)


def test_a_topic_column_is_type_checked_only_without_the_topic_option():
    validate_kafka_schema(pa.schema([("value", pa.binary()), ("topic", pa.int32())]), "out")
    with pytest.raises(ValueError, match=r"topic attribute unsupported type int\. topic must be a\(n\) string"):
        validate_kafka_schema(pa.schema([("value", pa.binary()), ("topic", pa.int32())]), None)
    validate_kafka_schema([("value", "string"), ("topic", "string"), ("headers", HEADERS_TYPE.replace(",", ", "))],
                          None)


@pytest.mark.parametrize("row, message", [
    ({"value": 1}, "value attribute unsupported type int"),
    ({"value": b"x", "key": 2.0}, "key attribute unsupported type float"),
    ({"value": b"x", "partition": "1"}, "partition attribute unsupported type str"),
    ({"value": b"x", "partition": True}, "partition attribute unsupported type bool"),
    ({"value": b"x", "timestamp": "2026-01-01"}, "timestamp attribute unsupported type str"),
    ({"value": b"x", "headers": [{"key": None, "value": b"v"}]}, "non-null keys"),
    ({"value": b"x", "headers": [{"key": "k", "value": "text"}]}, "headers must be a(n) array"),
    ({"value": b"x", "headers": [{"key": "k", "value": b"v"}, None]}, "a null header: headers must be a(n) array"),
    ({"key": b"x"}, "Required attribute 'value' not found"),
])
def test_bad_row_values_are_refused_on_the_foreach_path(row, message):
    with pytest.raises(ValueError) as e:
        kafka_record(row, "out")
    assert message in str(e.value)


def test_a_spark_row_like_value_reads_as_its_fields():
    record = kafka_record(Record({"value": bytearray(b"v"), "key": "k", "topic": "t",
                                  "headers": [("a", bytearray(b"1"))]}), None)
    assert record == ("t", None, b"k", b"v", [("a", b"1")], None)


@pytest.mark.parametrize("kwargs", [{"key": "id"}, {"value": "v"}, {"headers": {"a": "b"}},
                                    {"serializer": bytes}, {"topic": ""}])
def test_kafka_columns_take_no_extractors(kwargs):
    with pytest.raises(ValueError):
        LogSink("127.0.0.1:9092", columns="kafka", **kwargs)


def test_columns_must_be_known_and_extract_needs_a_topic():
    with pytest.raises(ValueError, match="columns must be"):
        LogSink("127.0.0.1:9092", "t", columns="avro")
    with pytest.raises(ValueError, match="topic is required"):
        LogSink("127.0.0.1:9092")


def test_send_many_queues_records_as_send_does(broker):
    [out] = new_topics(broker, 1, partitions=3)
    with Producer(broker.bootstrap) as producer:
        assert producer.send_many((out, None, f"k{i}".encode(), b"v", None, None) for i in range(3000)) == 3000
        producer.send_many([(out, 1, None, b"explicit", [("h", b"1")], None)])
        with pytest.raises(ValueError, match="has partitions 0..2, not 3"):
            producer.send_many([(out, 3, None, b"x", None, None)])
        producer.flush()
    records = seen(broker.bootstrap, out)
    assert len(records) == 3001 and (1, None, b"explicit", (("h", b"1"),)) in records
    assert all(p == partition_for_key(k, 3) for p, k, _, _ in records if k is not None)
