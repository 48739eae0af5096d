"""A streaming query writing Parquet with Spark's own file writer, exactly once: foreachBatch + SparkFileSink.

Run it against a ZooKeeper of your own::

    python -m examples.spark_files_query --zk 127.0.0.1:2181 --input /tmp/in \\
        --output /tmp/out --checkpoint /tmp/ck

Every input file (examples.file_sink_query's) is one micro-batch, written as Parquet into
``--output/batch=<n>/`` by Spark's writer and made visible once committed; the query exits once all of
them are. --fail-rate makes the first attempt of some tasks fail, as a flaky executor would; Spark
retries them. --slow-ms slows every row down, so that tests can kill the driver mid-write.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from examples.file_sink_query import INPUT_SCHEMA, build_spark, fails_first_attempt, query_parser
from sinks.spark_files import FORMATS, SparkFileSink

if TYPE_CHECKING:
    from pyspark.sql import Column


def faults(app: str, fail_rate: float, slow_ms: int) -> Callable[[Column], Column]:
    """A column function passing ``id`` through, slowly and failing first attempts if asked (a Python UDF:
    only the example's faults make rows cross into Python)."""
    from pyspark.sql import functions as F

    from twophase.spark.task_context import task_context

    def pass_through(row_id):  # no type hints: PySpark would read them as a pandas UDF's
        if slow_ms:
            time.sleep(slow_ms / 1000)
        if fail_rate and fails_first_attempt(task_context(app), fail_rate):
            raise RuntimeError("injected failure: first attempt of this task dies mid-write")
        return row_id

    return F.udf(pass_through, "long")


def main(argv: list[str] | None = None) -> int:
    """Run the query into ``--output`` until the input is used up and committed; return its exit code."""
    from twophase.spark import TwoPhaseBatchSink

    parser = query_parser(__doc__.splitlines()[0], app="spark-files-example")
    parser.add_argument("--output", required=True)
    parser.add_argument("--format", choices=FORMATS, default="parquet")
    args = parser.parse_args(argv)
    spark = build_spark()
    df = (spark.readStream.schema(INPUT_SCHEMA).option("maxFilesPerTrigger", 1)
          .json(args.input).repartition(args.partitions))
    if args.fail_rate or args.slow_ms:
        df = df.withColumn("id", faults(args.app, args.fail_rate, args.slow_ms)("id"))
    sink = SparkFileSink(args.output, format=args.format, partition_by=["batch"])
    with TwoPhaseBatchSink(sink, app=args.app, zk=args.zk, root=args.root, coordinator=args.coordinator,
                           spark=spark) as files:
        query = (df.writeStream.foreachBatch(files.write).option("checkpointLocation", args.checkpoint)
                 .trigger(availableNow=True).start())
        query.awaitTermination()
        if args.coordinator == "embedded":
            files.await_committed(query, timeout=120)
    spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
