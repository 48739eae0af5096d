#!/usr/bin/env python
"""Phase-two latency and ZooKeeper cost per epoch, for 1..512 partitions per epoch.

Run (from the repo root)::

    source scripts/env.sh
    python bench/commit_latency.py                      # sizes 1 8 64 512, 5 epochs each
    python bench/commit_latency.py --sizes 64 --epochs 20

For each size it starts nothing but a private ZooKeeper (``ZooKeeperServer``) and a
``FileSink`` in a temp dir, and for every epoch:

1. *task side*: for each partition, what ``TwoPhaseSink`` does in a Spark task:
   ``PrecommitRegistry.winner`` and ``intend`` (``open()``), ``begin_transaction``,
   10 ``write``s, ``pre_commit``, ``PrecommitRegistry.register``;
2. *GC pass*: one ``AppCoordinator.reconcile()`` before the barrier. The embedded
   coordinator does this when its ChildrenWatch sees the new epoch node; it
   garbage-collects the epoch that falls out of ``retain_epochs`` and finds the new
   epoch incomplete. Off the barrier path, so not in the latency;
3. *barrier -> committed*: the clock starts, the driver writes
   ``<query>/barrier = {"epoch": N, "run": R}``, ``reconcile()`` runs phase two, the
   clock stops when it returns; the watermark must then be N.

ZooKeeper operations are counted on the server: ``zk_packets_received`` from
``mntr`` before and after each step. A ``mntr`` probe itself counts as one received
packet (checked at start-up and subtracted), and so does the driver's barrier write
(subtracted: it is neither side). Every client also counts the requests it queues
(``KazooClient._call``), which gives a per-operation breakdown and a cross-check of
the server numbers (the server additionally sees pings, which are rare here).

The baseline in the same run is the sink's own work on the barrier path (the
``FileSink.commit`` calls: rename + directory fsync per partition, timed inside the
coordinator) and the ZooKeeper round trip measured up front; the rest of the
barrier->committed time is coordinator overhead. Warm-up epochs (default
``retain_epochs + 1``) make every measured epoch pay steady-state GC.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("TWOPHASE_SECRET", "twophase-bench-secret-0123456789")

from kazoo.client import KazooClient  # noqa: E402

from coordinator.app import AppCoordinator, CommitPolicy  # noqa: E402
from coordinator.layout import AppPaths  # noqa: E402
from coordinator.precommits import PrecommitRegistry  # noqa: E402
from coordinator.runs import RunRecord  # noqa: E402
from coordinator.zk import dump, read_json  # noqa: E402
from sinks.files import FileSink, read_committed_rows  # noqa: E402
from twophase.signing import Signer, load_secret  # noqa: E402
from twophase.sink import TxnContext  # noqa: E402
from twophase.task import TaskAttempt  # noqa: E402
from twophase.zkserver import ZooKeeperServer  # noqa: E402

_PACKETS = re.compile(r"^zk_packets_received\s+(\d+)", re.M)


# -- counting -------------------------------------------------------------------


class Packets:
    """The server's zk_packets_received, with the cost of the probe itself removed."""

    def __init__(self, server: ZooKeeperServer) -> None:
        self.server = server
        self.probe_cost = 0
        a, b, c = self._read(), self._read(), self._read()
        self.probe_cost = round(((b - a) + (c - b)) / 2)

    def _read(self) -> int:
        return int(_PACKETS.search(self.server.command("mntr")).group(1))

    def read(self) -> int:
        return self._read()

    def delta(self, before: int, after: int, extra: int = 0) -> int:
        """Packets between two reads, minus the second probe and `extra` known foreign ops."""
        return after - before - self.probe_cost - extra


