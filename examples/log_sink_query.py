"""A streaming query through TwoPhaseSink(LogSink): JSON files in, exactly-once Kafka records out.

Run it against a ZooKeeper and a broker of your own (the built-in one:
``twophase broker --data-dir /tmp/broker --port 9092``)::

    python -m examples.log_sink_query --zk 127.0.0.1:2181 --bootstrap 127.0.0.1:9092 \\
        --topic out --input /tmp/in --checkpoint /tmp/ck

Every input row becomes one record on --topic: key = the row's id, value =
the row as JSON. It processes every file in --input (one file per
micro-batch) and exits once all of them are committed. --fail-rate makes the
first attempt of some partitions fail mid-write, as a flaky executor would;
Spark retries them and the failed attempts' transactions are aborted.
:func:`read_topic` is an independent reader (confluent-kafka, read_committed by
default) of what the query made visible.
"""

from __future__ import annotations

import argparse
import sys
import time
import uuid
import zlib
from typing import Any

from examples.file_sink_query import build_spark, start_query
from sinks.log import LogSink, LogTxn


class FaultyLogSink(LogSink):
    """A LogSink whose first task attempts fail now and then, and which can be slow.

    fail_rate is the share of (run, epoch, partition) whose first attempt raises
    after its first record; the choice is a hash, so it is the same in every worker.
    """

    def __init__(self, bootstrap: str, topic: str, fail_rate: float = 0.0, slow_ms: int = 0) -> None:
        super().__init__(bootstrap, topic, key="id", provenance=True)
        self.fail_rate = fail_rate
        self.slow_ms = slow_ms

    def begin_transaction(self, ctx) -> LogTxn:
        txn = super().begin_transaction(ctx)
        key = f"{ctx.run_id}:{ctx.epoch}:{ctx.partition}".encode()
        txn.fail = ctx.attempt == 0 and zlib.crc32(key) % 1000 < self.fail_rate * 1000
        return txn

    def write(self, txn: LogTxn, row: Any) -> None:
        if self.slow_ms:
            time.sleep(self.slow_ms / 1000)
        super().write(txn, row)
        if txn.fail:
            raise RuntimeError("injected failure: first attempt of this partition dies mid-write")


def read_topic(bootstrap: str, topic: str, isolation: str = "read_committed", timeout: float = 60.0) -> list:
    """Every record of ``topic`` a fresh confluent-kafka consumer sees, up to the end of each partition.

    The end is the last stable offset for read_committed (records of open
    transactions are not visible yet), the high watermark for read_uncommitted.
    """
    # Imported here: the job and its Spark workers do not need the reader's client.
    from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, KafkaException, TopicPartition

    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"reader-{uuid.uuid4().hex}",
                         "enable.auto.commit": False, "enable.partition.eof": True,
                         "isolation.level": isolation})
    try:
        metadata = consumer.list_topics(topic, timeout=timeout).topics[topic]
        if metadata.error is not None:
            raise KafkaException(metadata.error)
        consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in metadata.partitions])
        not_at_end, records = set(metadata.partitions), []
        deadline = time.monotonic() + timeout
        while not_at_end:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{topic}: partitions {sorted(not_at_end)} not read to the end in {timeout}s")
            msg = consumer.poll(0.5)
            if msg is None:
                continue
            if msg.error() is None:
                records.append(msg)
            elif msg.error().code() == KafkaError._PARTITION_EOF:
                not_at_end.discard(msg.partition())
            else:
                raise KafkaException(msg.error())
        return records
    finally:
        consumer.close()


def main(argv: list[str] | None = None) -> int:
    from twophase.spark import TwoPhaseSink

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--zk", required=True)
    parser.add_argument("--bootstrap", required=True)
    parser.add_argument("--topic", required=True)
    parser.add_argument("--input", required=True)
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--app", default="log-sink-example")
    parser.add_argument("--root", default="/twophase")
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--fail-rate", type=float, default=0.0)
    parser.add_argument("--slow-ms", type=int, default=0)
    parser.add_argument("--coordinator", choices=("embedded", "daemon"), default="embedded")
    args = parser.parse_args(argv)

    spark = build_spark()
    sink = FaultyLogSink(args.bootstrap, args.topic, fail_rate=args.fail_rate, slow_ms=args.slow_ms)
    writer = TwoPhaseSink(sink, app=args.app, zk=args.zk, root=args.root, coordinator=args.coordinator)
    query = start_query(spark, writer, args.input, args.checkpoint, args.partitions)
    query.awaitTermination()
    if args.coordinator == "embedded":
        writer.await_committed(query, timeout=120)
    spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
