"""The twophase-kafka source without a Spark session: its options, offset plans and reads, the last two
against the real built-in broker (tests/test_source_spark.py runs it inside Spark)."""

from __future__ import annotations

import json
import logging
import pickle

import pyarrow as pa
import pytest
from pyspark.sql.pandas.types import to_arrow_schema
from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadMaxRows

from tests.broker.conftest import broker, broker_factory, topic, with_deleted_head  # noqa: F401  (fixtures)
from twophase.client import Admin, Message, Producer
from twophase.spark.source import (
    SCHEMA,
    SCHEMA_WITH_HEADERS,
    KafkaRange,
    KafkaSource,
    plan,
    read_range,
    to_record_batch,
)
from twophase.spark.source_offsets import (
    DataLoss,
    OffsetPlanner,
    from_json,
    limit_rows,
    to_json,
)
from twophase.spark.source_options import SourceOptionError, parse_options

BOOT = {"kafka.bootstrap.servers": "127.0.0.1:9092"}


# --- options ----------------------------------------------------------------------------------


def test_options_as_spark_names_them_case_insensitively():
    opts = parse_options({**BOOT, "SUBSCRIBE": "a, b", "startingoffsets": '{"a":{"0":5,"1":-2}}',
                          "maxOffsetsPerTrigger": "100", "failOnDataLoss": "False", "includeHeaders": "true",
                          "kafka.isolation.level": "read_uncommitted", "kafka.group.id": "ignored"}, streaming=True)
    assert (opts.subscribe, opts.starting, opts.max_offsets_per_trigger) == (("a", "b"), {"a": {0: 5, 1: -2}}, 100)
    assert (opts.fail_on_data_loss, opts.include_headers, opts.isolation_level) == (False, True, "read_uncommitted")
    assert parse_options({**BOOT, "assign": '{"t":[1,0]}'}, streaming=False).assign == (("t", 0), ("t", 1))
    batch = parse_options({**BOOT, "subscribePattern": "t-.*"}, streaming=False)
    assert (batch.starting, batch.ending, batch.isolation_level) == ("earliest", "latest", "read_committed")
    assert batch.matches("t-1") and not batch.matches("x-t-1")


@pytest.mark.parametrize("options, streaming, named", [
    ({"subscribe": "t", "kafka.ssl.keystore.location": "/k"}, True, r"'kafka.ssl.keystore.location'.*cannot honour"),
    ({"subscribe": "t", "minPartitions": "4"}, True, "unknown option 'minpartitions'"),
    ({"subscribe": "t", "kafka.auto.offset.reset": "earliest"}, True, "'kafka.auto.offset.reset' is not supported"),
    ({"subscribe": "t", "kafka.security.protocol": "SASL_SSL"}, True, "sasl.mechanism"),
    ({"subscribe": "t", "kafka.sasl.mechanism": "GSSAPI", "kafka.security.protocol": "SASL_SSL"}, True,
     "GSSAPI"),
    ({"subscribe": "t", "twophase.security": "env:K_", "kafka.security.protocol": "SSL"}, True,
     "'twophase.security' and the options .'kafka.security.protocol'. both"),
    ({"subscribe": "t", "twophase.security": "vault:x"}, True, "option 'twophase.security': security source"),
    ({"subscribe": "t", "assign": '{"t":[0]}'}, True, "exactly one of .* not 2 .subscribe, assign"),
    ({}, True, "exactly one of .* not 0"),
    ({"assign": "{t:[0]}"}, True, "option 'assign' is not JSON"),
    ({"assign": '{"t":[-1]}'}, True, "option 'assign' must map"),
    ({"subscribePattern": "("}, True, "option 'subscribePattern'"),
    ({"subscribe": "t", "startingOffsets": "soon"}, True, "option 'startingOffsets'"),
    ({"subscribe": "t", "startingOffsets": '{"t":{"0":-3}}'}, True, "option 'startingOffsets': t-0"),
    ({"subscribe": "t", "startingOffsets": "latest"}, False, "latest is not allowed for a batch"),
    ({"subscribe": "t", "endingOffsets": "latest"}, True, "'endingOffsets' is for batch"),
    ({"subscribe": "t", "endingOffsets": '{"t":{"0":-2}}'}, False, "option 'endingOffsets'"),
    ({"subscribe": "t", "maxOffsetsPerTrigger": "0"}, True, "'maxOffsetsPerTrigger' must be a whole number"),
    ({"subscribe": "t", "maxOffsetsPerTrigger": "10"}, False, "'maxOffsetsPerTrigger' is for streaming"),
    ({"subscribe": "t", "failOnDataLoss": "yes"}, True, "'failOnDataLoss' must be true or false"),
    ({"subscribe": "t", "kafka.isolation.level": "committed"}, True, "kafka.isolation.level"),
])
def test_bad_options_name_the_option(options, streaming, named):
    with pytest.raises(SourceOptionError, match=named):
        parse_options({**BOOT, **options}, streaming=streaming)