class CountingClient:
    """A started KazooClient that counts every request it queues, by request type."""

    def __init__(self, hosts: str) -> None:
        # A long session timeout keeps kazoo's idle pings (every ~timeout/3) out of the counts.
        self.client = KazooClient(hosts=hosts, timeout=60.0)
        self.client.start(timeout=15)
        self.ops: Counter[str] = Counter()
        original = self.client._call

        def counted(request, async_object):
            self.ops[type(request).__name__] += 1
            return original(request, async_object)

        self.client._call = counted

    def snapshot(self) -> Counter[str]:
        return Counter(self.ops)

    def close(self) -> None:
        self.client.stop()
        self.client.close()


def since(client: CountingClient, before: Counter[str]) -> Counter[str]:
    return client.ops - before


def fmt_ops(ops: Counter[str], epochs: int) -> str:
    names = {"GetData": "get", "GetChildren": "children", "GetChildren2": "children", "Exists": "exists",
             "Transaction": "multi", "Create": "create", "Create2": "create", "Delete": "delete",
             "SetData": "set"}
    merged: Counter[str] = Counter()
    for k, v in ops.items():
        merged[names.get(k, k)] += v
    return " ".join(f"{k}={v / epochs:g}" for k, v in sorted(merged.items(), key=lambda kv: -kv[1]))


# -- one size ---------------------------------------------------------------------


class TimedSink:
    """Wraps the coordinator's (unpickled) sink instance so its commit calls are timed."""

    def __init__(self, sink) -> None:
        self.seconds = 0.0
        original = sink.commit

        def commit(handle):
            t = time.perf_counter()
            try:
                return original(handle)
            finally:
                self.seconds += time.perf_counter() - t

        sink.commit = commit  # instance attribute: what coordinator.sink().commit resolves to


def zk_round_trips(client: KazooClient, root: str, n: int = 200) -> tuple[float, float]:
    """Median ms of a synchronous read and of a synchronous write (fsynced by ZooKeeper)."""
    path = f"{root}/rtt"
    client.ensure_path(path)
    reads, writes = [], []
    for i in range(n):
        t = time.perf_counter()
        client.get(path)
        reads.append(time.perf_counter() - t)
        t = time.perf_counter()
        client.set(path, str(i).encode())
        writes.append(time.perf_counter() - t)
    client.delete(path)
    return statistics.median(reads) * 1e3, statistics.median(writes) * 1e3


