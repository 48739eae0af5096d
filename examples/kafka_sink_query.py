"""A streaming query through ``format("twophase-kafka")``: Spark's Kafka sink contract, exactly once.

Run it against a ZooKeeper and a broker of your own (the built-in one:
``twophase broker --data-dir /tmp/broker --port 9092``)::

    python -m examples.kafka_sink_query --zk 127.0.0.1:2181 --bootstrap 127.0.0.1:9092 \\
        --topic out --input /tmp/in --checkpoint /tmp/ck

The query is written as for Spark's own Kafka sink: a ``key`` and a ``value`` column (the row's id,
the row as JSON), the options ``kafka.bootstrap.servers`` and ``topic``, plus twophase's
``twophase.zk`` and ``twophase.app``. Rows reach the sink an Arrow batch at a time. It processes every
file in --input (one file per micro-batch) and exits once all of them are committed. --fail-rate
makes the first attempt of some partitions fail mid-batch, as a flaky executor would; Spark retries
them and the failed attempts' transactions are aborted. ``examples.log_sink_query.read_topic`` is an
independent reader of what the query made visible.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterator

from examples.file_sink_query import INPUT_SCHEMA, build_spark, fails_first_attempt, query_parser


def faults(fail_rate: float, slow_ms: int):
    """A mapInArrow function: slow (``slow_ms`` per row) and, in a chosen first attempt, failing mid-batch."""

    def run(batches: Iterator) -> Iterator:
        from twophase.spark.stream_sink import task_context

        fail = fails_first_attempt(task_context("faults"), fail_rate)
        for batch in batches:
            time.sleep(slow_ms / 1000 * batch.num_rows)
            if fail:
                raise RuntimeError("injected failure: first attempt of this partition dies mid-batch")
            yield batch

    return run


def start_query(spark, args: argparse.Namespace):
    """Every input file is one micro-batch; rows are spread over ``args.partitions`` tasks."""
    df = (spark.readStream.schema(INPUT_SCHEMA).option("maxFilesPerTrigger", 1).json(args.input)
          .repartition(args.partitions))
    if args.fail_rate or args.slow_ms:
        df = df.mapInArrow(faults(args.fail_rate, args.slow_ms), df.schema)
    return (df.selectExpr("CAST(id AS STRING) AS key", "to_json(struct(*)) AS value")
            .writeStream.format("twophase-kafka")
            .option("kafka.bootstrap.servers", args.bootstrap).option("topic", args.topic)
            .option("twophase.zk", args.zk).option("twophase.app", args.app).option("twophase.root", args.root)
            .option("twophase.coordinator", args.coordinator)
            .option("checkpointLocation", args.checkpoint)
            .trigger(availableNow=True)
            .start())


def main(argv: list[str] | None = None) -> int:
    """Run the example query into ``--topic`` until it stops and is committed; return its exit code."""
    from twophase.spark import await_committed, register

    parser = query_parser(__doc__.splitlines()[0], app="kafka-sink-example")
    parser.add_argument("--bootstrap", required=True)
    parser.add_argument("--topic", required=True)
    args = parser.parse_args(argv)
    spark = build_spark()
    register(spark)
    query = start_query(spark, args)
    query.awaitTermination()
    if args.coordinator == "embedded":
        await_committed(query, timeout=120)
    spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
