#!/usr/bin/env python
"""Read rate of the ``twophase-kafka`` Spark source against a confluent-kafka consumer, same topic, same run.

Run (from the repo root)::

    source scripts/env.sh
    python bench/source_throughput.py                          # 500k records of 100 B, 12 partitions, 3 rounds
    python bench/source_throughput.py --records 100000 --rounds 1

The built-in broker runs as its own process (``twophase broker``, fsync always) on a fresh data
directory, as a real broker would: neither reader shares its interpreter. A confluent-kafka
producer fills one topic of P partitions with N records. Then, for each round, in alternating order
(ABBA across rounds, after an untimed warm-up of each that also checks the row count):

- **confluent-kafka**: one ``Consumer`` assigned every partition from the beginning
  (read_committed), timed until it has received N records.
- **twophase-kafka**: ``spark.read.format("twophase-kafka")`` (read_committed) over the whole topic
  written to Spark's ``noop`` sink on ``local[2]``: one Spark task per Kafka partition, each with a
  consumer of its own, rows handed to Spark as Arrow record batches.

The table shows each reader's median rows/s and the source's rate relative to confluent-kafka
(target: at least 0.5).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("PYSPARK_SUBMIT_ARGS", "--conf spark.ui.showConsoleProgress=false pyspark-shell")

from confluent_kafka import OFFSET_BEGINNING, Consumer, Producer, TopicPartition  # noqa: E402

from examples.demo_processes import BrokerProcess  # noqa: E402
from examples.file_sink_query import build_spark  # noqa: E402
from twophase.client import Admin  # noqa: E402
from twophase.spark import register  # noqa: E402


def fill(bootstrap: str, topic: str, partitions: int, records: int, value_bytes: int) -> None:
    with Admin(bootstrap) as admin:
        admin.create_topics({topic: partitions})
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 20, "batch.size": 256 * 1024,
                         "enable.idempotence": True})
    value = b"v" * value_bytes
    for i in range(records):
        while True:
            try:
                producer.produce(topic, value=value, key=b"%d" % i, partition=i % partitions)
                break
            except BufferError:
                producer.poll(0.05)
        if i % 10_000 == 0:
            producer.poll(0)
    if producer.flush(120) != 0:
        raise SystemExit("records left unacknowledged")


def confluent_read(bootstrap: str, topic: str, partitions: int, records: int) -> float:
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"bench-{uuid.uuid4().hex[:8]}",
                         "enable.auto.commit": False, "isolation.level": "read_committed",
                         "fetch.max.bytes": 50 << 20, "max.partition.fetch.bytes": 8 << 20})
    try:
        start = time.perf_counter()
        consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in range(partitions)])
        got = 0
        while got < records:
            for m in consumer.consume(num_messages=10_000, timeout=5.0):
                if m.error() is None:
                    got += 1
        return time.perf_counter() - start
    finally:
        consumer.close()


def source_frame(spark, bootstrap: str, topic: str):
    return (spark.read.format("twophase-kafka").option("kafka.bootstrap.servers", bootstrap)
            .option("subscribe", topic).load())


def source_read(spark, bootstrap: str, topic: str) -> float:
    start = time.perf_counter()
    source_frame(spark, bootstrap, topic).write.format("noop").mode("overwrite").save()
    return time.perf_counter() - start


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--records", type=int, default=500_000)
    p.add_argument("--partitions", type=int, default=12)
    p.add_argument("--value-bytes", type=int, default=100)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--master", default="local[2]")
    args = p.parse_args()

    with tempfile.TemporaryDirectory(prefix="source-bench-") as work:
        broker = BrokerProcess(os.path.join(work, "broker"), os.path.join(work, "broker.log")).start()
        bootstrap = broker.bootstrap
        spark = None
        try:
            topic = f"bench-{uuid.uuid4().hex[:8]}"
            fill(bootstrap, topic, args.partitions, args.records, args.value_bytes)
            spark = build_spark(args.master)
            register(spark)
            rows = source_frame(spark, bootstrap, topic).count()  # warm-up, and the check
            if rows != args.records:
                raise SystemExit(f"the source read {rows} rows, not {args.records}")
            confluent_read(bootstrap, topic, args.partitions, args.records)  # warm-up
            times: dict[str, list[float]] = {"confluent-kafka": [], "twophase-kafka": []}
            for round_ in range(args.rounds):
                order = ["confluent-kafka", "twophase-kafka"]
                for name in (order if round_ % 2 == 0 else order[::-1]):
                    if name == "confluent-kafka":
                        times[name].append(confluent_read(bootstrap, topic, args.partitions, args.records))
                    else:
                        times[name].append(source_read(spark, bootstrap, topic))
        finally:
            if spark is not None:
                spark.stop()
            broker.stop()

    rate = {name: args.records / statistics.median(t) for name, t in times.items()}
    print(f"\n{args.records:,} records of {args.value_bytes} B in {args.partitions} partitions, "
          f"median of {args.rounds} round(s), {args.master}")
    print(f"{'reader':<18} {'rows/s':>10} {'vs confluent-kafka':>20}")
    for name in times:
        print(f"{name:<18} {rate[name]:>10,.0f} {rate[name] / rate['confluent-kafka']:>19.2f}x")
    print("target: twophase-kafka >= 0.50x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
