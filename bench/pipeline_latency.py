#!/usr/bin/env python
"""End-to-end latency of read -> process -> write exactly once: produced to an input topic until
visible to a read_committed consumer of the output topic, at a fixed Spark trigger.

Run (from the repo root)::

    source scripts/env.sh
    python bench/pipeline_latency.py                    # 1 s trigger, 200 records/s for 60 s after a 20 s warm-up
    python bench/pipeline_latency.py --seconds 20 --warmup 10

A private ZooKeeper and the built-in broker (its own process, fsync always) on temp dirs. A
streaming query reads the 4-partition input topic with the ``twophase-kafka`` source
(read_committed), passes each record's key and value on, and writes them through
``TwoPhaseSink(LogSink)`` (embedded coordinator) to the output topic, with
``Trigger.ProcessingTime(trigger)``. A confluent-kafka producer writes records at a fixed rate,
each value holding the wall-clock time it was handed to the producer; a confluent-kafka
read_committed consumer of the output topic takes, for each record, the time it arrived minus that
time. Records produced during the warm-up are not counted. The baseline in the same run is the
trigger itself: the table shows median, p99 and max against the target p99 <= trigger + 1 s.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("PYSPARK_SUBMIT_ARGS", "--conf spark.ui.showConsoleProgress=false pyspark-shell")
os.environ.setdefault("TWOPHASE_SECRET", "twophase-bench-secret-0123456789")

from confluent_kafka import OFFSET_BEGINNING, Consumer, Producer, TopicPartition  # noqa: E402

from examples.demo_processes import BrokerProcess  # noqa: E402
from examples.file_sink_query import build_spark  # noqa: E402
from sinks.log import LogSink  # noqa: E402
from twophase.client import Admin  # noqa: E402
from twophase.spark import TwoPhaseSink, register  # noqa: E402
from twophase.zkserver import ZooKeeperServer  # noqa: E402

PARTITIONS = 4


class RateProducer(threading.Thread):
    """Writes ``rate`` records a second until stopped; each value is the send time (ns since the epoch)."""

    def __init__(self, bootstrap: str, topic: str, rate: int) -> None:
        super().__init__(name="rate-producer", daemon=True)
        self.producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 0, "enable.idempotence": True})
        self.topic, self.interval = topic, 1.0 / rate
        self.stopping = threading.Event()
        self.sent = 0

    def run(self) -> None:
        next_at = time.monotonic()
        while not self.stopping.is_set():
            self.producer.produce(self.topic, key=b"%d" % self.sent,
                                  value=json.dumps({"sent_ns": time.time_ns()}).encode(),
                                  partition=self.sent % PARTITIONS)
            self.producer.poll(0)
            self.sent += 1
            next_at += self.interval
            self.stopping.wait(max(0.0, next_at - time.monotonic()))
        self.producer.flush(60)


def measure(bootstrap: str, topic: str, until: float, counted_from_ns: int) -> list[float]:
    """Latencies (s) of records sent at or after ``counted_from_ns``, read until ``until`` (monotonic)."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"lat-{uuid.uuid4().hex[:8]}",
                         "isolation.level": "read_committed", "enable.auto.commit": False,
                         "fetch.wait.max.ms": 10})
    latencies: list[float] = []
    try:
        consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in range(PARTITIONS)])
        while time.monotonic() < until:
            for m in consumer.consume(num_messages=1000, timeout=0.2):
                if m.error() is None:
                    arrived = time.time_ns()
                    sent = json.loads(m.value())["sent_ns"]
                    if sent >= counted_from_ns:
                        latencies.append((arrived - sent) / 1e9)
    finally:
        consumer.close()
    return latencies


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trigger", type=float, default=1.0, help="seconds (1)")
    p.add_argument("--rate", type=int, default=200, help="records per second (200)")
    p.add_argument("--seconds", type=float, default=60.0, help="measured (60)")
    p.add_argument("--warmup", type=float, default=20.0, help="not counted (20)")
    p.add_argument("--master", default="local[2]")
    args = p.parse_args()

    with tempfile.TemporaryDirectory(prefix="latency-bench-") as work, ZooKeeperServer() as zk_server:
        broker = BrokerProcess(os.path.join(work, "broker"), os.path.join(work, "broker.log")).start()
        spark = query = producer = sink = None
        try:
            source_topic, out_topic = "lat-in", "lat-out"
            with Admin(broker.bootstrap) as admin:
                admin.create_topics({source_topic: PARTITIONS, out_topic: PARTITIONS})
            spark = build_spark(args.master)
            register(spark)
            rows = (spark.readStream.format("twophase-kafka").option("kafka.bootstrap.servers", broker.bootstrap)
                    .option("subscribe", source_topic).option("startingOffsets", "earliest").load()
                    .selectExpr("key", "value"))
            sink = TwoPhaseSink(LogSink(broker.bootstrap, out_topic, key="key", value="value"),
                                app=f"latency-{uuid.uuid4().hex[:6]}", zk=zk_server.hosts, spark=spark)
            query = (rows.writeStream.foreach(sink).trigger(processingTime=f"{args.trigger} seconds")
                     .option("checkpointLocation", os.path.join(work, "checkpoint")).start())
            producer = RateProducer(broker.bootstrap, source_topic, args.rate)
            producer.start()
            counted_from = time.time_ns() + int(args.warmup * 1e9)
            latencies = measure(broker.bootstrap, out_topic, time.monotonic() + args.warmup + args.seconds + 5,
                                counted_from)
        finally:
            if producer is not None:
                producer.stopping.set()
                producer.join(60)
            if query is not None:
                query.stop()
            if sink is not None:
                sink.close()
            if spark is not None:
                spark.stop()
            broker.stop()

    if not latencies:
        print("no record reached the output topic")
        return 1
    latencies.sort()
    p99 = latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))]
    print(f"\nproduce -> visible downstream (read_committed), trigger {args.trigger:g} s, "
          f"{args.rate} records/s, {len(latencies):,} records measured, {args.master}")
    print(f"{'median':>10} {'p99':>10} {'max':>10} {'target p99':>12}")
    print(f"{statistics.median(latencies):>9.2f}s {p99:>9.2f}s {latencies[-1]:>9.2f}s "
          f"{args.trigger + 1:>11.2f}s  {'met' if p99 <= args.trigger + 1 else 'MISSED'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
