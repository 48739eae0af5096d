"""The main job: orders from a Kafka topic, enriched and totalled per user, written exactly once.

Run it against a ZooKeeper and a broker of your own (the built-in one:
``twophase broker --data-dir /tmp/broker --port 9092``)::

    python -m examples.kafka_pipeline_query --zk 127.0.0.1:2181 --bootstrap 127.0.0.1:9092 \\
        --checkpoint /tmp/ck --trigger available-now

Two streaming queries read ``--input-topic`` through the ``twophase-kafka`` source
(read_committed: aborted input never becomes a row):

- enrichment (stateless, append): the JSON value ``{"id", "user", "amount"}``
  becomes a row with derived fields (amount in cents, a size class, the
  user's region, where the order came from) on ``--enriched-topic``, key = id;
- totals (stateful, update mode): orders and amount in cents per user, each
  epoch's changed users on ``--totals-topic``, key = user.

Both write through TwoPhaseSink(LogSink) (apps ``<app>-enrich`` and
``<app>-totals``), with provenance headers, so a reader knows the epoch of each
total. ``--trigger`` is a processing-time interval (the query runs until the
process is killed) or ``available-now`` (it reads what is there, waits until every
epoch is committed and exits 0). --fail-rate makes first task attempts fail.
"""

from __future__ import annotations

import argparse
import sys

from examples.file_sink_query import build_spark
from examples.log_sink_query import FaultyLogSink

ORDER_SCHEMA = "id LONG, user STRING, amount DOUBLE"
REGIONS = ("eu", "us", "apac")
LARGE_CENTS = 5_000


def enrich_order(order: dict) -> dict:
    """The enrichment in plain Python, for checking the query's output: the derived fields of one order."""
    cents = round(order["amount"] * 100)
    user_number = int(order["user"].lstrip("u"))
    return {"amount_cents": cents, "size": "large" if cents >= LARGE_CENTS else "small",
            "region": REGIONS[user_number % len(REGIONS)]}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Parse the job's command line."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--zk", required=True)
    p.add_argument("--bootstrap", required=True)
    p.add_argument("--checkpoint", required=True, help="checkpoint parent dir: <it>/enrich, <it>/totals")
    p.add_argument("--root", default="/twophase")
    p.add_argument("--app", default="orders")
    p.add_argument("--input-topic", default="orders")
    p.add_argument("--enriched-topic", default="orders-enriched")
    p.add_argument("--totals-topic", default="user-totals")
    p.add_argument("--trigger", default="available-now", help="'available-now' or an interval, e.g. '1 second'")
    p.add_argument("--max-offsets", type=int, default=400, help="maxOffsetsPerTrigger of each query")
    p.add_argument("--fail-rate", type=float, default=0.0)
    p.add_argument("--slow-ms", type=int, default=0)
    return p.parse_args(argv)


def read_orders(spark, args: argparse.Namespace):
    """The input topic as orders: the parsed JSON value, plus where each record came from."""
    from pyspark.sql import functions as F

    raw = (spark.readStream.format("twophase-kafka")
           .option("kafka.bootstrap.servers", args.bootstrap)
           .option("subscribe", args.input_topic)
           .option("startingOffsets", "earliest")
           .option("kafka.isolation.level", "read_committed")
           .option("maxOffsetsPerTrigger", args.max_offsets)
           .load())
    return raw.select(F.from_json(F.col("value").cast("string"), ORDER_SCHEMA).alias("o"),
                      F.col("partition").alias("in_partition"), F.col("offset").alias("in_offset")
                      ).select("o.*", "in_partition", "in_offset")


def enriched(orders):
    """The stateless enrichment (see :func:`enrich_order`)."""
    from pyspark.sql import functions as F

    cents = F.round(F.col("amount") * 100).cast("long")
    user_number = F.regexp_replace("user", "^u+", "").cast("int")
    regions = F.array(*[F.lit(r) for r in REGIONS])
    return orders.select(
        "id", "user", "amount", cents.alias("amount_cents"),
        F.when(cents >= LARGE_CENTS, "large").otherwise("small").alias("size"),
        F.element_at(regions, (user_number % len(REGIONS) + 1).cast("int")).alias("region"),
        "in_partition", "in_offset")


def totals(orders):
    """The stateful aggregation: orders and amount in cents per user, running totals."""
    from pyspark.sql import functions as F

    return (orders.groupBy("user")
            .agg(F.count("*").alias("orders"),
                 F.sum(F.round(F.col("amount") * 100).cast("long")).alias("total_cents")))


def start(df, writer, checkpoint: str, mode: str, trigger: str):
    """Start one query of the job into ``writer``."""
    stream = df.writeStream.foreach(writer).outputMode(mode).option("checkpointLocation", checkpoint)
    stream = stream.trigger(availableNow=True) if trigger == "available-now" else stream.trigger(processingTime=trigger)
    return stream.start()


def main(argv: list[str] | None = None) -> int:
    """Run both queries; with available-now, exit 0 once both are done and committed."""
    from twophase.spark import TwoPhaseSink, register

    args = parse_args(argv)
    spark = build_spark()
    register(spark)
    orders = read_orders(spark, args)
    enrich_sink = FaultyLogSink(args.bootstrap, args.enriched_topic, key="id",
                                fail_rate=args.fail_rate, slow_ms=args.slow_ms)
    totals_sink = FaultyLogSink(args.bootstrap, args.totals_topic, key="user",
                                fail_rate=args.fail_rate, slow_ms=args.slow_ms)
    with TwoPhaseSink(enrich_sink, app=f"{args.app}-enrich", zk=args.zk, root=args.root) as enrich_writer, \
            TwoPhaseSink(totals_sink, app=f"{args.app}-totals", zk=args.zk, root=args.root) as totals_writer:
        queries = [
            (start(enriched(orders), enrich_writer, f"{args.checkpoint}/enrich", "append", args.trigger),
             enrich_writer),
            (start(totals(orders), totals_writer, f"{args.checkpoint}/totals", "update", args.trigger),
             totals_writer),
        ]
        for query, writer in queries:
            query.awaitTermination()   # raises if the query failed
            writer.await_committed(query, timeout=120)
    spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
