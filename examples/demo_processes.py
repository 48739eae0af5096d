"""The moving parts of the exactly-once demo: the broker process, the driver process, the input producer.

Usage::

    broker = BrokerProcess(f"{work}/broker", log_path=f"{work}/broker.log").start()
    broker.kill()                    # kill -9, as a lost host would
    broker.start()                   # same port, same data dir
    producer = InputProducer(broker.bootstrap, "orders", rate=200)
    producer.start()
    producer.pause()                 # parked between two transactions
    producer.resume(); producer.stop()
    broker.stop()
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from twophase.zkserver import free_port


def await_event(what: str, happened: Callable[[], bool], timeout: float,
                still_possible: Callable[[], bool] = lambda: True, poll_s: float = 0.05) -> None:
    """Return once ``happened()``; raise TimeoutError after ``timeout`` s, RuntimeError once it cannot happen."""
    deadline = time.monotonic() + timeout
    while not happened():
        if not still_possible():
            raise RuntimeError(f"gave up waiting for {what}: it can no longer happen")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not happen within {timeout:.0f}s")
        time.sleep(poll_s)


def spark_scratch_env(scratch: str) -> dict[str, str]:
    """The environment that puts a Spark driver's scratch files under ``scratch`` instead of /tmp: its local dirs
    (``spark-*``, ``blockmgr-*``), its JVM's temp dir (``artifacts-*``, native codec libraries) and its Python
    workers'. Spark deletes them in a JVM shutdown hook, which a SIGKILLed driver never runs::

        env = {**os.environ, **spark_scratch_env("/tmp/job/scratch")}
    """
    os.makedirs(scratch, exist_ok=True)
    java = f"{os.environ.get('JAVA_TOOL_OPTIONS', '')} -Djava.io.tmpdir={scratch}".strip()
    return {"SPARK_LOCAL_DIRS": scratch, "JAVA_TOOL_OPTIONS": java, "TMPDIR": scratch}


def spawn(cmd: list[str], log_path: str, scratch: str | None = None) -> subprocess.Popen:
    """Start cmd in its own process group (one killpg takes its children, a driver's JVM say), logging to log_path;
    a Spark driver's scratch files go under ``scratch`` (:func:`spark_scratch_env`) if given."""
    env = {**os.environ, **spark_scratch_env(scratch)} if scratch else None
    with open(log_path, "ab") as log:
        return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, env=env)


def kill_group(proc: subprocess.Popen | None) -> None:
    """SIGKILL proc's process group if it still runs, and reap it."""
    if proc is not None and proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


class BrokerProcess:
    """The built-in broker as a process of its own (``twophase broker``), so it can be kill -9'ed and restarted.

    Usage::

        broker = BrokerProcess("/tmp/demo/broker", log_path="/tmp/demo/broker.log").start()
        print(broker.bootstrap); broker.kill(); broker.start(); broker.stop()
    """

    def __init__(self, data_dir: str, log_path: str, port: int = 0) -> None:
        self.data_dir, self.log_path = data_dir, log_path
        self.port = port or free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def bootstrap(self) -> str:
        """host:port of the broker."""
        return f"127.0.0.1:{self.port}"

    def start(self, timeout: float = 60.0) -> BrokerProcess:
        """Start the broker on its data dir and port, and wait until it accepts connections."""
        self.proc = spawn([sys.executable, "-m", "twophase.broker.cli", "--data-dir", self.data_dir,
                           "--port", str(self.port)], self.log_path)
        await_event(f"the broker on {self.bootstrap} to listen", self._listening, timeout,
                    still_possible=lambda: self.proc.poll() is None)
        return self

    def _listening(self) -> bool:
        try:
            socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
            return True
        except OSError:
            return False

    def kill(self) -> None:
        """kill -9: no shutdown, no flush of anything not written yet."""
        kill_group(self.proc)

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM (a clean shutdown), SIGKILL if it takes longer than timeout."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            kill_group(self.proc)


def order(order_id: int, users: int) -> dict:
    """The input record of one order id: a user and an amount, both derived from the id."""
    return {"id": order_id, "user": f"u{order_id % users:02d}", "amount": (order_id * 7919) % 10_000 / 100}


