#!/usr/bin/env python
"""Produce and consume throughput of twophase.client per compression codec, against no compression.

Run (from the repo root)::

    source scripts/env.sh
    python bench/codec_throughput.py                              # 200k records of ~220 B, 3 rounds
    python bench/codec_throughput.py --records 50000 --rounds 1   # quick look
    python bench/codec_throughput.py --fsync 100                  # the broker fsyncs every 100 ms

One embedded broker (``twophase.broker.Broker``, in a thread of this process: broker and client
share the GIL; cramjam and zlib release it while they work) on a fresh data directory. For each
round and codec (the order rotates each round, so no codec always runs first), in a fresh
one-partition topic:

- **produce**: a twophase.client ``Producer(compression=codec)`` (idempotent, acks=all, linger
  5 ms, 64 KiB batches before compression) sends N JSON-like records (an id, a user out of 1000,
  an event out of 5, a timestamp, 16 random bytes in hex: they compress about 3-fold), timed from
  the first ``send`` until ``flush`` returns (every batch acknowledged, so the broker inflated and
  checked every batch).
- **consume**: a fresh ``Consumer`` assigned to the partition reads the N records from offset 0,
  timed from ``assign`` until the last one arrives; every record's value is checked.
- **stored**: the bytes of the partition's segment files.

MB/s counts the records' uncompressed key and value bytes. The table shows each codec's median
over the rounds and its rate relative to no compression (the baseline, same run).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from twophase.broker import Broker  # noqa: E402
from twophase.client import Consumer, Producer  # noqa: E402

CODECS = ("none", "gzip", "snappy", "lz4", "zstd")
EVENTS = ("click", "view", "purchase", "login", "logout")


def make_records(n: int) -> list[tuple[bytes, bytes]]:
    """N (key, value) pairs: JSON events that compress about as real ones do."""
    rng = random.Random(42)
    records = []
    for i in range(n):
        user = f"user-{rng.randrange(1000):04d}"
        value = json.dumps({"id": i, "user": user, "event": rng.choice(EVENTS), "ts": 1_700_000_000_000 + i * 7,
                            "session": rng.randbytes(16).hex(), "page": f"/shop/item/{rng.randrange(5000)}",
                            "agent": "Mozilla/5.0 (X11; Linux x86_64) AppleWebKit/537.36"})
        records.append((user.encode(), value.encode()))
    return records


def produce(bootstrap: str, topic: str, codec: str, records: list[tuple[bytes, bytes]]) -> float:
    with Producer(bootstrap, compression=codec) as producer:
        start = time.perf_counter()
        for key, value in records:
            producer.send(topic, value=value, key=key, partition=0)
        producer.flush()
        return time.perf_counter() - start


def consume(bootstrap: str, topic: str, records: list[tuple[bytes, bytes]]) -> float:
    with Consumer(bootstrap, max_partition_bytes=8 << 20) as consumer:
        start = time.perf_counter()
        consumer.assign([(topic, 0)])
        got = 0
        while got < len(records):
            for m in consumer.poll(timeout_s=5.0, max_records=10_000):
                if m.value != records[m.offset][1]:
                    raise AssertionError(f"record {m.offset} came back different")
                got += 1
        return time.perf_counter() - start


def stored_bytes(data_dir: str, topic: str) -> int:
    directory = Path(data_dir) / f"{topic}-0"
    return sum(f.stat().st_size for f in directory.glob("*.log"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--records", type=int, default=200_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--fsync", default="always", help='"always" or the most ms between fsyncs')
    parser.add_argument("--codecs", nargs="+", default=list(CODECS), choices=CODECS)
    args = parser.parse_args()
    codecs = ["none"] + [c for c in args.codecs if c != "none"]  # the baseline always runs
    fsync = "always" if args.fsync == "always" else int(args.fsync)
    records = make_records(args.records)
    volume_mb = sum(len(k) + len(v) for k, v in records) / 1e6
    results: dict[str, dict[str, list[float]]] = {c: {"produce": [], "consume": [], "stored": []} for c in codecs}
    with tempfile.TemporaryDirectory(prefix="codec-bench-") as data_dir:
        broker = Broker(data_dir, fsync=fsync).start()
        try:
            produce(broker.bootstrap, f"warmup-{uuid.uuid4().hex[:8]}", "none", records[:1000])  # untimed
            for round_ in range(args.rounds):
                order = codecs[round_ % len(codecs):] + codecs[: round_ % len(codecs)]
                for codec in order:
                    topic = f"bench-{codec}-{uuid.uuid4().hex[:8]}"
                    broker.create_topic(topic, 1)
                    results[codec]["produce"].append(produce(broker.bootstrap, topic, codec, records))
                    results[codec]["consume"].append(consume(broker.bootstrap, topic, records))
                    results[codec]["stored"].append(stored_bytes(data_dir, topic))
                    print(f"round {round_ + 1}: {codec} done", file=sys.stderr)
        finally:
            broker.stop()

    print(f"\n{args.records} records, {volume_mb:.1f} MB uncompressed, fsync {args.fsync}, "
          f"median of {args.rounds} round(s), python {sys.version.split()[0]}, {os.cpu_count()} CPUs\n")
    print(f"{'codec':8} {'produce MB/s':>12} {'krec/s':>8} {'vs none':>8} {'consume MB/s':>13} {'krec/s':>8} "
          f"{'vs none':>8} {'stored MB':>10} {'ratio':>6}")
    base = {k: statistics.median(results["none"][k]) for k in ("produce", "consume")}
    for codec in codecs:
        produce_s, consume_s = (statistics.median(results[codec][k]) for k in ("produce", "consume"))
        stored = statistics.median(results[codec]["stored"])
        print(f"{codec:8} {volume_mb / produce_s:12.1f} {args.records / produce_s / 1e3:8.1f} "
              f"{base['produce'] / produce_s:7.2f}x {volume_mb / consume_s:13.1f} "
              f"{args.records / consume_s / 1e3:8.1f} {base['consume'] / consume_s:7.2f}x "
              f"{stored / 1e6:10.1f} {volume_mb * 1e6 / stored:5.1f}x")


if __name__ == "__main__":
    main()
