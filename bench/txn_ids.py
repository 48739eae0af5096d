#!/usr/bin/env python
"""Transactional ids left on the broker by LogSink: one per task attempt vs one per slot.

Run (from the repo root)::

    source scripts/env.sh
    python bench/txn_ids.py                              # 1000 epochs x 8 partitions, both ways
    python bench/txn_ids.py --epochs 200 --modes per-attempt

It starts a private ZooKeeper and the built-in broker (``twophase broker``, a process of its own) in
a temp dir and, per mode, drives an app through ``tests/harness.py`` (``TaskAttempt``, the code a
Spark task runs, and ``AppCoordinator``, no Spark): every epoch, one task attempt per partition
writes ``--rows`` rows through ``LogSink`` and pre-commits; the driver's barrier is set and one
reconcile pass commits the epoch. Then ``ListTransactions`` (``twophase.client.Admin``) counts the
transactional ids the broker holds, and a read_committed consumer checks every row is there once.

- ``per-attempt``: the ids before slots, ``<prefix>.<app>.<query>.<run>.<epoch>.<partition>.<attempt>``
  (the sink is handed the context without its slot, as a sink driven without a registry is);
- ``pooled``: ``<prefix>.<app>.<query>.<partition>.<slot>``, slots reused once the holder is
  finished and ``slot_release_lag`` (1) epochs below the watermark.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import uuid
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("TWOPHASE_SECRET", "twophase-bench-secret-0123456789")

from kazoo.client import KazooClient  # noqa: E402

from examples.demo_processes import BrokerProcess  # noqa: E402
from examples.log_sink_query import read_topic  # noqa: E402
from sinks.log import LogSink  # noqa: E402
from tests.harness import Pipeline  # noqa: E402
from twophase.client import Admin  # noqa: E402
from twophase.sink import TxnContext  # noqa: E402
from twophase.zkserver import ZooKeeperServer  # noqa: E402


class PerAttemptLogSink(LogSink):
    """LogSink as it was before slots: every attempt gets a transactional id of its own."""

    def begin_transaction(self, ctx: TxnContext):
        return super().begin_transaction(replace(ctx, slot=None))

    def abort_unregistered(self, ctx: TxnContext) -> None:
        super().abort_unregistered(replace(ctx, slot=None))


def run(mode: str, zk: KazooClient, bootstrap: str, epochs: int, partitions: int, rows: int) -> dict:
    topic = f"txn-ids-{mode}-{uuid.uuid4().hex[:6]}"
    with Admin(bootstrap) as admin:
        admin.create_topics({topic: partitions})
        before = len(admin.list_transactions())
    sink_class = PerAttemptLogSink if mode == "per-attempt" else LogSink
    sink = sink_class(bootstrap, topic, key="id", transactional_id_prefix=mode)
    pipe = Pipeline(zk, f"/bench-{mode}", sink)
    app = pipe.coordinator()
    started = time.monotonic()
    next_id = 0
    for epoch in range(epochs):
        for p in range(partitions):
            assert pipe.task("r1", epoch, p, range(next_id, next_id + rows))
            next_id += rows
        pipe.barrier(epoch, "r1")
        report = app.reconcile()
        assert report.ok and pipe.watermark() == epoch, report
        if (epoch + 1) % 100 == 0:
            print(f"  {mode}: {epoch + 1} epochs, {time.monotonic() - started:.0f} s", file=sys.stderr)
    elapsed = time.monotonic() - started
    with Admin(bootstrap) as admin:
        ids = [t.transactional_id for t in admin.list_transactions() if t.transactional_id.startswith(f"{mode}.")]
        assert len(admin.list_transactions()) - before == len(ids)
    seen = sorted(int(m.key()) for m in read_topic(bootstrap, topic))
    assert seen == list(range(next_id)), "a row is missing or read twice"
    return {"mode": mode, "epochs": epochs, "partitions": partitions, "ids": len(ids), "seconds": elapsed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=1000)
    parser.add_argument("--partitions", type=int, default=8)
    parser.add_argument("--rows", type=int, default=5, help="rows per task")
    parser.add_argument("--modes", nargs="+", default=["per-attempt", "pooled"], choices=["per-attempt", "pooled"])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="txn-ids-") as work:
        zk_server = ZooKeeperServer().start()
        broker = BrokerProcess(os.path.join(work, "broker"), os.path.join(work, "broker.log")).start()
        zk = KazooClient(hosts=zk_server.hosts, timeout=10.0)
        zk.start(timeout=15)
        try:
            results = [run(mode, zk, broker.bootstrap, args.epochs, args.partitions, args.rows) for mode in args.modes]
        finally:
            zk.stop()
            zk.close()
            broker.stop()
            zk_server.stop()
    print(f"{'ids':<12} {'epochs x partitions':>20} {'transactional ids on the broker':>32} {'run time':>10} "
          f"{'per epoch':>10}")
    for r in results:
        print(f"{r['mode']:<12} {r['epochs']:>11} x {r['partitions']:<6} {r['ids']:>32} {r['seconds']:>9.0f}s "
              f"{1000 * r['seconds'] / r['epochs']:>8.0f}ms")


if __name__ == "__main__":
    main()