def test_bootstrap_is_required_and_checked():
    with pytest.raises(SourceOptionError, match="'kafka.bootstrap.servers' is required"):
        parse_options({"subscribe": "t"}, streaming=True)
    with pytest.raises(SourceOptionError, match="'kafka.bootstrap.servers'"):
        parse_options({"subscribe": "t", "kafka.bootstrap.servers": "nohost"}, streaming=True)


# --- offsets ----------------------------------------------------------------------------------


def test_offsets_are_spark_kafka_json():
    offsets = {("a", 0): 5, ("a", 10): 7, ("b", 1): 0}
    assert to_json(offsets) == {"a": {"0": 5, "10": 7}, "b": {"1": 0}}
    assert from_json(json.loads(json.dumps(to_json(offsets)))) == offsets


def test_max_rows_shares_the_limit_in_proportion_and_never_exceeds_it():
    start = {("t", 0): 0, ("t", 1): 100, ("t", 2): 5, ("t", 3): 9}
    end = {("t", 0): 300, ("t", 1): 200, ("t", 2): 5, ("t", 3): 10, ("t", 4): 0}  # t-4 is new
    limited = limit_rows(start, end, 100)
    sizes = {tp: limited[tp] - start[tp] for tp in start}
    assert sum(sizes.values()) == 100 and sizes[("t", 0)] == 75 and sizes[("t", 2)] == 0
    assert limited[("t", 4)] == 0
    assert limit_rows(start, end, 10_000) == end
    assert sum(limit_rows(start, end, 1)[tp] - start[tp] for tp in start) == 1


def test_plan_reads_only_non_empty_ranges_of_known_partitions():
    opts = parse_options({**BOOT, "subscribe": "t"}, streaming=True)
    ranges = plan(opts, {("t", 0): 3, ("t", 1): 4}, {("t", 0): 9, ("t", 1): 4, ("t", 2): 0})
    assert [(r.topic, r.partition, r.start, r.end) for r in ranges] == [("t", 0, 3, 9)]


# --- rows -------------------------------------------------------------------------------------


def test_record_batches_have_exactly_the_arrow_schema_spark_checks():
    messages = [Message("t", 2, 7, b"k", None, (("h", b"v"), ("n", None)), 1_700_000_000_123, 1)]
    batch = to_record_batch(messages, include_headers=False)
    assert batch.schema.equals(to_arrow_schema(SCHEMA, timezone="UTC"))
    assert batch.schema.field("timestamp").type == pa.timestamp("us", tz="UTC")
    assert batch.to_pylist()[0] | {"timestamp": None} == {
        "key": b"k", "value": None, "topic": "t", "partition": 2, "offset": 7, "timestamp": None, "timestampType": 1}
    assert batch.column("timestamp").cast(pa.int64()).to_pylist() == [1_700_000_000_123_000]
    with_headers = to_record_batch(messages, include_headers=True)
    assert with_headers.schema.equals(to_arrow_schema(SCHEMA_WITH_HEADERS, timezone="UTC"))
    assert with_headers.column("headers").to_pylist() == [[{"key": "h", "value": b"v"}, {"key": "n", "value": None}]]


# --- reading a range from the real broker ------------------------------------------------------


def options_for(broker, topic: str, **more: str):
    return parse_options({"kafka.bootstrap.servers": broker.bootstrap, "subscribe": topic, **more}, streaming=True)


def rows_of(r: KafkaRange) -> list[dict]:
    return [row for batch in read_range(r) for row in batch.to_pylist()]


