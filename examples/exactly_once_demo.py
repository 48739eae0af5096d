"""The main job, exactly once through chaos: Kafka in, Spark (enrichment + aggregation), Kafka out.

What it runs, on one machine, on embedded defaults:

1. A private ZooKeeper (free port, temp data dir) and the built-in broker as a
   process of its own (``twophase broker``, data dir in the work dir), with an
   input topic ``orders`` and two output topics.
2. An independent confluent-kafka producer writes orders into ``orders`` while
   the job runs: transactions alternately zstd- and lz4-compressed, every third
   one aborted on purpose.
3. The job (examples/kafka_pipeline_query.py) reads ``orders`` with the
   ``twophase-kafka`` source (read_committed) and runs two queries through
   TwoPhaseSink(LogSink): a stateless enrichment into ``orders-enriched`` and
   per-user running totals (groupBy, update mode) into ``user-totals``.
4. Chaos, each fault injected on purpose and reported when it happens:
   first task attempts fail now and then (Spark retries them); the broker is
   killed with kill -9 and restarted on its data dir; ZooKeeper is restarted;
   the driver is SIGKILLed while an epoch is pre-committed but not committed.
5. The producer stops, the job restarts on its checkpoints with
   Trigger.AvailableNow and exits once everything is committed.
6. An independent read_committed confluent-kafka reader checks: every committed
   order enriched exactly once (``lost 0, duplicated 0``), nothing from aborted
   input, each user's last total equal to a batch computation over the
   committed input, no transaction left open. Exit code 0 only then.

Run it with ``scripts/demo.sh`` or ``python -m examples.exactly_once_demo``
(``--plain`` for line output, chosen by itself when stdout is not a terminal);
the work dir (checkpoints, broker data, logs) is kept for inspection.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import secrets
import shutil
import sys
import time
import traceback
from collections import Counter

from kazoo.exceptions import KazooException, NoNodeError

from coordinator.layout import AppPaths, QueryPaths
from coordinator.state import EpochRecord, EpochState
from coordinator.zk import children, connect, read_epoch, read_json
from examples.demo_display import Display, Progress
from examples.demo_processes import (
    BrokerProcess,
    InputProducer,
    await_event,
    kill_group,
    spawn,
)
from examples.file_input_demo import VisibleCount, open_transactions
from examples.kafka_pipeline_query import enrich_order
from examples.log_sink_query import read_topic
from twophase.client import Admin
from twophase.verify import count_rows
from twophase.zkserver import ZooKeeperServer

APP, ROOT = "orders", "/twophase-demo"
INPUT, ENRICHED, TOTALS = "orders", "orders-enriched", "user-totals"
PARTITIONS = 3
log = logging.getLogger("twophase.demo")
QUERIES = {"enrich": f"{APP}-enrich", "totals": f"{APP}-totals"}   # query label -> twophase app


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Parse the demo's command line."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", help="checkpoints, broker data and logs (default ./.demo/<timestamp>)")
    p.add_argument("--plain", action="store_true", help="line output (the default when stdout is not a TTY)")
    p.add_argument("--rate", type=float, default=100, help="input orders per second (100)")
    p.add_argument("--users", type=int, default=12, help="distinct users, the aggregation's keys (12)")
    p.add_argument("--max-offsets", type=int, default=600, help="maxOffsetsPerTrigger of each query (600)")
    p.add_argument("--epochs-between-faults", type=int, default=2,
                   help="epochs the job must commit after one fault before the next (2)")
    p.add_argument("--fail-rate", type=float, default=0.3, help="share of failing first task attempts (0.3)")
    p.add_argument("--slow-ms", type=int, default=1, help="delay per row written, in ms (1)")
    p.add_argument("--timeout", type=float, default=600, help="give up on any one step after this many s")
    return p.parse_args(argv)


def query_paths(zk, app: str) -> QueryPaths | None:
    """The znodes of the app's one query, once its driver registered it."""
    paths = AppPaths(ROOT, app)
    queries = children(zk, paths.queries)
    return paths.query(queries[0]) if queries else None


