"""``format("twophase-kafka")`` in real local Spark: Spark's Kafka sink contract, exactly once.

Against a real ZooKeeper and the built-in broker (in this test process); an independent
read_committed confluent-kafka consumer (examples.log_sink_query.read_topic) counts every record.
The chaos cases run examples/kafka_sink_query.py as a driver process of its own and SIGKILL it.
"""

from __future__ import annotations

import json

import pytest
from pyspark.errors import StreamingQueryException

from examples.file_sink_query import INPUT_SCHEMA, write_input
from examples.log_sink_query import read_topic
from tests.broker.conftest import broker_factory  # noqa: F401  (fixture)
from tests.test_log_sink_spark import (  # noqa: F401  (jobs: a fixture)
    BROKERS,
    TOPIC,
    LogJob,
    jobs,
    kill_after_spark_completed_epoch_0,
    kill_mid_batch,
    run_to_end,
)
from twophase.spark import await_committed, register
from twophase.verify import count_rows

pytestmark = pytest.mark.spark

MODULE = "examples.kafka_sink_query"


def stream(spark, tmp_path, batches: int, rows: int):
    """JSON files in, one per micro-batch, over 4 tasks."""
    for b in range(batches):
        write_input(str(tmp_path / "in"), b, range(b * rows, (b + 1) * rows))
    return (spark.readStream.schema(INPUT_SCHEMA).option("maxFilesPerTrigger", 1).json(str(tmp_path / "in"))
            .repartition(4))


def kafka_writer(df, bootstrap: str, zk_hosts: str, root: str, tmp_path, **options):
    writer = (df.writeStream.format("twophase-kafka").option("kafka.bootstrap.servers", bootstrap)
              .option("twophase.zk", zk_hosts).option("twophase.app", "kafka").option("twophase.root", root)
              .option("checkpointLocation", str(tmp_path / "ck")).trigger(availableNow=True))
    for name, value in options.items():
        writer = writer.option(name, value)
    return writer


def test_per_row_topics_keys_and_headers_exactly_once(spark, zk_server, zk_root, tmp_path, broker_factory):
    """Rows choose their topic (the ``topic`` column; without the ``topic`` option, which would override
    it as in Spark); keys and headers arrive as written; every record once, one transaction per task
    across both topics."""
    register(spark)
    broker = broker_factory()
    for topic in ("even", "odd"):
        broker.create_topic(topic, 2)
    df = stream(spark, tmp_path, batches=3, rows=50).selectExpr(
        "CAST(id AS STRING) AS key", "to_json(struct(*)) AS value",
        "CASE WHEN id % 2 = 1 THEN 'odd' ELSE 'even' END AS topic",
        "array(named_struct('key', 'batch', 'value', CAST(CAST(batch AS STRING) AS BINARY))) AS headers")
    query = kafka_writer(df, broker.bootstrap, zk_server.hosts, zk_root, tmp_path).start()
    query.awaitTermination()
    assert await_committed(query, timeout=60) == 2
    for topic, parity in (("even", 0), ("odd", 1)):
        records = read_topic(broker.bootstrap, topic)
        values = [json.loads(m.value()) for m in records]
        assert count_rows(range(parity, 150, 2), [v["id"] for v in values]).exact, topic
        assert all(m.key().decode() == str(v["id"]) for m, v in zip(records, values))
        assert all(m.headers() == [("batch", str(v["batch"]).encode())] for m, v in zip(records, values))


@pytest.mark.parametrize("options, message", [
    ({"twophase.zk": None}, "'twophase.zk' is required"),
    ({"kafka.key.serializer": "org.apache.kafka.common.serialization.StringSerializer"}, "kafka.key.serializer"),
    ({"kafka.colour": "blue"}, "kafka.colour"),
    ({"kafka.bootstrap.servers": None}, "'kafka.bootstrap.servers' is required"),
    ({"kafka.linger.ms": "soon"}, "kafka.linger.ms='soon' is not a whole number"),
    ({"kafka.sasl.password": "hunter2"}, "twophase.security"),
    ({"topic": None}, "topic"),
    ({"kafka.retries": "0"}, "kafka.retries=0"),
])
def test_bad_options_stop_the_query_before_any_row_is_written(spark, zk_server, zk_root, tmp_path, broker_factory,
                                                             options, message):
    register(spark)
    broker = broker_factory()
    broker.create_topic("out", 1)
    given = {"kafka.bootstrap.servers": broker.bootstrap, "topic": "out", "twophase.zk": zk_server.hosts,
             "twophase.app": "kafka", "twophase.root": zk_root, "checkpointLocation": str(tmp_path / "ck")}
    given = {name: value for name, value in {**given, **options}.items() if value is not None}  # None: left out
    df = stream(spark, tmp_path, batches=1, rows=5).selectExpr("to_json(struct(*)) AS value")
    query = df.writeStream.format("twophase-kafka").options(**given).trigger(availableNow=True).start()
    with pytest.raises(StreamingQueryException, match=message):
        query.awaitTermination()
    assert read_topic(broker.bootstrap, "out", isolation="read_uncommitted") == []


def test_a_schema_without_value_is_refused_like_sparks_kafka_sink(spark, zk_server, zk_root, tmp_path,
                                                                 broker_factory):
    register(spark)
    broker = broker_factory()
    broker.create_topic("out", 1)
    df = stream(spark, tmp_path, batches=1, rows=5).selectExpr("CAST(id AS STRING) AS key")
    query = kafka_writer(df, broker.bootstrap, zk_server.hosts, zk_root, tmp_path, topic="out").start()
    with pytest.raises(StreamingQueryException, match="value"):
        query.awaitTermination()