def test_a_range_ends_at_its_end_and_skips_markers_and_aborted_records(broker, topic):
    broker.create_topic(topic, 1)
    with Producer(broker.bootstrap, transactional_id=f"{topic}-t") as p:
        p.init_transactions()
        for n, commit in enumerate((True, False, True)):  # offsets 0-9 (+marker 10), 11-20 (+21), 22-31 (+32)
            p.begin_transaction()
            for i in range(10):
                p.send(topic, value=f"{n}-{i}".encode(), partition=0)
            p.commit_transaction() if commit else p.abort_transaction()
    opts = options_for(broker, topic)
    whole = rows_of(KafkaRange(topic, 0, 0, 33, opts))
    assert [r["offset"] for r in whole] == [*range(10), *range(22, 32)], "no marker, no aborted record"
    middle = rows_of(KafkaRange(topic, 0, 3, 25, opts))  # ends inside the last batch
    assert [r["offset"] for r in middle] == [*range(3, 10), 22, 23, 24]
    assert rows_of(KafkaRange(topic, 0, 10, 22, opts)) == [], "a range of markers and aborted records is empty"
    uncommitted = options_for(broker, topic, **{"kafka.isolation.level": "read_uncommitted"})
    assert len(rows_of(KafkaRange(topic, 0, 0, 33, uncommitted))) == 30


def test_a_range_retention_deleted_fails_or_skips_with_a_warning(broker, topic, caplog):
    start = with_deleted_head(broker, topic)
    with pytest.raises(DataLoss, match=rf"{topic}-0: offset 0 \(reading \[0, 30\)\) is no longer in the log"):
        rows_of(KafkaRange(topic, 0, 0, 30, options_for(broker, topic)))
    skipping = options_for(broker, topic, failOnDataLoss="false")
    with caplog.at_level(logging.WARNING, "twophase.spark.source"):
        assert [r["offset"] for r in rows_of(KafkaRange(topic, 0, 0, 30, skipping))] == list(range(start, 30))
    assert f"{topic}-0: offsets 0 to {start} skipped" in caplog.text


# --- the driver's plans against the real broker ------------------------------------------------


def test_new_partitions_enter_at_earliest_and_available_now_stops_at_its_target(broker, topic):
    broker.create_topic(topic, 2)
    with Producer(broker.bootstrap) as p:
        for i in range(10):
            p.send(topic, value=b"v", partition=i % 2)
    opts = parse_options({"kafka.bootstrap.servers": broker.bootstrap, "subscribePattern": f"{topic}.*",
                          "startingOffsets": "latest"}, streaming=True)
    with OffsetPlanner(opts) as planner:
        start = planner.resolve(opts.starting, "startingOffsets", planner.current_partitions())
        assert start == {(topic, 0): 5, (topic, 1): 5}
        broker.create_topic(topic + "-new", 1)
        with Producer(broker.bootstrap) as p:
            for i in range(4):
                p.send(topic + "-new", value=b"v", partition=0)
                p.send(topic, value=b"v", partition=0)
        target = planner.latest(planner.current_partitions())
        end = planner.latest_offsets(start)
        assert end == {(topic, 0): 9, (topic, 1): 5, (topic + "-new", 0): 0}, "the new topic enters at earliest"
        with Producer(broker.bootstrap) as p:
            p.send(topic + "-new", value=b"late", partition=0)
        assert planner.latest_offsets(end, target=target)[(topic + "-new", 0)] == 4
        assert planner.latest_offsets(end)[(topic + "-new", 0)] == 5
        with pytest.raises(SourceOptionError, match=r"'startingOffsets' must give an offset for every partition"):
            planner.resolve({topic: {0: 1}}, "startingOffsets", planner.current_partitions())


def test_a_topic_recreated_or_deleted_is_data_loss_or_skipped(broker, topic, caplog):
    broker.create_topic(topic, 2)
    with Producer(broker.bootstrap) as p:
        for i in range(20):
            p.send(topic, value=b"v", partition=i % 2)
    start = {(topic, 0): 10, (topic, 1): 10}
    with Admin(broker.bootstrap) as admin:
        admin.delete_topics([topic])
        admin.create_topics({topic: 1})
    with Producer(broker.bootstrap) as p:
        p.send(topic, value=b"again", partition=0)
    with OffsetPlanner(options_for(broker, topic)) as planner:
        with pytest.raises(DataLoss, match=rf"{topic}-1 is gone"):
            planner.latest_offsets(start)
    with OffsetPlanner(options_for(broker, topic, failOnDataLoss="false")) as planner:
        with caplog.at_level(logging.WARNING, "twophase.spark.source"):
            end = planner.latest_offsets(start)
        assert end == {(topic, 0): 0}, "restarts at the recreated topic's earliest offset; the gone partition leaves"
        assert "offsets went backwards from 10 to 1" in caplog.text and f"{topic}-1 is gone" in caplog.text
        assert planner.latest_offsets(end) == {(topic, 0): 1}


