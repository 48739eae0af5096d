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

import sys
import time
import uuid
from typing import Any

from examples.file_sink_query import fails_first_attempt, query_parser, run_query
from sinks.log import LogSink, LogTxn


class FaultyLogSink(LogSink):
    """A LogSink whose first task attempts fail now and then, and which can be slow.

    fail_rate is the share of (run, epoch, partition) whose first attempt raises
    after its first record; the choice is a hash, so it is the same in every worker.
    """

    def __init__(self, bootstrap: str, topic: str, fail_rate: float = 0.0, slow_ms: int = 0,
                 key: str = "id") -> None:
        super().__init__(bootstrap, topic, key=key, provenance=True)
        self.fail_rate = fail_rate
        self.slow_ms = slow_ms

    def begin_transaction(self, ctx) -> LogTxn:
        """Begin a log transaction and decide whether this attempt is one that fails."""
        txn = super().begin_transaction(ctx)
        txn.fail = fails_first_attempt(ctx, self.fail_rate)
        return txn

    def write(self, txn: LogTxn, row: Any) -> None:
        """Write one row, slowly if asked; raise RuntimeError right after it in a failing attempt."""
        if self.slow_ms:
            time.sleep(self.slow_ms / 1000)
        super().write(txn, row)
        if txn.fail:
            raise RuntimeError("injected failure: first attempt of this partition dies mid-write")


def read_topic(bootstrap: str, topic: str, isolation: str = "read_committed", timeout: float = 60.0,
               security: dict[str, str] | None = None) -> list:
    """Every record of ``topic`` a fresh confluent-kafka consumer sees, up to the end of each partition.

    The end is the last stable offset for read_committed (records of open
    transactions are not visible yet), the high watermark for read_uncommitted.
    ``security``: TLS/SASL settings, under the Kafka names librdkafka and twophase.client share.
    """
    # Imported here: the job and its Spark workers do not need the reader's client.
    from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, KafkaException, TopicPartition

    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"reader-{uuid.uuid4().hex}",
                         "enable.auto.commit": False, "enable.partition.eof": True,
                         "isolation.level": isolation, **(security or {})})
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
    """Run the example query into ``--topic`` until it stops; return its exit code."""
    parser = query_parser(__doc__.splitlines()[0], app="log-sink-example")
    parser.add_argument("--bootstrap", required=True)
    parser.add_argument("--topic", required=True)
    args = parser.parse_args(argv)
    return run_query(FaultyLogSink(args.bootstrap, args.topic, fail_rate=args.fail_rate, slow_ms=args.slow_ms), args)


if __name__ == "__main__":
    sys.exit(main())