def test_a_continuous_trigger_is_stopped_before_any_epoch_is_recorded(spark, zk_server, zk_root, tmp_path,
                                                                     broker_factory, caplog):
    """Under trigger(continuous=...) Spark's Python writer never sees a row and commits every epoch with no
    message. The writer's commit refuses that, so Spark records no epoch done (it logs the error and goes on),
    and the driver hook stops the query, saying why."""
    register(spark)
    broker = broker_factory()
    broker.create_topic("out", 1)
    df = (spark.readStream.format("rate").option("rowsPerSecond", "200").option("numPartitions", "2").load()
          .selectExpr("CAST(value AS STRING) AS value"))
    query = kafka_writer(df, broker.bootstrap, zk_server.hosts, zk_root, tmp_path, topic="out").trigger(
        continuous="1 second").start()
    try:
        assert query.awaitTermination(120), "the continuous query was not stopped"
    finally:
        query.stop()
    assert f"query {query.id} run {query.runId}: twophase needs micro-batch epochs" in caplog.text
    assert not list((tmp_path / "ck" / "commits").glob("[0-9]*"))  # the refused commits recorded no epoch done
    assert read_topic(broker.bootstrap, "out", isolation="read_uncommitted") == []


def test_a_secret_set_in_the_driver_after_the_session_started_fails_the_query_before_a_row_is_written(
        spark, zk_server, zk_root, tmp_path, broker_factory, monkeypatch):
    """A notebook sets TWOPHASE_SECRET once the session runs: the driver hook signs with it, while the writer,
    built in a Python worker started with the JVM's environment, has the old one. Its tasks refuse to write
    instead of pre-committing what the coordinator could never verify."""
    monkeypatch.setenv("TWOPHASE_SECRET", "set-in-the-driver-after-the-session-started")
    register(spark)
    broker = broker_factory()
    broker.create_topic("out", 1)
    df = stream(spark, tmp_path, batches=1, rows=5).selectExpr("to_json(struct(*)) AS value")
    query = kafka_writer(df, broker.bootstrap, zk_server.hosts, zk_root, tmp_path, topic="out",
                         **{"twophase.app": "secret-mismatch"}).start()
    with pytest.raises(StreamingQueryException, match="set TWOPHASE_SECRET .* before the SparkSession starts"):
        query.awaitTermination()
    assert read_topic(broker.bootstrap, "out", isolation="read_uncommitted") == []


def test_a_batch_write_is_refused_naming_the_streaming_way(spark, zk_server, zk_root, tmp_path, broker_factory):
    broker = broker_factory()
    broker.create_topic("out", 1)
    register(spark)
    df = spark.range(3).selectExpr("CAST(id AS STRING) AS value")
    with pytest.raises(Exception, match="twophase-kafka writes streaming queries"):
        (df.write.format("twophase-kafka").mode("append").option("kafka.bootstrap.servers", broker.bootstrap)
         .option("topic", "out").option("twophase.zk", zk_server.hosts).option("twophase.app", "kafka")
         .option("twophase.root", zk_root).save())
    assert read_topic(broker.bootstrap, "out", isolation="read_uncommitted") == []


def test_the_topic_option_is_trimmed_as_sparks_is(spark, zk_server, zk_root, tmp_path, broker_factory):
    register(spark)
    broker = broker_factory()
    broker.create_topic("out", 1)
    df = stream(spark, tmp_path, batches=1, rows=5).selectExpr("CAST(id AS STRING) AS value")
    query = kafka_writer(df, broker.bootstrap, zk_server.hosts, zk_root, tmp_path, topic=" out ").start()
    query.awaitTermination()
    await_committed(query, timeout=60)
    assert count_rows(range(5), [int(m.value()) for m in read_topic(broker.bootstrap, "out")]).exact


# -- chaos: the driver SIGKILLed (examples/kafka_sink_query.py as its own process) ----------------------


@pytest.fixture(params=list(BROKERS))
def job(request, jobs):  # noqa: F811 - the fixture imported above
    made = jobs(request.param, **BROKERS[request.param])
    # The Kafka example takes the log example's flags; the shared helpers start the log example by name.
    made.command = lambda module, flags: LogJob.command(made, MODULE, flags)
    return made


def ids(records) -> list[int]:
    return [json.loads(m.value())["id"] for m in records]


@pytest.mark.chaos
def test_driver_killed_mid_batch_with_failing_tasks_exactly_once(zk, job):
    job.write_input()
    run = job.start("--slow-ms", "50", "--fail-rate", "0.3", module=MODULE)
    kill_mid_batch(zk, job, run)
    run_to_end(zk, job, "--fail-rate", "0.3")
    committed = read_topic(job.bootstrap, TOPIC)
    report = count_rows(job.expected, ids(committed))
    assert report.exact, f"{report}\n{job.logs()}"


@pytest.mark.chaos
def test_driver_killed_between_pre_commit_and_commit_commits_after_restart(zk, job):
    """commits/0 is written, nobody committed epoch 0 (daemon mode, no daemon) when the driver dies: its
    transactions stay invisible until the restarted driver's coordinator commits them, once."""
    kill_after_spark_completed_epoch_0(zk, job)
    run_to_end(zk, job)
    report = count_rows(job.expected, ids(read_topic(job.bootstrap, TOPIC)))
    assert report.exact, f"{report}\n{job.logs()}"
