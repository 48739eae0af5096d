#!/usr/bin/env python
"""Many producers, each one small request at a time, under fsync "always": what group commit buys.

Run (from the repo root)::

    source scripts/env.sh
    python bench/group_commit.py                                   # 1 4 16 64 connections, 1 partition
    python bench/group_commit.py --connections 1 8 --partitions 8 --requests 300

A Spark task writing through the log sink sends small produce requests and waits for each answer
(acks=all). Here each producer is one ``WireLoad`` connection (bench/wire_load.py) doing just that:
one Produce request of one record of ``--size`` bytes, then the answer, ``--requests`` times. The
connections run at once, in threads, spread over ``--partitions`` partitions of one topic, against a
broker subprocess with fsync "always".

For scale, same run: one writer appending the same number of batches to a plain file with write +
fdatasync each, the most a broker that fsyncs every request on its own could answer per second
(the broker before group commit did that, on its event loop). Group commit shares one fsync among
all appends to a partition made while the previous fsync ran, so requests/s should grow with the
connections until the broker's own per-request CPU (Python: decode, append, answer) is the limit;
``vs 1`` is that growth. Where a disk's fsync is slow (milliseconds, no write cache) the broker
ends far above the plain column; on a disk whose fsync costs about what a request costs in CPU
(this host: ~0.2 ms), it ends near it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from confluent_kafka.admin import AdminClient, NewTopic  # noqa: E402

from broker_throughput import BrokerRunner, plain_append  # noqa: E402  (bench/ is on sys.path as a script)
from twophase.wire.records import record_batch  # noqa: E402
from wire_load import WireLoad  # noqa: E402


def broker_rate(bootstrap: str, topic: str, partitions: int, connections: int, requests: int,
                batch: bytes) -> float:
    """Produce requests answered per second with ``connections`` producers, each waiting for every answer."""
    loads = [WireLoad(bootstrap, partition=i % partitions) for i in range(connections)]
    errors: list[BaseException] = []
    start = threading.Barrier(connections + 1)

    def run(load: WireLoad) -> None:
        start.wait()
        try:
            load.produce(topic, [batch], repeat=requests, in_flight=1)
        except BaseException as exc:  # reported below, the bench stops
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(load,)) for load in loads]
    for thread in threads:
        thread.start()
    start.wait()
    t = time.perf_counter()
    for thread in threads:
        thread.join()
    seconds = time.perf_counter() - t
    for load in loads:
        load.__exit__()
    if errors:
        raise errors[0]
    return connections * requests / seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--connections", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--partitions", type=int, default=1, help="partitions the connections spread over")
    parser.add_argument("--requests", type=int, default=300, help="requests per connection (default %(default)s)")
    parser.add_argument("--size", type=int, default=1024, help="record value bytes (default %(default)s)")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each measurement; medians reported")
    args = parser.parse_args(argv)
    batch = record_batch([(int(time.time() * 1000), None, os.urandom(args.size), ())])

    rows = []
    with tempfile.TemporaryDirectory(prefix="twophase-group-commit-") as workdir:
        with BrokerRunner(os.path.join(workdir, "data"), "always", in_process=False) as broker:
            admin = AdminClient({"bootstrap.servers": broker.bootstrap})
            for connections in args.connections:
                rates, plain_rates = [], []
                for _ in range(args.rounds):
                    topic = f"group-commit-{uuid.uuid4().hex[:8]}"
                    admin.create_topics([NewTopic(topic, args.partitions, 1)])[topic].result(timeout=30)
                    rates.append(broker_rate(broker.bootstrap, topic, args.partitions, connections,
                                             args.requests, batch))
                    total = connections * args.requests
                    plain = os.path.join(workdir, "plain")
                    plain_rates.append(total / plain_append(plain, [batch] * total, "always"))
                    os.unlink(plain)
                    admin.delete_topics([topic])[topic].result(timeout=30)
                rows.append((connections, statistics.median(rates), statistics.median(plain_rates)))
                print(f"{connections} connections: {rows[-1][1]:.0f} requests/s, plain {rows[-1][2]:.0f}/s",
                      file=sys.stderr, flush=True)

    print()
    print(f"broker subprocess, fsync always, {args.partitions} partition(s), one {args.size} B record per "
          f"request, each connection waits for every answer, {args.requests} requests per connection, "
          f"{args.rounds} round(s) (medians)")
    print()
    head = f"{'connections':>11}{'requests/s':>12}{'vs 1':>7}{'ms/request':>12}{'plain write+fdatasync/s':>25}"
    print(head)
    print("-" * len(head))
    single = next((rate for connections, rate, _ in rows if connections == 1), None)
    for connections, rate, plain_rate in rows:
        growth = f"{rate / single:>7.2f}" if single else f"{'':>7}"
        print(f"{connections:>11}{rate:>12.0f}{growth}{connections / rate * 1000:>12.2f}{plain_rate:>25.0f}")
    print("-" * len(head))
    print("ms/request: each producer's wait per request (connections / requests per second)")
    print(f"host: {os.cpu_count()} CPUs, 1-min load average {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
