"""An idempotent producer keeps producing while the broker is SIGKILLed and restarted (twice).

The broker runs as a real subprocess (``python -m twophase.cli broker --fsync always``) in its
own session, on a fixed free port and data directory, so a restart looks to the client like the
same broker coming back. A confluent-kafka (librdkafka) producer with ``enable.idempotence``
produces numbered records (key = id) from a thread; the test kills the broker's process group
with SIGKILL while batches are in flight, restarts it on the same data directory and port, and
does it again. librdkafka retries the unacknowledged batches against the restarted broker with
their original producer id, epoch and sequence numbers.

Afterwards a fresh consumer reads every partition from the beginning to its high watermark, and
``count_rows`` checks that every acknowledged id is there exactly once. Ids that were written but
whose acknowledgement was lost with the broker may be there too, but at most once: a retry across
the crash must never store a batch twice.

The test can catch that: with ``enable.idempotence`` off (and nothing else changed) it fails
every time, with 100-200 duplicates (whole batches written just before a kill, retried after it).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
import uuid

import pytest
from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from twophase.verify import count_rows
from twophase.zkserver import free_port

pytestmark = pytest.mark.chaos

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PARTITIONS = 3
ACKS_PER_PHASE = 3000   # acknowledged records to wait for before each kill and after the last restart
MAX_OUTSTANDING = 5000  # records the producer thread lets queue up (bounded, also while the broker is down)
PHASE_TIMEOUT = 20.0


class BrokerProcess:
    """``twophase broker`` as a subprocess in its own session, restartable on the same dir and port."""

    def __init__(self, data_dir: str, port: int, log_dir: str) -> None:
        self.data_dir = data_dir
        self.port = port
        self.log_dir = log_dir
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    def log_path(self, n: int | None = None) -> str:
        return os.path.join(self.log_dir, f"broker-{self.starts if n is None else n}.log")

    def start(self, timeout: float = 30.0) -> None:
        """Start it and return once it says it is listening; retries while the port is not free yet."""
        assert self.proc is None or self.proc.poll() is not None, "broker already running"
        deadline = time.monotonic() + timeout
        env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
        while True:
            self.starts += 1
            with open(self.log_path(), "wb") as log:
                self.proc = subprocess.Popen(
                    [sys.executable, "-m", "twophase.cli", "broker", "--data-dir", self.data_dir,
                     "--port", str(self.port), "--fsync", "always", "--default-partitions", str(PARTITIONS)],
                    stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                    start_new_session=True)
            while time.monotonic() < deadline:
                if self._listening():
                    return
                if self.proc.poll() is not None:
                    break
                time.sleep(0.02)
            output = self.output()
            if self.proc.poll() is None:
                self.kill()
                raise TimeoutError(f"broker not listening after {timeout}s:\n{output}")
            if "in use" not in output or time.monotonic() >= deadline:  # only a busy port is worth a retry
                raise RuntimeError(f"broker exited with {self.proc.returncode}:\n{output}")

    def _listening(self) -> bool:
        with open(self.log_path(), "rb") as f:
            return b"listening on" in f.read()

    def output(self, n: int | None = None) -> str:
        with open(self.log_path(n), "rb") as f:
            return f.read().decode(errors="replace")

    def kill(self) -> None:
        """SIGKILL the whole process group and reap it."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=30)

    def stop(self) -> None:
        """SIGTERM (clean shutdown), SIGKILL if it does not exit in time."""
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.kill()
        except ProcessLookupError:
            self.proc.wait(timeout=30)


@pytest.fixture
def broker_process(tmp_path):
    b = BrokerProcess(str(tmp_path / "data"), free_port(), str(tmp_path))
    try:
        yield b
    finally:
        b.stop()
        b.kill()
        assert b.proc is None or b.proc.poll() is not None


