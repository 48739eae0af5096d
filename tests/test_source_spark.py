"""The twophase-kafka source against the real built-in broker and real local Spark.

Each test runs as few Spark queries as it can (a query costs seconds here) and checks several
things per query: rows exactly once by key, the schema and values of Spark's Kafka source,
read_committed against read_uncommitted, maxOffsetsPerTrigger per micro-batch, Trigger.AvailableNow's
end, restart from a checkpoint, new topics under subscribePattern, failOnDataLoss both ways, and bad
options failing at the start naming the option.
"""

from __future__ import annotations

import collections
import json
import time

import pytest

from tests.broker.conftest import broker, broker_factory, topic  # noqa: F401  (fixtures)
from tests.waiting import wait_until
from twophase.client import Consumer, Producer
from twophase.spark import register
from twophase.spark.source import SCHEMA, SCHEMA_WITH_HEADERS, KafkaSource

pytestmark = pytest.mark.spark

PARTITIONS = 12


@pytest.fixture
def source(spark):
    """The session with the source registered (twice: registering is idempotent)."""
    register(spark)
    register(spark)
    return spark


def produce(bootstrap: str, topic: str, keys, partitions: int | None = PARTITIONS, **send) -> dict[bytes, int]:
    """Send one record per key (partition = key number % partitions); returns {key: timestamp_ms}."""
    stamps = {}
    with Producer(bootstrap, linger_ms=20) as p:
        for i in keys:
            key = f"k{i}".encode()
            stamps[key] = 1_700_000_000_000 + i
            p.send(topic, value=f"v{i}".encode(), key=key, partition=None if partitions is None else i % partitions,
                   timestamp_ms=stamps[key], **send)
        p.flush()
    return stamps


def reader(spark, bootstrap: str, stream: bool = False, **options):
    r = (spark.readStream if stream else spark.read).format("twophase-kafka")
    r = r.option("kafka.bootstrap.servers", bootstrap)
    for k, v in options.items():
        r = r.option(k, str(v).lower() if isinstance(v, bool) else str(v))
    return r.load()


def keys_of(rows) -> collections.Counter:
    return collections.Counter(bytes(r["key"]) for r in rows)


def run_available_now(df, checkpoint, during=None):
    """Run ``df`` with Trigger.AvailableNow to its end into a parquet directory next to ``checkpoint``
    (a sink that, unlike the memory sink, restarts from a checkpoint); ``during(query)`` runs while it is
    active. Returns the stopped query and every row the directory holds (of every run so far)."""
    out = f"{checkpoint}-out"
    query = (df.writeStream.format("parquet").option("path", out).option("checkpointLocation", str(checkpoint))
             .trigger(availableNow=True).start())
    try:
        if during is not None:
            during(query)
        query.awaitTermination(180)
        assert not query.isActive, "the AvailableNow query did not end"
        if query.exception() is not None:
            raise AssertionError(str(query.exception()))
    finally:
        query.stop()
    return query, df.sparkSession.read.parquet(out).collect()


def last_offsets(checkpoint) -> dict:
    """The source's end offsets of the last batch in the checkpoint's offset log."""
    newest = max((f for f in (checkpoint / "offsets").iterdir() if f.name.isdigit()), key=lambda f: int(f.name))
    return json.loads(newest.read_text().splitlines()[-1])


def test_batch_read_of_a_12_partition_topic_has_spark_kafka_rows_and_headers(source, broker, topic):
    broker.create_topic(topic, PARTITIONS)
    stamps = produce(broker.bootstrap, topic, range(600), headers=[("h", b"x"), ("n", None)])
    df = reader(source, broker.bootstrap, subscribe=topic, includeHeaders=True)
    assert df.schema == SCHEMA_WITH_HEADERS
    rows = df.collect()
    assert keys_of(rows) == collections.Counter(stamps.keys()), "every record exactly once"
    for r in rows:
        i = int(r["key"][1:])
        assert (r["value"], r["topic"], r["partition"], r["timestampType"]) == (f"v{i}".encode(), topic,
                                                                                 i % PARTITIONS, 0)
        # Spark turns the UTC microseconds into a naive local datetime: compare as epoch milliseconds.
        assert round(r["timestamp"].timestamp() * 1000) == stamps[r["key"]]
        assert [(h["key"], h["value"]) for h in r["headers"]] == [("h", b"x"), ("n", None)]
    by_partition = collections.defaultdict(list)
    for r in rows:
        by_partition[r["partition"]].append(r["offset"])
    assert all(sorted(o) == list(range(len(o))) for o in by_partition.values())
    # endingOffsets as JSON, and one partition only through assign
    ends = json.dumps({topic: {str(p): 10 for p in range(PARTITIONS)}})
    assert reader(source, broker.bootstrap, subscribe=topic, endingOffsets=ends).count() == 10 * PARTITIONS
    part = reader(source, broker.bootstrap, assign=json.dumps({topic: [3]})).collect()
    assert {r["partition"] for r in part} == {3} and len(part) == 50
    assert reader(source, broker.bootstrap, subscribe=topic).schema == SCHEMA