@dataclass
class ProducedInput:
    """What the input producer did: ids of committed and of aborted transactions, by codec."""

    committed: list[int] = field(default_factory=list)
    aborted: list[int] = field(default_factory=list)
    transactions: dict[str, int] = field(default_factory=dict)   # "committed zstd" -> count

    def summary(self) -> str:
        """E.g. ``committed 800 orders, aborted 400 (11 committed zstd, 10 committed lz4, ... transactions)``."""
        kinds = ", ".join(f"{n} {kind}" for kind, n in sorted(self.transactions.items()))
        return f"committed {len(self.committed)} orders, aborted {len(self.aborted)} ({kinds} transactions)"


class InputProducer(threading.Thread):
    """An independent confluent-kafka producer writing orders in transactions, until stopped.

    It alternates two transactional producers, one zstd- and one lz4-compressed,
    and aborts every ``abort_every``-th transaction (third by default) on purpose (those ids must
    never show up downstream). ``pause()`` parks it between two transactions.
    """

    def __init__(self, bootstrap: str, topic: str, *, users: int = 12, txn_rows: int = 40,
                 rate: float = 200.0, abort_every: int = 3, codecs: tuple[str, ...] = ("zstd", "lz4")) -> None:
        super().__init__(name="input-producer", daemon=True)
        self.bootstrap, self.topic, self.users, self.txn_rows = bootstrap, topic, users, txn_rows
        self.pause_s, self.abort_every, self.codecs = txn_rows / rate, abort_every, codecs
        self.produced = ProducedInput()
        self.error: BaseException | None = None
        self._stopping, self._parked = threading.Event(), threading.Event()
        self._go = threading.Event()   # cleared by pause(), set by resume() and stop()
        self._go.set()

    def run(self) -> None:
        """Write transactions until stopped; an error is kept in ``self.error`` (and ends the thread)."""
        from confluent_kafka import Producer

        producers = [Producer({"bootstrap.servers": self.bootstrap, "transactional.id": f"demo-input-{codec}",
                               "compression.type": codec, "linger.ms": 20,
                               "logger": logging.getLogger("confluent_kafka")}) for codec in self.codecs]
        try:
            for p in producers:
                p.init_transactions(60)
            n = next_id = 0
            while not self._stopping.is_set():
                if not self._go.is_set():
                    self._parked.set()
                    self._go.wait()
                    self._parked.clear()
                    continue
                codec = self.codecs[n % len(self.codecs)]
                abort = n % self.abort_every == self.abort_every - 1
                self._transaction(producers[n % len(producers)], range(next_id, next_id + self.txn_rows), abort, codec)
                n, next_id = n + 1, next_id + self.txn_rows
                self._stopping.wait(self.pause_s)
        except BaseException as exc:  # reported by the demo, which then fails
            self.error = exc
        finally:
            for p in producers:
                p.flush(10)

    def _transaction(self, producer, ids: range, abort: bool, codec: str) -> None:
        producer.begin_transaction()
        for i in ids:
            producer.produce(self.topic, key=str(i).encode(), value=json.dumps(order(i, self.users)).encode())
        if abort:
            producer.flush(60)   # the records are in the log, then aborted: read_uncommitted sees them
            producer.abort_transaction(60)
            self.produced.aborted.extend(ids)
        else:
            producer.commit_transaction(60)
            self.produced.committed.extend(ids)
        outcome = f"{'aborted' if abort else 'committed'} {codec}"
        self.produced.transactions[outcome] = self.produced.transactions.get(outcome, 0) + 1

    def pause(self, timeout: float = 120.0) -> None:
        """Park the producer between two transactions and return once it is parked."""
        self._go.clear()
        await_event("the input producer to park", self._parked.is_set, timeout, still_possible=self.is_alive)

    def resume(self) -> None:
        """Let a paused producer go on."""
        self._go.set()

    def stop(self, timeout: float = 120.0) -> None:
        """Stop after the current transaction and wait for the thread."""
        self._stopping.set()
        self._go.set()
        self.join(timeout)
