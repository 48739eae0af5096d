#!/usr/bin/env python
"""LogSink row by row (``write``, the foreach path) against an Arrow batch at a time (``write_batch``),
and the producer's ``send`` per record against ``send_many``, on the built-in broker.

Run (from the repo root)::

    source scripts/env.sh
    python bench/log_write_batch.py                      # 100k x 1 KB values, 3 rounds
    python bench/log_write_batch.py --records 20000 --rounds 1

A fresh ``twophase broker`` subprocess (fsync 1000 ms) and a fresh 4-partition topic per
measurement. Rows are Spark Kafka sink rows (``columns="kafka"``: a binary ``value``, a string
``key``), in Arrow batches of 10,000 rows (Spark's spark.sql.execution.arrow.maxRecordsPerBatch).
Two figures per path, in µs per record: "call" is the time spent in the write/send calls (what
the caller pays per row), "total" runs until the transaction is flushed (pre_commit) or the
producer flushed, so it includes encoding and sending. Medians over rounds; the host is shared.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pyarrow as pa  # noqa: E402
from broker_throughput import BrokerRunner  # noqa: E402  (bench/ is on sys.path when run as a script)

from sinks.log import LogSink  # noqa: E402
from twophase.client import Admin, Producer  # noqa: E402
from twophase.sink import Record, TxnContext  # noqa: E402

BATCH_ROWS = 10_000


def new_topic(bootstrap: str) -> str:
    name = f"bench-{uuid.uuid4().hex[:8]}"
    with Admin(bootstrap) as admin:
        admin.create_topics({name: 4})
    return name


def batches(records: int, size: int) -> list[pa.RecordBatch]:
    value = b"x" * size
    keys = [f"key-{i}" for i in range(records)]
    return [pa.RecordBatch.from_pydict({"key": pa.array(keys[i:i + BATCH_ROWS], pa.string()),
                                        "value": pa.array([value] * len(keys[i:i + BATCH_ROWS]), pa.binary())})
            for i in range(0, records, BATCH_ROWS)]


def sink_run(bootstrap: str, data: list[pa.RecordBatch], by_row: bool) -> tuple[float, float]:
    sink = LogSink(bootstrap, new_topic(bootstrap), columns="kafka")
    rows = [Record(r) for b in data for r in b.to_pylist()] if by_row else None  # Spark hands foreach its rows
    txn = sink.begin_transaction(TxnContext("bench", "q", "r", 0, 0, 0, slot=0))
    start = time.perf_counter()
    if by_row:
        for row in rows:
            sink.write(txn, row)
    else:
        for batch in data:
            sink.write_batch(txn, batch)
    called = time.perf_counter()
    handle = sink.pre_commit(txn)
    done = time.perf_counter()
    sink.commit(handle)
    return called - start, done - start


def producer_run(bootstrap: str, data: list[pa.RecordBatch], bulk: bool) -> tuple[float, float]:
    topic = new_topic(bootstrap)
    records = [(topic, None, k.encode(), v, None, None) for b in data
               for k, v in zip(b.column(0).to_pylist(), b.column(1).to_pylist())]
    with Producer(bootstrap) as producer:
        producer.send_many(records[:1])  # metadata and producer id outside the clock
        producer.flush()
        start = time.perf_counter()
        if bulk:
            for i in range(0, len(records), BATCH_ROWS):
                producer.send_many(records[i:i + BATCH_ROWS])
        else:
            for topic_, _, key, value, _, _ in records:
                producer.send(topic_, value=value, key=key)
        called = time.perf_counter()
        producer.flush()
        done = time.perf_counter()
    return called - start, done - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=100_000)
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    data = batches(args.records, args.size)
    runs = {"Producer.send": lambda b: producer_run(b, data, False),
            "Producer.send_many": lambda b: producer_run(b, data, True),
            "LogSink.write": lambda b: sink_run(b, data, True),
            "LogSink.write_batch": lambda b: sink_run(b, data, False)}
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in runs}
    with tempfile.TemporaryDirectory() as tmp, BrokerRunner(f"{tmp}/data", "1000", in_process=False) as broker:
        for round_ in range(args.rounds):
            names = list(runs) if round_ % 2 == 0 else list(reversed(runs))  # alternate the order
            for name in names:
                results[name].append(runs[name](broker.bootstrap))
    print(f"{args.records} records of {args.size} B, median of {args.rounds} rounds, µs per record:")
    print(f"{'':22} {'call':>8} {'total':>8}")
    for name, times in results.items():
        call = statistics.median(t[0] for t in times) / args.records * 1e6
        total = statistics.median(t[1] for t in times) / args.records * 1e6
        print(f"{name:22} {call:8.2f} {total:8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