def test_stream_read_limits_available_now_end_restart_and_new_topics(source, broker, topic, tmp_path):
    """One checkpoint, three runs: maxOffsetsPerTrigger caps every micro-batch; records written while an
    AvailableNow run is going are not read by it; the next run from the checkpoint reads exactly them,
    and a topic created meanwhile that matches subscribePattern, from its earliest offset."""
    broker.create_topic(topic, PARTITIONS)
    first = produce(broker.bootstrap, topic, range(1200))
    df = reader(source, broker.bootstrap, stream=True, subscribePattern=f"{topic}.*", startingOffsets="earliest",
                maxOffsetsPerTrigger=150)
    checkpoint = tmp_path / "checkpoint"
    late = {}

    def write_more_once_running(query):
        wait_until(lambda: query.lastProgress is not None, 120, what="a first micro-batch")
        late.update(produce(broker.bootstrap, topic, range(1200, 1300)))
        assert query.isActive, "the query ended before the late records were written: the test proves nothing"

    query, rows = run_available_now(df, checkpoint, write_more_once_running)
    assert keys_of(rows) == collections.Counter(first.keys()), "exactly the records there were when the run started"
    sizes = [p["numInputRows"] for p in query.recentProgress]
    assert sum(sizes) == 1200 and max(sizes) <= 150 and len([s for s in sizes if s]) >= 8, sizes
    first_batch = query.recentProgress[0]["sources"][0]
    backlog = json.loads(first_batch["latestOffset"])[topic]  # reportLatestOffset: past the limit, for lag
    assert sum(backlog.values()) == 1200 and sum(json.loads(first_batch["endOffset"])[topic].values()) == 150

    other = topic + "-b"
    broker.create_topic(other, 2)
    newer = produce(broker.bootstrap, other, range(5000, 5040), partitions=2)
    _, rows = run_available_now(df, checkpoint)
    assert keys_of(rows) == collections.Counter([*first, *late, *newer]), "the restart continues, nothing lost or doubled"
    last = last_offsets(checkpoint)
    assert last[topic] == {str(p): 1300 // PARTITIONS + (p < 1300 % PARTITIONS) for p in range(PARTITIONS)}
    assert last[other] == {"0": 20, "1": 20}


def test_two_queries_started_together_on_one_source_write_into_a_thread_safe_environment(source, broker, topic,
                                                                                       tmp_path):
    """Spark's streaming source runner writes its settings into the registered source's environment map on
    each query's thread, while the other queries serialize it into their tasks (see
    streams._register_with_shared_environment). The race itself is rare, so this checks the map's type
    (a HashMap before the fix) and that two queries started together on one DataFrame read every record
    once; a source registered by ``spark.dataSource.register`` is registered again by ``register``."""
    manager = source._jsparkSession.sessionState().dataSourceManager()

    def environment():
        return manager.lookupDataSource("twophase-kafka").dataSourceCls().envVars()

    source.dataSource.register(KafkaSource)  # PySpark's registration: a HashMap
    assert environment().getClass().getName() == "java.util.HashMap"
    register(source)
    assert environment().getClass().getName() == "java.util.concurrent.ConcurrentHashMap"
    broker.create_topic(topic, 3)
    keys = produce(broker.bootstrap, topic, range(300), partitions=3)
    df = reader(source, broker.bootstrap, stream=True, subscribe=topic, startingOffsets="earliest")
    queries = []
    try:
        for n in range(2):
            queries.append(df.writeStream.format("parquet").option("path", str(tmp_path / f"out{n}"))
                           .option("checkpointLocation", str(tmp_path / f"ck{n}")).trigger(availableNow=True).start())
        for query in queries:
            query.awaitTermination(180)
            assert not query.isActive and query.exception() is None, query.exception()
    finally:
        for query in queries:
            query.stop()
    for n in range(2):
        assert keys_of(source.read.parquet(str(tmp_path / f"out{n}")).collect()) == collections.Counter(keys.keys())
    assert environment().containsKey("SPARK_LOCAL_DIRS"), "the runner wrote into another map: the test proves nothing"


def transactions(bootstrap: str, topic: str) -> tuple[set[bytes], set[bytes], set[bytes]]:
    """Committed and aborted transactions on ``topic``, then one left open and plain records after it.
    Returns the keys (visible under read_committed, aborted, hidden behind the open transaction)."""
    committed, aborted, hidden = set(), set(), set()
    with Producer(bootstrap, transactional_id=f"{topic}-a") as a, \
            Producer(bootstrap, transactional_id=f"{topic}-b") as b:
        a.init_transactions()
        b.init_transactions()
        for txn, (producer, kind) in enumerate([(a, committed), (a, aborted), (a, committed), (a, aborted)]):
            producer.begin_transaction()
            for i in range(25):
                key = f"t{txn}-{i}".encode()
                producer.send(topic, value=key, key=key, partition=i % 3)
                kind.add(key)
            if kind is committed:
                producer.commit_transaction()
            else:
                producer.abort_transaction()
        b.begin_transaction()  # left open: the last stable offset stays at its first record
        for i in range(3):
            b.send(topic, value=b"open", key=f"open-{i}".encode(), partition=i)
            hidden.add(f"open-{i}".encode())
        b.flush()
        with Producer(bootstrap) as plain:
            for i in range(3):
                plain.send(topic, value=b"plain", key=f"plain-{i}".encode(), partition=i)
                hidden.add(f"plain-{i}".encode())
    return committed, aborted, hidden


def test_read_committed_never_shows_aborted_or_open_records(source, broker, topic, tmp_path):
    broker.create_topic(topic, 3)
    committed, aborted, hidden = transactions(broker.bootstrap, topic)
    rows = reader(source, broker.bootstrap, subscribe=topic).collect()
    assert set(keys_of(rows)) == committed and max(keys_of(rows).values()) == 1
    uncommitted = reader(source, broker.bootstrap, subscribe=topic, **{"kafka.isolation.level": "read_uncommitted"})
    assert set(keys_of(uncommitted.collect())) == committed | aborted | hidden
    stream = reader(source, broker.bootstrap, stream=True, subscribe=topic, startingOffsets="earliest")
    _, rows = run_available_now(stream, tmp_path / "cp")
    streamed = keys_of(rows)
    assert set(streamed) == committed and max(streamed.values()) == 1
    with Consumer(broker.bootstrap, isolation_level="read_committed") as c:  # the batch ended at the LSO
        c.assign([(topic, p) for p in range(3)])
        ends = last_offsets(tmp_path / "cp")[topic]
        for p in range(3):
            c.seek(topic, p, -1)
            assert ends[str(p)] == c.position(topic, p)


def delete_old_records(broker, topic: str) -> None:
    """Writes 200 records to partition 0 of ``topic`` in batches of 20; retention (tiny segments and
    retention.bytes, set on creation) deletes every closed segment as the log rolls."""
    with Producer(broker.bootstrap) as p:
        for i in range(200):
            p.send(topic, value=bytes(100), key=f"k{i}".encode(), partition=0)
            if i % 20 == 19:
                p.flush()  # one batch each
    broker.call(broker.logs.enforce_retention, int(time.time() * 1000))


def test_fail_on_data_loss_both_ways_after_retention(source, broker, topic, tmp_path):
    broker.create_topic(topic, 1, {"segment.bytes": "1024", "retention.bytes": "1"})
    delete_old_records(broker, topic)
    from_zero = json.dumps({topic: {"0": 0}})
    earliest = broker.partition_log(topic, 0).log_start_offset
    assert 0 < earliest < 200
    with pytest.raises(Exception, match=rf"{topic}-0: offsets 0 to {earliest} were deleted"):
        reader(source, broker.bootstrap, subscribe=topic, startingOffsets=from_zero).collect()
    rows = reader(source, broker.bootstrap, subscribe=topic, startingOffsets=from_zero, failOnDataLoss=False).collect()
    assert sorted(r["offset"] for r in rows) == list(range(earliest, 200))
    stream = reader(source, broker.bootstrap, stream=True, subscribe=topic, startingOffsets=from_zero)
    with pytest.raises(Exception, match=rf"{topic}-0: offsets 0 to {earliest} were deleted"):
        run_available_now(stream, tmp_path / "cp1")
    stream = reader(source, broker.bootstrap, stream=True, subscribe=topic, startingOffsets=from_zero,
                    failOnDataLoss=False)
    _, rows = run_available_now(stream, tmp_path / "cp2")
    offsets = sorted(r["offset"] for r in rows)
    assert offsets == list(range(earliest, 200))


@pytest.mark.parametrize("options, named", [
    ({"subscribe": "t", "kafka.sasl.mechanism": "PLAIN"}, "kafka.sasl.mechanism"),
    ({"subscribe": "t", "assign": '{"t":[0]}'}, "subscribe', 'subscribePattern', 'assign"),
    ({"assign": "{t:[0]}"}, "assign"),
    ({"subscribe": "t", "startingOffsets": "soon"}, "startingOffsets"),
])
def test_bad_options_fail_at_the_start_naming_the_option(source, broker, options, named):
    with pytest.raises(Exception, match=named):
        reader(source, broker.bootstrap, stream=True, **options).writeStream.format("noop").start().stop()


def batches_of(query) -> dict[int, tuple]:
    """{batch id: (start offsets, end offsets, rows)} from the query's progress reports."""
    def parsed(offsets):
        return json.loads(offsets) if isinstance(offsets, str) else offsets
    return {p["batchId"]: (parsed(p["sources"][0]["startOffset"]), parsed(p["sources"][0]["endOffset"]),
                           p["numInputRows"]) for p in query.recentProgress if p["numInputRows"]}


def test_a_batch_the_driver_did_not_finish_is_replayed_over_the_same_offsets(source, broker, topic, tmp_path):
    """A driver killed after Spark logged offsets/N and before commits/N (played by removing commits/N):
    the restarted query runs batch N again over exactly the offsets of the checkpoint, although the
    backlog changed meanwhile (a new plan under maxOffsetsPerTrigger would share the limit differently)."""
    broker.create_topic(topic, 3)
    produce(broker.bootstrap, topic, range(300), partitions=3)
    checkpoint = tmp_path / "cp"

    def run():
        df = reader(source, broker.bootstrap, stream=True, subscribe=topic, startingOffsets="earliest",
                    maxOffsetsPerTrigger=100)
        query = (df.writeStream.format("noop").option("checkpointLocation", str(checkpoint))
                 .trigger(availableNow=True).start())
        try:
            query.awaitTermination(180)
            assert not query.isActive and query.exception() is None, query.exception()
        finally:
            query.stop()
        return batches_of(query)

    first = run()
    last = max(first)
    assert sum(rows for _, _, rows in first.values()) == 300 and last >= 2, first
    for name in (str(last), f".{last}.crc"):  # Hadoop's checksum file too, or Spark cannot write it again
        (checkpoint / "commits" / name).unlink()
    produce(broker.bootstrap, topic, range(1000, 1090), partitions=1)  # all to partition 0
    second = run()
    assert second[last] == first[last], "the unfinished batch was re-planned instead of replayed"
    assert sum(rows for b, (_, _, rows) in second.items() if b != last) == 90


CODECS = ("gzip", "snappy", "lz4", "zstd")


def test_every_codec_written_by_confluent_kafka_in_transactions(source, broker, topic):
    """One partition per codec, each written by a confluent-kafka transactional producer with a
    committed and an aborted transaction: one Spark read sees every committed record once, no aborted one."""
    from confluent_kafka import Producer as ConfluentProducer

    broker.create_topic(topic, len(CODECS))
    for partition, codec in enumerate(CODECS):
        theirs = ConfluentProducer({"bootstrap.servers": broker.bootstrap, "compression.type": codec,
                                    "linger.ms": 5, "transactional.id": f"{topic}-{codec}"})
        try:
            theirs.init_transactions(30)
            for commit in (True, False):
                theirs.begin_transaction()
                for i in range(200):
                    theirs.produce(topic, value=b"x" * 50, key=f"{codec}-{commit}-{i}".encode(), partition=partition)
                theirs.commit_transaction(30) if commit else theirs.abort_transaction(30)
        finally:
            theirs.flush(10)
            del theirs  # librdkafka's threads and sockets go with the object
    rows = reader(source, broker.bootstrap, subscribe=topic).collect()
    expected = collections.Counter(f"{codec}-True-{i}".encode() for codec in CODECS for i in range(200))
    assert keys_of(rows) == expected