class NumberedProducer(threading.Thread):
    """Produces keys 0, 1, 2, ... until stopped, then flushes; remembers which ids were acknowledged."""

    def __init__(self, bootstrap: str, topic: str) -> None:
        super().__init__(name="numbered-producer", daemon=True)
        self.topic = topic
        self.producer = Producer({
            "bootstrap.servers": bootstrap,
            "enable.idempotence": True,
            "acks": "all",
            "message.timeout.ms": 120_000,
            "retries": 1_000_000,
            "retry.backoff.ms": 50,
            "retry.backoff.max.ms": 500,
            "reconnect.backoff.ms": 50,
            "reconnect.backoff.max.ms": 500,
            "linger.ms": 2,
            "batch.num.messages": 100,
            "socket.connection.setup.timeout.ms": 5000,
            "error_cb": self._on_error,
            "logger": logging.getLogger("rdkafka.crash-test"),  # connection-refused noise goes to logging
        })
        self.produced = 0
        self.acked: list[int] = []
        self.failed: list[tuple[int, KafkaError]] = []
        self.fatal: list[KafkaError] = []
        self.crashed: BaseException | None = None
        self.unflushed = -1
        self._stopping = threading.Event()
        self._cond = threading.Condition()

    def _on_error(self, err: KafkaError) -> None:
        # Transport errors while the broker is down are expected; a fatal error is not.
        if err.fatal():
            self.fatal.append(err)
            with self._cond:
                self._cond.notify_all()

    def _on_delivery(self, err, msg) -> None:
        key = int(msg.key())
        with self._cond:
            if err is None:
                self.acked.append(key)
            else:
                self.failed.append((key, err))
            self._cond.notify_all()

    def run(self) -> None:
        try:
            while not self._stopping.is_set() and not self.fatal:
                if len(self.producer) >= MAX_OUTSTANDING:
                    self.producer.poll(0.01)
                    continue
                n = self.produced
                try:
                    self.producer.produce(self.topic, key=str(n).encode(), value=b"record %d " % n + b"x" * 90,
                                          on_delivery=self._on_delivery)
                except BufferError:
                    self.producer.poll(0.01)
                    continue
                self.produced += 1
                self.producer.poll(0)
            self.unflushed = self.producer.flush(60)
        except BaseException as exc:  # reported by the test
            self.crashed = exc
        finally:
            # The producer holds callbacks bound to self: drop it, or only a garbage collection frees it.
            self.producer = None
            with self._cond:
                self._cond.notify_all()

    def in_flight(self) -> int:
        return len(self.producer)

    def wait_acked(self, count: int, timeout: float) -> None:
        """Wait until ``count`` records were acknowledged (fails on a fatal error or a timeout)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while len(self.acked) < count:
                assert not self.fatal, f"fatal producer error: {self.fatal}"
                assert self.crashed is None, f"producer thread failed: {self.crashed!r}"
                remaining = deadline - time.monotonic()
                assert remaining > 0, (f"only {len(self.acked)} of {count} records acknowledged after {timeout}s "
                                       f"({len(self.failed)} failed, {self.in_flight()} in flight)")
                self._cond.wait(remaining)

    def stop_and_flush(self, timeout: float = 75.0) -> None:
        self._stopping.set()
        self.join(timeout)
        assert not self.is_alive(), "producer did not flush in time"


def read_all_keys(bootstrap: str, topic: str, timeout: float = 60.0) -> list[int]:
    """Every key in every partition, from the beginning to the high watermark."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"crash-check-{uuid.uuid4().hex[:8]}",
                         "enable.auto.commit": False, "enable.partition.eof": False})
    try:
        keys: list[int] = []
        ends: dict[int, int] = {}
        for p in range(PARTITIONS):
            low, high = consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)
            ends[p] = high
        consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in ends if ends[p] > 0])
        position = {p: 0 for p in ends}
        deadline = time.monotonic() + timeout
        while any(position[p] < ends[p] for p in ends):
            assert time.monotonic() < deadline, f"read {len(keys)} records, positions {position} of {ends}"
            left = sum(ends[p] - position[p] for p in ends)  # consume() waits out its timeout for fewer
            for msg in consumer.consume(min(1000, left), timeout=0.5):
                if msg.error():
                    raise AssertionError(f"consumer error: {msg.error()}")
                if msg.offset() < ends[msg.partition()]:
                    keys.append(int(msg.key()))
                position[msg.partition()] = max(position[msg.partition()], msg.offset() + 1)
        return keys
    finally:
        consumer.close()


def test_idempotent_producer_across_broker_sigkill(broker_process):
    broker_process.start()
    topic = f"crash-{uuid.uuid4().hex[:8]}"
    admin = AdminClient({"bootstrap.servers": broker_process.bootstrap})
    admin.create_topics([NewTopic(topic, PARTITIONS, 1)])[topic].result(timeout=30)
    del admin  # librdkafka's descriptors go with the last reference (it has no close())

    producer = NumberedProducer(broker_process.bootstrap, topic)
    producer.start()
    in_flight_at_kill = []
    try:
        target = ACKS_PER_PHASE
        for _ in range(2):
            producer.wait_acked(target, PHASE_TIMEOUT)
            in_flight_at_kill.append(producer.in_flight())
            broker_process.kill()
            broker_process.start()
            # New acknowledgements after the restart: the producer recovered and goes on.
            target = len(producer.acked) + ACKS_PER_PHASE
        producer.wait_acked(target, PHASE_TIMEOUT)
    finally:
        producer.stop_and_flush()

    assert producer.crashed is None, repr(producer.crashed)
    assert not producer.fatal, f"fatal producer errors: {producer.fatal}"
    assert producer.unflushed == 0, f"{producer.unflushed} records still unacknowledged after the flush"
    assert not producer.failed, f"{len(producer.failed)} deliveries failed, e.g. {producer.failed[:3]}"
    assert sum(in_flight_at_kill) > 0, "nothing was in flight when the broker was killed"

    keys = read_all_keys(broker_process.bootstrap, topic)
    report = count_rows(producer.acked, keys)
    assert report.lost == 0 and report.duplicated == 0, (
        f"{report}; in flight at the kills: {in_flight_at_kill}; produced {producer.produced}")
    assert set(keys) <= set(range(producer.produced))
    # Every record was acknowledged in the end, so nothing beyond them may be there either.
    assert report.exact, report

    logs = "".join(broker_process.output(n) for n in range(1, broker_process.starts + 1))
    assert "Traceback" not in logs, logs[-5000:]