def watermark(zk, app: str) -> int:
    """Every epoch <= this is committed (-1: none yet)."""
    qp = query_paths(zk, app)
    return -1 if qp is None else read_epoch(zk, qp.watermark)


def precommitted_uncommitted(zk, app: str) -> tuple[int, list[str], str] | None:
    """(epoch, pre-commits registered, state) of an open epoch past the watermark with a pre-commit, else None."""
    qp = query_paths(zk, app)
    if qp is None:
        return None
    mark = read_epoch(zk, qp.watermark)
    for name in sorted(children(zk, qp.epochs), key=int):
        epoch = int(name)
        if epoch > mark and (attempts := children(zk, qp.attempts(epoch))):
            state = (read_json(zk, qp.epoch(epoch)) or {}).get("state", "open")
            if state == "open":
                return epoch, attempts, state
    return None


class Demo:
    """One run of the demo: its processes, its progress, its faults, its verdict."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args, self.work = args, args.workdir
        self.display = Display(plain=args.plain)
        self.progress = Progress()
        self.zk_server = ZooKeeperServer()
        self.broker = BrokerProcess(f"{self.work}/broker", log_path=f"{self.work}/broker.log")
        self.zk = self.producer = self.driver = self.visible = None
        self.driver_should_run = False
        self.seen_intents: set[str] = set()
        self.task_failures = 0
        self.killed: tuple[int, str] | None = None   # (epoch, run) the driver SIGKILL interrupted
        self.killed_settled: EpochRecord | None = None  # that epoch's record, once committed

    # -- processes ------------------------------------------------------------------------------
    def start(self) -> None:
        """ZooKeeper, broker, topics, the input producer."""
        self.zk_server.start()
        self.zk = connect(self.zk_server.hosts)
        self.display.event(f"private ZooKeeper on {self.zk_server.hosts}")
        self.broker.start()
        with Admin(self.broker.bootstrap) as admin:
            admin.create_topics({INPUT: PARTITIONS, ENRICHED: PARTITIONS, TOTALS: PARTITIONS})
        self.display.event(f"built-in broker (pid {self.broker.proc.pid}) on {self.broker.bootstrap}, "
                           f"topics {INPUT}, {ENRICHED}, {TOTALS} with {PARTITIONS} partitions each")
        self.visible = VisibleCount(self.broker.bootstrap, ENRICHED, PARTITIONS)
        self.producer = InputProducer(self.broker.bootstrap, INPUT, users=self.args.users, rate=self.args.rate)
        self.producer.start()
        self.display.event(f"input producer (confluent-kafka, zstd/lz4, every 3rd transaction aborted) "
                           f"writing ~{self.args.rate:.0f} orders/s")

    def start_driver(self, run: int, trigger: str) -> None:
        """Start the job (examples.kafka_pipeline_query) in its own process group.

        A processing-time run must keep running (tick() fails if it exits); an available-now run ends."""
        cmd = [sys.executable, "-m", "examples.kafka_pipeline_query", "--zk", self.zk_server.hosts,
               "--root", ROOT, "--app", APP, "--bootstrap", self.broker.bootstrap,
               "--checkpoint", f"{self.work}/checkpoint", "--input-topic", INPUT,
               "--enriched-topic", ENRICHED, "--totals-topic", TOTALS, "--trigger", trigger,
               "--max-offsets", str(self.args.max_offsets), "--fail-rate", str(self.args.fail_rate),
               "--slow-ms", str(self.args.slow_ms)]
        self.driver = spawn(cmd, f"{self.work}/driver-run{run}.log", scratch=f"{self.work}/scratch")
        self.driver_should_run = trigger != "available-now"
        self.progress.driver = f"run {run} (pid {self.driver.pid}, trigger {trigger})"
        self.display.event(f"driver run {run} started: pid {self.driver.pid}, trigger {trigger}")

    def stop_all(self) -> None:
        """Stop every process the demo started, whatever state it is in; one failing stop skips no other."""
        steps = [lambda: kill_group(self.driver), self.producer and self.producer.stop,
                 self.visible and self.visible.close, self.broker.stop,
                 self.zk and self.zk.stop, self.zk and self.zk.close,
                 lambda: self.zk_server.log_path.exists() and shutil.copy(self.zk_server.log_path,
                                                                          f"{self.work}/zookeeper.log"),
                 self.zk_server.stop]
        for step in filter(None, steps):
            try:
                step()
            except Exception:
                log.exception("stopping the demo's processes")

    # -- progress -------------------------------------------------------------------------------
    def tick(self) -> None:
        """Refresh the progress, report injected task failures seen, fail fast if something died."""
        if self.producer.error is not None:
            raise RuntimeError(f"the input producer failed: {self.producer.error!r}")
        if self.driver_should_run and self.driver.poll() is not None:
            raise RuntimeError(f"the driver exited with {self.driver.returncode} unasked; see "
                               f"{self.progress.driver.split()[0]} log in {self.work}")
        self.progress.rows_in = len(self.producer.produced.committed)
        self.progress.rows_aborted = len(self.producer.produced.aborted)
        self.progress.rows_committed = self.visible.poll()
        try:
            for label, app in QUERIES.items():
                self.progress.epochs[label] = watermark(self.zk, app)
                self.report_task_failures(label, app)
        except KazooException:
            pass  # ZooKeeper is restarting: keep the last values
        self.display.update(self.progress)

    def report_task_failures(self, label: str, app: str) -> None:
        """Report every retry of a task attempt (an intent of attempt > 0): the injected failures."""
        qp = query_paths(self.zk, app)
        if qp is None:
            return
        mark = self.progress.epochs[label]
        for name in children(self.zk, qp.epochs):
            if int(name) < mark - 1:
                continue
            for intent in children(self.zk, qp.intents(int(name))):
                run, epoch, partition, attempt = intent.rsplit(".", 3)
                if int(attempt) > 0 and intent not in self.seen_intents:
                    self.seen_intents.add(intent)
                    self.task_failures += 1
                    self.display.event(f"task failure: {label} epoch {epoch} partition {partition}: first "
                                       f"attempt failed mid-write (injected), Spark runs attempt {attempt}")

    def wait(self, what: str, predicate) -> None:
        """Tick until predicate() holds."""
        await_event(what, lambda: (self.tick(), predicate())[1], self.args.timeout, poll_s=0.25)

    def await_epochs(self, more: int) -> None:
        """Until the enrichment query has committed ``more`` epochs past its watermark now."""
        target = self.progress.epochs.get("enrich", -1) + more
        self.wait(f"enrich epoch {target} committed", lambda: self.progress.epochs["enrich"] >= target)

    # -- the faults -----------------------------------------------------------------------------
    def kill_broker(self) -> None:
        """kill -9 of the broker between two input transactions, restart on the same data dir and port."""
        self.progress.fault = "broker: kill -9"
        self.producer.pause()
        self.display.event(f"FAULT kill -9 of the broker (pid {self.broker.proc.pid}) mid-stream "
                           "(input producer parked between two transactions)")
        self.broker.kill()
        self.tick()
        self.broker.start()
        self.producer.resume()
        self.display.event(f"broker restarted on {self.broker.bootstrap} (pid {self.broker.proc.pid}), same data dir")
        self.progress.fault = "none (after broker restart)"

    def restart_zookeeper(self) -> None:
        """A ZooKeeper restart (same port, data kept) under the running driver."""
        self.progress.fault = "ZooKeeper restart"
        self.display.event(f"FAULT ZooKeeper restart (pid {self.zk_server.pid})")
        self.zk_server.restart()
        self.display.event(f"ZooKeeper back (pid {self.zk_server.pid})")
        self.progress.fault = "none (after ZooKeeper restart)"

    def kill_driver_between_precommit_and_commit(self) -> None:
        """SIGKILL the driver once an enrichment epoch has pre-commits registered and is not committed."""
        self.progress.fault = "driver SIGKILL armed: waiting for a pre-committed epoch"
        self.tick()
        found = None

        def landed() -> bool:
            nonlocal found
            found = precommitted_uncommitted(self.zk, QUERIES["enrich"])
            return found is not None

        await_event("an epoch pre-committed and not committed", landed, self.args.timeout,
                    still_possible=lambda: self.driver.poll() is None, poll_s=0.01)
        epoch, attempts, state = found
        self.driver_should_run = False
        kill_group(self.driver)
        self.killed = (epoch, attempts[0].rsplit(".", 3)[0])
        qp = query_paths(self.zk, QUERIES["enrich"])
        after = (read_json(self.zk, qp.epoch(epoch)) or {}).get("state", "open")
        self.display.event(f"FAULT SIGKILL of the driver (pid {self.driver.pid}): enrich epoch {epoch} had "
                           f"{len(attempts)} pre-commit(s) registered, state {state}; after the kill: state {after}, "
                           f"{len(children(self.zk, qp.attempts(epoch)))} pre-commit(s) left for the restart")
        self.progress.fault = "driver dead (SIGKILL)"
        self.progress.driver = "dead"

    # -- the run --------------------------------------------------------------------------------
    def run(self) -> bool:
        """Start everything, inject the faults, run to the end, verify; True on exactly once."""
        self.start()
        self.start_driver(1, "1 second")
        self.wait("both queries to commit an epoch",
                  lambda: self.progress.epochs.get("enrich", -1) >= 0 and self.progress.epochs.get("totals", -1) >= 0)
        self.await_epochs(self.args.epochs_between_faults - 1)
        self.kill_broker()
        self.await_epochs(self.args.epochs_between_faults)
        self.restart_zookeeper()
        self.await_epochs(self.args.epochs_between_faults)
        self.kill_driver_between_precommit_and_commit()
        self.producer.stop()
        self.display.event(f"input producer stopped: {self.producer.produced.summary()}")
        self.progress.fault = "none"
        self.start_driver(2, "available-now")
        self.wait("driver run 2 to finish", lambda: (self.keep_killed_epoch(), self.driver.poll() is not None)[1])
        if self.driver.returncode != 0:
            self.display.event(f"driver run 2 failed with exit code {self.driver.returncode}; "
                               f"see {self.work}/driver-run2.log")
            return False
        self.display.event("driver run 2 finished: every epoch of both queries committed")
        self.report_killed_epoch()
        self.progress.driver = "done"
        self.tick()
        return self.verify()

    def keep_killed_epoch(self) -> None:
        """Keep the interrupted epoch's record once it is committed: the coordinator drops committed records past
        its retain_epochs (10), which a long second run reaches."""
        if self.killed_settled is None:
            try:
                raw, _ = self.zk.get(query_paths(self.zk, QUERIES["enrich"]).epoch(self.killed[0]))
            except NoNodeError:
                return
            record = EpochRecord.decode(raw)
            if record.state is EpochState.COMMITTED:
                self.killed_settled = record

    def report_killed_epoch(self) -> None:
        """Say how the epoch the driver SIGKILL interrupted was settled: which run's transactions were committed."""
        epoch, killed_run = self.killed
        self.keep_killed_epoch()
        record = self.killed_settled
        if record is None:  # committed and dropped between two looks (run 2 committed 10 more epochs in 0.25 s)
            self.display.event(f"the interrupted enrich epoch {epoch} is committed (its record already dropped)")
            return
        source = ("the killed run's pre-commits, recovered" if record.run == killed_run
                  else "the restarted run's re-run; the killed run's pre-commits were aborted")
        self.display.event(f"the interrupted enrich epoch {epoch} is {record.state.value}: committed from {source}")

    def verify(self) -> bool:
        """The independent read_committed check of the output topics; True if all of it holds."""
        return verify(self.broker.bootstrap, self.producer, self.task_failures, self.display)