def bench_size(server: ZooKeeperServer, packets: Packets, workdir: Path, partitions: int, epochs: int,
               warmup: int, rows: int, policy: CommitPolicy, gc_pass: bool) -> dict:
    root = f"/bench-{uuid.uuid4().hex[:8]}"
    app = f"latency-p{partitions}"
    query_id = str(uuid.uuid4())
    run_id = str(uuid.uuid4())
    out = workdir / app
    signer = Signer(load_secret())
    paths = AppPaths(root, app)
    qp = paths.query(query_id)

    driver = CountingClient(server.hosts)       # the driver hook: sink, query node, barrier
    tasks = CountingClient(server.hosts)        # the executors' shared client
    coord = CountingClient(server.hosts)        # the embedded coordinator's client
    d = driver.client
    d.ensure_path(paths.sink)
    d.set(paths.base, dump({"coordinator": "embedded"}))
    d.set(paths.sink, signer.dumps(FileSink(str(out)), paths.sink))
    d.ensure_path(qp.barrier)
    d.ensure_path(qp.run(run_id))
    d.set(qp.run(run_id), RunRecord(time.time(), "bench", in_order=True).encode())

    coordinator = AppCoordinator(coord.client, root, app, signer, owner="bench", policy=policy)
    coordinator.acquire()
    registry = PrecommitRegistry(tasks.client, qp, signer)
    task_sink = FileSink(str(out))
    timed_sink: TimedSink | None = None

    results = []
    for epoch in range(warmup + epochs):
        measured = epoch >= warmup
        if measured and timed_sink is None:
            timed_sink = TimedSink(coordinator.sink())  # loaded and cached by the warm-up epochs
        # 1. the epoch's tasks, one after the other
        ops0 = tasks.snapshot()
        p0 = packets.read()
        lookups = 0
        t_tasks = time.perf_counter()
        for partition in range(partitions):
            ctx = TxnContext(app, query_id, run_id, epoch, partition, attempt=0)
            attempt = TaskAttempt(task_sink, registry, ctx)
            before = tasks.snapshot()
            assert attempt.open(), "no earlier attempt can have won"
            lookups += sum(since(tasks, before).values())
            for i in range(rows):
                attempt.write({"id": (epoch * partitions + partition) * rows + i, "epoch": epoch,
                               "partition": partition, "payload": f"row-{i}"})
            attempt.close(None)
            assert attempt.won, "a single attempt must win its partition"
        t_tasks = time.perf_counter() - t_tasks
        p1 = packets.read()
        task_ops = since(tasks, ops0)

        # 2. the reconcile the new epoch node triggers (GC of epoch N - retain - 1)
        ops1 = coord.snapshot()
        if gc_pass:
            coordinator.reconcile()
        p2 = packets.read()
        gc_ops = since(coord, ops1)

        # 3. barrier -> committed
        ops2 = coord.snapshot()
        sink_before = timed_sink.seconds if timed_sink else 0.0
        t0 = time.perf_counter()
        d.set(qp.barrier, dump({"epoch": epoch, "run": run_id}))
        coordinator.reconcile()
        latency = time.perf_counter() - t0
        p3 = packets.read()
        phase2_ops = since(coord, ops2)
        watermark = read_json(d, qp.watermark, {"epoch": -1})["epoch"]
        if watermark != epoch:
            raise RuntimeError(f"{partitions} partitions, epoch {epoch}: watermark {watermark} after reconcile")
        if measured:
            results.append({
                "latency_ms": latency * 1e3,
                "sink_ms": ((timed_sink.seconds - sink_before) if timed_sink else 0.0) * 1e3,
                "task_ms": t_tasks * 1e3,
                "task_ops": packets.delta(p0, p1),
                "lookup_ops": lookups,
                "gc_ops": packets.delta(p1, p2),
                "phase2_ops": packets.delta(p2, p3, extra=1),   # minus the driver's barrier write
                "client_task": task_ops, "client_gc": gc_ops, "client_phase2": phase2_ops,
            })

    committed = read_committed_rows(str(out))
    expected = (warmup + epochs) * partitions * rows
    if len(committed) != expected or len({r["id"] for r in committed}) != expected:
        raise RuntimeError(f"{partitions} partitions: {len(committed)} committed rows, expected {expected}")
    for c in (driver, tasks, coord):
        c.close()
    return summarize(partitions, results)


def summarize(partitions: int, results: list[dict]) -> dict:
    n = len(results)
    lat = [r["latency_ms"] for r in results]

    def mean(key: str) -> float:
        return sum(r[key] for r in results) / n

    def client_total(key: str) -> Counter[str]:
        total: Counter[str] = Counter()
        for r in results:
            total += r[key]
        return total

    client = {k: client_total(k) for k in ("client_task", "client_gc", "client_phase2")}
    return {
        "partitions": partitions,
        "epochs": n,
        "latency_median": statistics.median(lat),
        "latency_max": max(lat),
        "sink_median": statistics.median(r["sink_ms"] for r in results),
        "task_ms": mean("task_ms"),
        "task_ops": mean("task_ops"),
        "lookup_ops": mean("lookup_ops"),
        "gc_ops": mean("gc_ops"),
        "phase2_ops": mean("phase2_ops"),
        "client": client,
        "client_sums": {k: sum(v.values()) / n for k, v in client.items()},
    }


# -- report -----------------------------------------------------------------------


