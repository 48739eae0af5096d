"""The ``twophase-kafka`` sink: Spark's Kafka sink contract, exactly once, over LogSink.

``df.writeStream.format("twophase-kafka")`` takes the rows and options of Spark's Kafka sink (a
``value`` column, optional ``key``, ``topic``, ``partition`` and ``headers`` columns;
``kafka.bootstrap.servers``, ``topic``, ``kafka.``-prefixed producer settings under Kafka's names)
plus the exactly-once options of twophase/spark/sink_options.py, and writes each task attempt's rows
in one Kafka transaction (many topics may share it) that the coordinator commits once Spark has
durably completed the batch. Options and the schema are checked when the query starts, before any
row is written. docs/spark-writer.md lists them.

Example::

    register(spark)
    (df.selectExpr("CAST(id AS STRING) AS key", "to_json(struct(*)) AS value")
       .writeStream.format("twophase-kafka")
       .option("kafka.bootstrap.servers", "127.0.0.1:9092").option("topic", "orders-out")
       .option("kafka.linger.ms", "20")
       .option("twophase.zk", "127.0.0.1:2181").option("twophase.app", "orders")
       .option("checkpointLocation", "/data/ck/orders").start())
"""

from __future__ import annotations

from collections.abc import Mapping

from pyspark.sql.pandas.types import to_arrow_schema
from pyspark.sql.types import StructType

from sinks.log import LogSink
from sinks.log_columns import validate_kafka_schema
from sinks.log_settings import log_sink_args
from twophase.signing import load_secret
from twophase.spark.driver import HookConfig
from twophase.spark.sink_options import EXACTLY_ONCE, SPARK_OWN, WriterOptionError, exactly_once, lowered
from twophase.spark.stream_sink import TwoPhaseStreamWriter

# twophase.* options of this writer besides the exactly-once ones.
KAFKA_TWOPHASE = ("twophase.security", "twophase.commitMode", "twophase.transactionalIdPrefix")
_OWN = {name.lower() for name in ("topic", *SPARK_OWN, *EXACTLY_ONCE, *KAFKA_TWOPHASE)}
_OPTION_OF = {"commit_mode": "twophase.commitMode", "transactional_id_prefix": "twophase.transactionalIdPrefix"}
BATCH_WRITE_REFUSED = ("twophase-kafka writes streaming queries, each micro-batch exactly once "
                       "(df.writeStream.format('twophase-kafka')): a batch DataFrame has no micro-batch to commit on. "
                       "Write it as a stream (spark.readStream ... .trigger(availableNow=True)), from foreachBatch "
                       "with twophase.spark.TwoPhaseBatchSink, or with Spark's own kafka format, at least once")


def kafka_log_sink(options: Mapping[str, str]) -> LogSink:
    """The LogSink the options call for; WriterOptionError naming an unknown or malformed option."""
    given = lowered(options)
    unknown = sorted(k for k in given if k not in _OWN and not k.startswith("kafka."))
    if unknown:
        raise WriterOptionError(f"unknown option(s) {unknown} for the twophase-kafka sink (docs/spark-writer.md)")
    try:
        args = log_sink_args({k.removeprefix("kafka."): v for k, v in given.items() if k.startswith("kafka.")})
    except ValueError as e:
        raise WriterOptionError(str(e)) from None
    if not args.get("bootstrap"):
        raise WriterOptionError("option 'kafka.bootstrap.servers' is required")
    source = given.get("twophase.security")
    if source is not None:
        if args.get("security"):
            raise WriterOptionError("give the security settings either as kafka.* options or as the "
                                    "twophase.security source, not both")
        args["security"] = source
    if "twophase.commitmode" in given:
        args["commit_mode"] = given["twophase.commitmode"]
    if "twophase.transactionalidprefix" in given:
        args["transactional_id_prefix"] = given["twophase.transactionalidprefix"]
    topic = given.get("topic")
    try:
        return LogSink(topic=None if topic is None else topic.strip(), columns="kafka", **args)  # trimmed, as Spark
    except ValueError as e:
        message = str(e)
        for argument, option in _OPTION_OF.items():  # LogSink's argument named first, as the query's option
            if message.startswith(f"{argument} "):
                message = f"option {option}{message[len(argument):]}"
        raise WriterOptionError(message) from None


def kafka_hook(options: Mapping[str, str]) -> tuple[HookConfig, LogSink]:
    """The driver hook config and sink of a ``twophase-kafka`` query (WriterDiscovery's factory)."""
    where = exactly_once(options, also=KAFKA_TWOPHASE)
    return HookConfig(where.zk, where.root, where.app, load_secret(), where.coordinator), kafka_log_sink(options)


def kafka_stream_writer(options: Mapping[str, str], schema: StructType) -> TwoPhaseStreamWriter:
    """The stream writer of a ``twophase-kafka`` query, its options and the query's columns checked (with
    Spark's Kafka sink messages) before any row is written."""
    where = exactly_once(options, also=KAFKA_TWOPHASE)
    sink = kafka_log_sink(options)
    validate_kafka_schema(to_arrow_schema(schema, timezone="UTC"), sink.topic)
    return TwoPhaseStreamWriter(sink, where, load_secret())