def verify(bootstrap: str, producer: InputProducer, task_failures: int, display: Display) -> bool:
    """Read input and output with fresh read_committed consumers; print the verdict; True if exactly once."""
    produced = producer.produced
    orders = {o["id"]: o for o in (json.loads(m.value()) for m in read_topic(bootstrap, INPUT))}
    aborted = set(produced.aborted)
    enriched = [json.loads(m.value()) for m in read_topic(bootstrap, ENRICHED)]
    report = count_rows(orders, (e["id"] for e in enriched))
    wrong = sum(1 for e in enriched if e["id"] in orders and
                {k: e[k] for k in ("amount_cents", "size", "region")} != enrich_order(orders[e["id"]]))
    from_aborted = sum(1 for e in enriched if e["id"] in aborted)

    expected_totals: dict[str, dict] = {}
    for o in orders.values():
        t = expected_totals.setdefault(o["user"], {"orders": 0, "total_cents": 0})
        t["orders"] += 1
        t["total_cents"] += enrich_order(o)["amount_cents"]
    updates = [(dict(m.headers())["twophase.epoch"].decode(), json.loads(m.value()))
               for m in read_topic(bootstrap, TOTALS)]
    latest: dict[str, tuple[int, dict]] = {}
    for epoch, t in updates:
        if t["user"] not in latest or int(epoch) > latest[t["user"]][0]:
            latest[t["user"]] = (int(epoch), t)
    final = {u: {"orders": t["orders"], "total_cents": t["total_cents"]} for u, (_, t) in latest.items()}
    duplicated_updates = sum(n - 1 for n in Counter((t["user"], e) for e, t in updates).values())
    totals_ok = final == expected_totals and duplicated_updates == 0
    input_ok = set(orders) == set(produced.committed) and not aborted & set(orders)
    still_open = open_transactions(bootstrap)

    print("\n=== independent reader (confluent-kafka, isolation.level=read_committed) ===", flush=True)
    print(f"input {INPUT}: {len(orders)} orders visible; the producer {produced.summary()}: "
          f"{'match' if input_ok else 'MISMATCH'}")
    print(f"injected task failures seen: {task_failures}")
    print(f"enriched ({ENRICHED}): {report}")
    print(f"enriched rows from aborted input: {from_aborted}; rows with wrong derived fields: {wrong}")
    print(f"aggregate ({TOTALS}): {len(updates)} updates for {len(final)} users, duplicated {duplicated_updates}; "
          f"final totals {'equal' if final == expected_totals else 'DIFFER FROM'} the batch computation "
          f"over the committed input ({sum(t['orders'] for t in expected_totals.values())} orders)")
    print(f"transactions still open on the broker: {len(still_open)}", *still_open[:5])
    ok = report.exact and input_ok and from_aborted == 0 and wrong == 0 and totals_ok and not still_open
    print(f"lost {report.lost}, duplicated {report.duplicated}; aggregate {'exact' if totals_ok else 'WRONG'}")
    return ok


