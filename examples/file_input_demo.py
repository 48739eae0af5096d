"""Exactly-once through a driver crash, with files as input: the first twophase demo, on embedded defaults.

What it shows, end to end on one machine:

1. A private ZooKeeper starts (free port, temp data dir), the built-in log
   broker starts inside this process (free port, data dir in the work dir), and
   N input files of M rows each are written; every file becomes one Spark
   micro-batch.
2. examples/log_sink_query.py streams them through TwoPhaseSink(LogSink) into
   a 3-partition topic, every task attempt in a KIP-939 prepared transaction of
   its own, with 30% of first task attempts failing mid-write (Spark retries
   them; the failed attempts' transactions are aborted).
3. About a third of the way in, the driver is killed with SIGKILL, mid-stream:
   no shutdown hooks, no cleanup, open and prepared transactions left behind.
   The broker lives in this process, so it keeps running.
4. The same command restarts on the same checkpoint and runs to the end.
5. An independent reader, a read_committed confluent-kafka consumer, reads the
   topic and checks that every input row is visible exactly once; a
   read_uncommitted one shows the aborted records really are in the log.

Run it with ``python -m examples.file_input_demo``;
the work dir (input, checkpoint, broker data, logs) is kept for inspection.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import secrets
import shutil
import subprocess
import sys
import time
import uuid

from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

from coordinator.layout import AppPaths
from coordinator.zk import children, connect, read_epoch
from examples.demo_processes import kill_group, spawn
from examples.file_sink_query import write_input
from examples.log_sink_query import read_topic
from twophase.broker import Broker
from twophase.checkpoint import started_epochs
from twophase.client import Admin
from twophase.verify import count_rows
from twophase.zkserver import ZooKeeperServer

APP, ROOT = "exactly-once-demo", "/twophase-demo"
TOPIC, TOPIC_PARTITIONS = "demo-out", 3


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Parse the demo's command line."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", help="where input, checkpoint, broker data and logs go "
                   "(default ./.demo/<timestamp>)")
    p.add_argument("--batches", type=int, default=12, help="input files = micro-batches (12)")
    p.add_argument("--rows", type=int, default=500, help="rows per batch (500)")
    p.add_argument("--fail-rate", type=float, default=0.3, help="share of failing first attempts")
    p.add_argument("--slow-ms", type=int, default=2, help="delay per row write, in ms")
    p.add_argument("--timeout", type=float, default=600, help="give up on a run after this many s")
    return p.parse_args(argv)


def job_command(args: argparse.Namespace, zk: str, bootstrap: str, work: str) -> list[str]:
    """The command line of the streaming job (``examples.log_sink_query``) the demo runs and kills."""
    return [sys.executable, "-m", "examples.log_sink_query", "--zk", zk, "--root", ROOT,
            "--app", APP, "--bootstrap", bootstrap, "--topic", TOPIC, "--input", f"{work}/input",
            "--checkpoint", f"{work}/checkpoint", "--fail-rate", str(args.fail_rate),
            "--slow-ms", str(args.slow_ms)]


def committed_epoch(zk) -> int:
    """The coordinator's watermark: every epoch <= it is committed (-1: none yet)."""
    app = AppPaths(ROOT, APP)
    return max((read_epoch(zk, app.query(q).watermark) for q in children(zk, app.queries)), default=-1)


def spark_batch(checkpoint: str) -> str:
    """The newest batch in Spark's checkpoint: offsets/N is written before batch N runs."""
    started = started_epochs(checkpoint)
    return str(started[-1]) if started else "-"


class VisibleCount:
    """Records a read_committed consumer has seen so far (progress display only; verify() reads afresh)."""

    def __init__(self, bootstrap: str, topic: str = TOPIC, partitions: int = TOPIC_PARTITIONS) -> None:
        self.consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"demo-{uuid.uuid4().hex}",
                                  "enable.auto.commit": False, "isolation.level": "read_committed",
                                  # librdkafka's own lines (reconnects...) go to logging, not over the display
                                  "logger": logging.getLogger("confluent_kafka")})
        self.consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in range(partitions)])
        self.count = 0

    def poll(self) -> int:
        """Read what is newly visible (read_committed) and return the running count."""
        self.count += sum(1 for m in self.consumer.consume(10_000, timeout=0.05) if m.error() is None)
        return self.count

    def close(self) -> None:
        """Close the consumer."""
        self.consumer.close()


def watch(proc: subprocess.Popen, zk, visible: VisibleCount, args, label: str, t0: float,
          kill_at: int | None) -> bool:
    """Print progress every second until the driver exits, or kill it at watermark kill_at.

    Returns True if it was killed."""
    deadline, last_print = time.monotonic() + args.timeout, 0.0
    while proc.poll() is None:
        epoch = committed_epoch(zk)
        if kill_at is not None and epoch >= kill_at:
            print(f"\n*** {epoch + 1}/{args.batches} batches committed: "
                  "killing the driver with SIGKILL mid-stream ***\n", flush=True)
            kill_group(proc)
            return True
        if time.monotonic() - last_print >= 1.0:
            last_print = time.monotonic()
            print(f"[{last_print - t0:6.1f}s] {label}: spark batch "
                  f"{spark_batch(args.workdir + '/checkpoint'):>2}, watermark epoch {epoch:3d} "
                  f"({epoch + 1}/{args.batches} committed), "
                  f"{visible.poll():6d} rows visible", flush=True)
        if time.monotonic() > deadline:
            raise SystemExit(f"{label} did not finish within {args.timeout}s; see {args.workdir}")
        time.sleep(0.1)
    return False


