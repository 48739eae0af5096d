#!/usr/bin/env python
"""What transactions cost on the built-in broker: transactional vs idempotent produce, read_committed vs
read_uncommitted consume.

Run (from the repo root)::

    source scripts/env.sh
    python bench/txn_throughput.py                             # 100k x 1 KB, transactions of 1, 10, 100 ms, 5 rounds
    python bench/txn_throughput.py --records 30000 --rounds 1  # quick look
    python bench/txn_throughput.py --clients confluent         # librdkafka only

A fresh broker (``twophase broker`` subprocess, as in bench/broker_throughput.py, ``--fsync``
default 1000 ms, as Kafka does not fsync each append either; ``--fsync always`` for the other end) and, for every measurement, a fresh one-partition topic. Producers: acks=all, no
compression, linger 5 ms (``--linger-ms``), 32 MB of unacknowledged records at most (Java's default
``buffer.memory``: a send waits for room, so a run measures a producer the broker keeps up with,
not one queueing the whole run in memory); confluent-kafka (librdkafka) and the project's own
twophase.client.

- **idempotent** (the baseline, same run): no transactions; the clock runs from the first send
  to ``flush()`` returning.
- **transactional, T ms**: the same N records in transactions of R x T / 1000 records each, R
  being the client's idempotent records/s, so each transaction holds about T ms worth of records
  at full speed: begin, send, flush, commit (EndTxn; the broker writes the markers). The clock
  covers all of them; "commit ms" is the median time of the commit alone, the fixed cost per
  transaction, which is steadier than the rates on a busy host.
- Measurements are paired: every transactional run sits next to an idempotent run of the same
  client, and "vs baseline" is the median over rounds of transactional / that idempotent run. The
  host is shared, so unpaired rates drift by tens of percent between minutes. Rounds alternate
  which of the two goes first, and each timed run starts after an ``os.sync()``: the broker
  fsyncs once a second, so a run used to pay for writing back the run before it (300 MB), and the
  transactional run, always second, paid for the idempotent one.
- **consume**: a fresh confluent-kafka consumer reads the N records of the last 100 ms topic from
  the beginning, read_uncommitted (the baseline) then read_committed (which stops at the last
  stable offset and skips the commit markers), paired the same way.

Kafka's published figure (Confluent, "Transactions in Apache Kafka", 2017): a producer of 1 KB
records at full throughput loses about 3% committing every 100 ms. Ours is printed beside it.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from broker_throughput import BrokerRunner, consume  # noqa: E402  (bench/ is on sys.path when run as a script)
from confluent_kafka import Producer  # noqa: E402
from confluent_kafka.admin import AdminClient, NewTopic  # noqa: E402

from twophase.client import Producer as TwophaseProducer  # noqa: E402

KAFKA_OVERHEAD_AT_100MS = 0.03
BUFFER_BYTES = 32 << 20  # what each producer may queue unacknowledged: Java's buffer.memory, twophase.client's
PRODUCER = {"acks": "all", "enable.idempotence": True,
            "queue.buffering.max.kbytes": BUFFER_BYTES >> 10, "queue.buffering.max.messages": 1_000_000}


def new_topic(bootstrap: str) -> str:
    name = f"bench-{uuid.uuid4().hex[:8]}"
    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.create_topics([NewTopic(name, 1, 1)])[name].result(30)
    return name


class ConfluentClient:
    name = "confluent-kafka"

    def __init__(self, bootstrap: str, linger_ms: int, transactional_id: str | None = None) -> None:
        config = {"bootstrap.servers": bootstrap, "linger.ms": linger_ms, **PRODUCER}
        if transactional_id:
            config["transactional.id"] = transactional_id
        self.producer = Producer(config)
        if transactional_id:
            self.producer.init_transactions(30)

    def send_all(self, topic: str, pool: list[bytes], count: int, start: int) -> None:
        producer = self.producer
        for i in range(start, start + count):
            while True:
                try:
                    producer.produce(topic, value=pool[i & 1023])
                    break
                except BufferError:
                    producer.poll(0.005)
            if i & 1023 == 0:
                producer.poll(0)

    def flush(self) -> None:
        if self.producer.flush(300):
            raise RuntimeError("records left unflushed")

    def begin(self) -> None:
        self.producer.begin_transaction()

    def commit(self) -> None:
        self.producer.commit_transaction(300)

    def close(self) -> None:
        self.producer.flush(30)


class TwophaseClient:
    name = "twophase.client"

    def __init__(self, bootstrap: str, linger_ms: int, transactional_id: str | None = None) -> None:
        self.producer = TwophaseProducer(bootstrap, transactional_id=transactional_id, linger_ms=linger_ms,
                                         batch_size=1 << 20, buffer_memory=BUFFER_BYTES)
        if transactional_id:
            self.producer.init_transactions()

    def send_all(self, topic: str, pool: list[bytes], count: int, start: int) -> None:
        send = self.producer.send
        for i in range(start, start + count):
            send(topic, value=pool[i & 1023], partition=0)

    def flush(self) -> None:
        self.producer.flush()

    def begin(self) -> None:
        self.producer.begin_transaction()

    def commit(self) -> None:
        self.producer.commit_transaction()

    def close(self) -> None:
        self.producer.close()


def idempotent(client_type, bootstrap: str, linger_ms: int, pool: list[bytes], records: int) -> float:
    """records/s of an idempotent producer, connection and metadata set up outside the clock."""
    topic = new_topic(bootstrap)
    client = client_type(bootstrap, linger_ms)
    try:
        client.send_all(topic, pool, 1, 0)
        client.flush()
        os.sync()  # untimed: the kernel writes back the previous run's dirty pages, not this run
        t = time.perf_counter()
        client.send_all(topic, pool, records, 0)
        client.flush()
        return records / (time.perf_counter() - t)
    finally:
        client.close()


def transactional(client_type, bootstrap: str, linger_ms: int, pool: list[bytes], records: int,
                  per_txn: int) -> tuple[float, float, str]:
    """records/s in transactions of ``per_txn`` records (after one warm-up transaction), the median ms
    of one commit after its records were flushed (EndTxn and markers: the per-transaction cost), and
    the topic."""
    topic = new_topic(bootstrap)
    client = client_type(bootstrap, linger_ms, f"bench-{uuid.uuid4().hex}")
    try:
        client.begin()
        client.send_all(topic, pool, 1, 0)
        client.commit()
        commits = []
        os.sync()
        t = time.perf_counter()
        done = 0
        while done < records:
            n = min(per_txn, records - done)
            client.begin()
            client.send_all(topic, pool, n, done)
            client.flush()
            c = time.perf_counter()
            client.commit()
            commits.append(time.perf_counter() - c)
            done += n
        return records / (time.perf_counter() - t), statistics.median(commits) * 1000, topic
    finally:
        client.close()


def paired(client_type, bootstrap: str, linger_ms: int, pool: list[bytes], records: int, txn_ms: int,
           baseline_first: bool) -> tuple[float, float, float, int, str]:
    """One idempotent and one transactional run: (idempotent records/s, transactional records/s, commit
    ms, records per transaction, topic). Transactions hold ``txn_ms`` worth of records at the rate of an
    idempotent run: the paired one when it goes first, else a short one (a tenth of the records).
    Rounds alternate which goes first, so neither always runs right after the other."""
    if baseline_first:
        base = idempotent(client_type, bootstrap, linger_ms, pool, records)
    else:
        base = idempotent(client_type, bootstrap, linger_ms, pool, max(1, records // 10))
    per_txn = max(1, round(base * txn_ms / 1000))
    rate, commit_ms, topic = transactional(client_type, bootstrap, linger_ms, pool, records, per_txn)
    if not baseline_first:
        base = idempotent(client_type, bootstrap, linger_ms, pool, records)
    return base, rate, commit_ms, per_txn, topic


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--records", type=int, default=100_000)
    p.add_argument("--size", type=int, default=1024, help="record value bytes (Kafka's figure: 1 KB)")
    p.add_argument("--txn-ms", type=int, nargs="+", default=[1, 10, 100])
    p.add_argument("--rounds", type=int, default=5, help="median of this many rounds")
    p.add_argument("--fsync", default="1000", help="the broker's --fsync policy (default 1000 ms: Kafka's own "
                   "figure is for brokers that leave flushing to the page cache)")
    p.add_argument("--linger-ms", type=int, default=5, help="both clients' linger (librdkafka's default: 5 ms; "
                   "Java's was 0 until Kafka 4.0)")
    p.add_argument("--clients", nargs="+", choices=sorted(CLIENTS), default=sorted(CLIENTS))
    args = p.parse_args(argv)

    pool = [os.urandom(args.size) for _ in range(1024)]
    work = tempfile.mkdtemp(prefix="txn-bench-")
    rates: dict[tuple[str, str], list[float]] = {}    # (client, mode) -> records/s per run
    ratios: dict[tuple[str, str], list[float]] = {}   # (client, mode) -> vs the paired baseline
    per_txn: dict[tuple[str, int], list[int]] = {}
    commits: dict[tuple[str, str], list[float]] = {}  # (client, mode) -> median commit ms per run
    try:
        with BrokerRunner(os.path.join(work, "data"), args.fsync, in_process=False) as broker:
            for r in range(args.rounds):
                for client in (CLIENTS[c] for c in args.clients):
                    for ms in args.txn_ms:
                        base, rate, commit_ms, n, topic = paired(client, broker.bootstrap, args.linger_ms, pool,
                                                                 args.records, ms, baseline_first=r % 2 == 0)
                        commits.setdefault((client.name, f"{ms} ms"), []).append(commit_ms)
                        rates.setdefault((client.name, "idempotent"), []).append(base)
                        rates.setdefault((client.name, f"{ms} ms"), []).append(rate)
                        ratios.setdefault((client.name, f"{ms} ms"), []).append(rate / base)
                        per_txn.setdefault((client.name, ms), []).append(n)
                # From offset 0: the warm-up record is read too, as it always was here.
                uncommitted = args.records / consume(broker.bootstrap, topic, args.records + 1, start=0,
                                                     isolation="read_uncommitted")
                committed = args.records / consume(broker.bootstrap, topic, args.records + 1, start=0,
                                                   isolation="read_committed")
                rates.setdefault(("consume", "read_uncommitted"), []).append(uncommitted)
                rates.setdefault(("consume", "read_committed"), []).append(committed)
                ratios.setdefault(("consume", "read_committed"), []).append(committed / uncommitted)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    med = statistics.median
    mb = args.size / 1e6
    print(f"\nbuilt-in broker (subprocess, fsync {args.fsync}), 1 partition, acks=all, linger {args.linger_ms} ms, "
          f"{args.records} x {args.size} B, median of {args.rounds} round(s)\n")
    print(f"{'client':<17}{'mode':<26}{'records/txn':>12}{'records/s':>11}{'MB/s':>8}{'commit ms':>10}"
          f"{'vs baseline':>13}{'Kafka':>8}")

    def row(client: str, mode: str, label: str, records_per_txn: str = "-", kafka: str = "") -> None:
        rate = med(rates[(client, mode)])
        ratio = f"{med(ratios[(client, mode)]) - 1:+.1%}" if (client, mode) in ratios else ""
        commit = f"{med(commits[(client, mode)]):.1f}" if (client, mode) in commits else ""
        print(f"{client:<17}{label:<26}{records_per_txn:>12}{rate:11.0f}{rate * mb:8.1f}{commit:>10}{ratio:>13}"
              f"{kafka:>8}")

    for client in (CLIENTS[c].name for c in args.clients):
        row(client, "idempotent", "idempotent (baseline)")
        for ms in args.txn_ms:
            row(client, f"{ms} ms", f"transactional, {ms} ms", f"{med(per_txn[(client, ms)]):.0f}",
                f"{-KAFKA_OVERHEAD_AT_100MS:+.0%}" if ms == 100 else "")
    row("consume", "read_uncommitted", "read_uncommitted (base)")
    row("consume", "read_committed", "read_committed")
    print(f"\nKafka's published figure: about {KAFKA_OVERHEAD_AT_100MS:.0%} producer overhead with 100 ms "
          "transactions of 1 KB records. 'commit ms': one commit after its records were flushed, the fixed cost\n"
          "per transaction (commit ms / (commit ms + T) is the overhead it alone implies). Consume: confluent-kafka\n"
          "on the last transactional topic. 'vs baseline': median over rounds of the paired ratios.")
    return 0


CLIENTS = {"confluent": ConfluentClient, "twophase": TwophaseClient}

if __name__ == "__main__":
    sys.exit(main())