def print_table(rows: list[dict], rtt: tuple[float, float], probe_cost: int) -> None:
    print()
    print(f"ZooKeeper round trip (baseline): read {rtt[0]:.3f} ms, write {rtt[1]:.3f} ms (median); "
          f"one mntr probe = {probe_cost} received packet(s), subtracted")
    print()
    head = ("partitions", "barrier->committed ms", "of which sink", "coord overhead",
            "ZK ops task/epoch", "ZK ops coordinator/epoch", "ops/partition")
    sub = ("", "median     max", "commit ms", "ms/partition",
           "open+register", "GC + phase two = total", "task  coord  all")
    widths = (10, 22, 13, 14, 17, 26, 18)

    def line(cells):
        print("  ".join(str(c).rjust(w) for c, w in zip(cells, widths)))

    line(head)
    line(sub)
    print("  ".join("-" * w for w in widths))
    for r in rows:
        p = r["partitions"]
        task = r["task_ops"]
        coord = r["gc_ops"] + r["phase2_ops"]
        overhead = (r["latency_median"] - r["sink_median"]) / p
        line((
            p,
            f"{r['latency_median']:8.1f} {r['latency_max']:8.1f}",
            f"{r['sink_median']:.1f}",
            f"{overhead:.3f}",
            f"{r['lookup_ops']:g}+{task - r['lookup_ops']:g}={task:g}",
            f"{r['gc_ops']:g} + {r['phase2_ops']:g} = {coord:g}",
            f"{task / p:4.2f} {coord / p:6.2f} {(task + coord) / p:5.2f}",
        ))
    print()
    print("Per-epoch breakdown by request type (client-side counts; the server saw the same "
          "number unless noted):")
    for r in rows:
        n = r["epochs"]
        notes = []
        for side, server in (("client_task", r["task_ops"]), ("client_gc", r["gc_ops"]),
                             ("client_phase2", r["phase2_ops"])):
            if abs(r["client_sums"][side] - server) > 0.5:
                notes.append(f"{side[7:]}: server {server:g} vs client {r['client_sums'][side]:g}")
        print(f"  {r['partitions']:>4} partitions  task:      {fmt_ops(r['client']['client_task'], n)}")
        print(f"                   GC pass:   {fmt_ops(r['client']['client_gc'], n)}")
        print(f"                   phase two: {fmt_ops(r['client']['client_phase2'], n)}")
        print(f"                   task side wall time {r['task_ms']:.1f} ms/epoch "
              f"({r['task_ms'] / r['partitions']:.2f} ms/partition, sequential)"
              + (f"; MISMATCH {'; '.join(notes)}" if notes else ""))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 8, 64, 512])
    parser.add_argument("--epochs", type=int, default=5, help="measured epochs per size")
    parser.add_argument("--warmup", type=int, default=None,
                        help="unmeasured epochs first (default retain_epochs + 1: steady-state GC)")
    parser.add_argument("--rows", type=int, default=10, help="rows per partition")
    parser.add_argument("--retain-epochs", type=int, default=CommitPolicy().retain_epochs)
    parser.add_argument("--no-gc-pass", action="store_true",
                        help="skip the pre-barrier reconcile, so GC lands on the barrier path")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    policy = CommitPolicy(retain_epochs=args.retain_epochs)
    warmup = args.retain_epochs + 1 if args.warmup is None else args.warmup

    with ZooKeeperServer() as server, tempfile.TemporaryDirectory(prefix="twophase-bench-") as tmp:
        packets = Packets(server)
        probe = KazooClient(hosts=server.hosts, timeout=60.0)
        probe.start(timeout=15)
        rtt = zk_round_trips(probe, "/bench-rtt")
        probe.stop()
        probe.close()
        rows = []
        for size in args.sizes:
            t = time.perf_counter()
            rows.append(bench_size(server, packets, Path(tmp), size, args.epochs, warmup, args.rows,
                                   policy, gc_pass=not args.no_gc_pass))
            print(f"{size:>4} partitions: {warmup} warm-up + {args.epochs} measured epochs "
                  f"in {time.perf_counter() - t:.1f} s", file=sys.stderr, flush=True)
        sys.stderr.flush()
        print_table(rows, rtt, packets.probe_cost)
    if args.json:
        for r in rows:
            r["client"] = {k: dict(v) for k, v in r["client"].items()}
        Path(args.json).write_text(json.dumps({"rtt_ms": rtt, "sizes": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