def test_the_driver_side_client_outlives_a_broker_restart(broker_factory, topic, tmp_path):
    first = broker_factory(data_dir=tmp_path / "data")
    first.create_topic(topic, 2)
    with Producer(first.bootstrap) as p:
        p.send(topic, value=b"v", partition=0)
    with OffsetPlanner(options_for(first, topic)) as planner:
        start = planner.latest_offsets({})
        assert start == {(topic, 0): 0, (topic, 1): 0}
        port = first.port
        first.stop()
        again = broker_factory(data_dir=tmp_path / "data", port=port)
        assert planner.latest_offsets(start) == {(topic, 0): 1, (topic, 1): 0}
        assert again.port == port


def test_the_stream_reader_glue_without_spark(broker, topic):
    """What Spark's driver process and executors call, in Spark's order, on the real broker; the reader
    pickles without its client, and stop() closes it (the autouse leak check fails the test otherwise)."""
    broker.create_topic(topic, 2)
    with Producer(broker.bootstrap) as p:
        for i in range(10):
            p.send(topic, value=f"v{i}".encode(), partition=i % 2)
    source = KafkaSource({"kafka.bootstrap.servers": broker.bootstrap, "subscribe": topic,
                          "startingOffsets": "earliest", "maxOffsetsPerTrigger": "4", "includeHeaders": "true"})
    assert source.schema() == SCHEMA_WITH_HEADERS
    reader = source.streamReader(source.schema())
    try:
        assert reader.reportLatestOffset() is None
        start = reader.initialOffset()
        assert start == {topic: {"0": 0, "1": 0}}
        limit = reader.getDefaultReadLimit()
        assert limit == ReadMaxRows(4)
        end = reader.latestOffset(start, limit)
        assert end == {topic: {"0": 2, "1": 2}}
        assert reader.reportLatestOffset() == {topic: {"0": 5, "1": 5}}, "the backlog, past the limit"
        assert reader.latestOffset(start, ReadAllAvailable()) == {topic: {"0": 5, "1": 5}}
        shipped = pickle.loads(pickle.dumps(reader))  # as Spark ships it to executors
        assert shipped._planner is None
        rows = [row for part in reader.partitions(start, end) for b in shipped.read(part) for row in b.to_pylist()]
        assert sorted((r["partition"], r["offset"]) for r in rows) == [(0, 0), (0, 1), (1, 0), (1, 1)]
        assert reader.partitions(end, end) == []
        reader.prepareForTriggerAvailableNow()
        with Producer(broker.bootstrap) as p:
            p.send(topic, value=b"late", partition=0)
        assert reader.latestOffset(end, ReadAllAvailable()) == {topic: {"0": 5, "1": 5}}
        assert reader.reportLatestOffset() == {topic: {"0": 6, "1": 5}}, "the backlog, past AvailableNow's end"
    finally:
        reader.stop()
    assert reader._planner is None


@pytest.mark.parametrize("codec", ["gzip", "snappy", "lz4", "zstd"])
def test_a_range_written_by_confluent_kafka_in_compressed_transactions(broker, topic, codec):
    """confluent-kafka's transactional producer, compressed batches, one transaction committed and one
    aborted: read_committed rows are exactly the committed records, headers included."""
    from confluent_kafka import Producer as ConfluentProducer

    broker.create_topic(topic, 1)
    theirs = ConfluentProducer({"bootstrap.servers": broker.bootstrap, "compression.type": codec, "linger.ms": 5,
                                "transactional.id": f"{topic}-confluent"})
    try:
        theirs.init_transactions(30)
        for commit in (True, False):
            theirs.begin_transaction()
            for i in range(100):
                theirs.produce(topic, value=b"%d" % i, key=b"k%d" % commit, partition=0, headers=[("i", b"%d" % i)])
            theirs.commit_transaction(30) if commit else theirs.abort_transaction(30)
    finally:
        theirs.flush(10)
        del theirs  # librdkafka's threads and sockets go with the object
    with Admin(broker.bootstrap) as admin:
        end = admin.list_offsets([(topic, 0)], -1, "read_committed")[(topic, 0)]
    opts = options_for(broker, topic, includeHeaders="true")
    rows = rows_of(KafkaRange(topic, 0, 0, end, opts))
    assert [(r["key"], r["value"]) for r in rows] == [(b"k1", b"%d" % i) for i in range(100)]
    assert rows[7]["headers"] == [{"key": "i", "value": b"7"}]