def main(argv: list[str] | None = None) -> int:
    """Run the demo; return 0 only if the independent check passes."""
    args = parse_args(argv)
    args.plain = args.plain or not sys.stdout.isatty()
    args.workdir = os.path.abspath(args.workdir or time.strftime("./.demo/%Y%m%d-%H%M%S"))
    os.makedirs(args.workdir, exist_ok=True)
    # Library logs (kazoo reconnecting during the ZooKeeper restart, ...) go to a file, not over the display.
    logging.basicConfig(filename=f"{args.workdir}/demo.log", level=logging.INFO,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    # Signs what the coordinator stores in ZooKeeper; both driver runs inherit it.
    os.environ.setdefault("TWOPHASE_SECRET", secrets.token_hex(32))
    t0 = time.monotonic()
    demo = Demo(args)
    ok = False
    try:
        with demo.display:
            ok = demo.run()
    except Exception:
        traceback.print_exc()
        print(f"the demo failed; logs in {args.workdir}", flush=True)
    finally:
        demo.stop_all()
    print(f"\n{'PASS' if ok else 'FAIL'} in {time.monotonic() - t0:.1f}s; work dir kept: {args.workdir} "
          f"(demo.log, driver-run1.log, driver-run2.log, broker.log, zookeeper.log)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