def open_transactions(bootstrap: str) -> list[str]:
    """Transactions still open on the broker (ListTransactions): none may be left behind."""
    with Admin(bootstrap) as admin:
        return sorted(t.transactional_id for t in admin.list_transactions(states=["Ongoing"]))


def verify(args: argparse.Namespace, bootstrap: str) -> bool:
    """Check the topic with an independent reader: True if every row is there once and no transaction is open."""
    expected = range(args.batches * args.rows)
    committed = read_topic(bootstrap, TOPIC)
    report = count_rows(expected, (json.loads(m.value())["id"] for m in committed))
    in_log = len(read_topic(bootstrap, TOPIC, isolation="read_uncommitted"))
    still_open = open_transactions(bootstrap)
    print("\n=== independent reader (confluent-kafka, isolation.level=read_committed) ===")
    print(f"records in the log (read_uncommitted): {in_log}, of which aborted "
          f"(failed and killed attempts): {in_log - len(committed)}")
    print(f"transactions still open on the broker: {len(still_open)}", *still_open[:5])
    print(report)
    return report.exact and not still_open


def run_demo(args: argparse.Namespace, zk_hosts: str, zk, bootstrap: str, t0: float) -> bool:
    """Run the job twice on one checkpoint, then verify; True if both the second run and the check pass."""
    cmd, work = job_command(args, zk_hosts, bootstrap, args.workdir), args.workdir
    print("job:", " ".join(cmd[1:]), "\n")
    visible = VisibleCount(bootstrap)
    try:
        ok = run_twice(cmd, work, zk, visible, args, t0)
    finally:
        visible.close()
    return ok and verify(args, bootstrap)


def run_twice(cmd: list[str], work: str, zk, visible: VisibleCount, args: argparse.Namespace, t0: float) -> bool:
    """Run the job, SIGKILL it once a third of the batches are committed, rerun it to the end; True if that exits 0."""
    first = spawn(cmd, f"{work}/driver-run1.log", scratch=f"{work}/scratch")
    try:
        if not watch(first, zk, visible, args, "run 1", t0, kill_at=max(args.batches // 3 - 1, 0)):
            print(f"warning: run 1 exited ({first.returncode}) before the kill point; "
                  "try more --batches or --rows")
    finally:
        kill_group(first)
    print("restarting the same command on the same checkpoint\n")
    second = spawn(cmd, f"{work}/driver-run2.log", scratch=f"{work}/scratch")
    try:
        watch(second, zk, visible, args, "run 2", t0, kill_at=None)
    finally:
        kill_group(second)
    print(f"run 2 exited with {second.returncode} after {time.monotonic() - t0:.1f}s")
    if second.returncode != 0:
        print(f"the restarted job failed; see {work}/driver-run2.log")
    return second.returncode == 0


def main(argv: list[str] | None = None) -> int:
    """Write the input, start ZooKeeper and a broker, run the demo; return 0 on PASS, 1 on FAIL."""
    args = parse_args(argv)
    args.workdir = os.path.abspath(args.workdir or time.strftime("./.demo/%Y%m%d-%H%M%S"))
    os.makedirs(args.workdir, exist_ok=True)
    # Signs what the coordinator stores in ZooKeeper; both runs inherit it.
    os.environ.setdefault("TWOPHASE_SECRET", secrets.token_hex(32))
    t0 = time.monotonic()
    for b in range(args.batches):
        write_input(f"{args.workdir}/input", b, range(b * args.rows, (b + 1) * args.rows))
    print(f"work dir {args.workdir}: {args.batches} batches x {args.rows} rows written")
    server = ZooKeeperServer()
    try:
        server.start()
        print(f"private ZooKeeper on {server.hosts}")
        with Broker(f"{args.workdir}/broker") as broker:
            broker.create_topic(TOPIC, TOPIC_PARTITIONS)
            print(f"built-in broker on {broker.bootstrap}, topic {TOPIC} with {TOPIC_PARTITIONS} partitions")
            zk = connect(server.hosts)
            try:
                ok = run_demo(args, server.hosts, zk, broker.bootstrap, t0)
            finally:
                zk.stop()
                shutil.copy(server.log_path, f"{args.workdir}/zookeeper.log")
    finally:
        server.stop()
    print(f"\n{'PASS' if ok else 'FAIL'} in {time.monotonic() - t0:.1f}s; work dir kept: {args.workdir}")
    print(f"logs: {args.workdir}/driver-run1.log {args.workdir}/driver-run2.log "
          f"{args.workdir}/zookeeper.log")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
