"""Attacks on the broker and the framework: a hostile client, a damaged disk, a careless operator.

Each test runs one attack with real components and asserts the safe outcome. The broker fixtures
(``broker``, ``broker_factory``, ``wire``, ``topic``) and storage release are those of
tests/broker/conftest.py; the ZooKeeper fixtures come from tests/conftest.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator

import pytest

from tests.broker.conftest import (  # noqa: F401  (fixtures re-exported for this folder)
    broker,
    broker_factory,
    release_storage,
    topic,
    wire,
)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class BrokerProcess:
    """``twophase broker`` in a process of its own, for attacks measured on the process (its memory,
    its descriptor limit). ``start()`` returns once it listens; ``stop()`` ends it with SIGTERM.

        proc = broker_cli(data_dir, "--fetch-max-bytes", "4194304")   # started
        WireClient(proc.port) ...
        proc.stop(); proc.start()                                     # restarted on its data
    """

    def __init__(self, data_dir: str, log_path: str, flags: tuple[str, ...], preexec_fn=None) -> None:
        self.data_dir, self.log_path, self.flags, self.preexec_fn = data_dir, log_path, flags, preexec_fn
        self.proc: subprocess.Popen | None = None
        self.port = 0

    def start(self) -> None:
        env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "twophase.broker.cli", "--data-dir", self.data_dir, "--port", "0",
                 *self.flags], stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL, text=True, env=env,
                preexec_fn=self.preexec_fn)
        line = self.proc.stdout.readline()
        self.proc.stdout.close()
        if "listening on" not in line:
            self.proc.wait(timeout=60)
            raise AssertionError(f"broker did not start (exit {self.proc.returncode}):\n{self.output()}")
        self.port = int(line.rsplit(":", 1)[1])

    def output(self) -> str:
        """What the broker logged so far."""
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")

    def stop(self) -> None:
        """SIGTERM and wait (SIGKILL after 60 s); nothing if not running."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=30)


@pytest.fixture
def broker_cli(tmp_path) -> Iterator:
    """``broker_cli(*flags, data_dir=None, preexec_fn=None)``: a started BrokerProcess, stopped after the test."""
    started: list[BrokerProcess] = []

    def make(*flags: str, data_dir=None, preexec_fn=None) -> BrokerProcess:
        n = len(started)
        proc = BrokerProcess(str(data_dir or tmp_path / f"cli-data-{n}"), str(tmp_path / f"cli-broker-{n}.log"),
                             flags, preexec_fn)
        started.append(proc)
        proc.start()
        return proc

    yield make
    for proc in reversed(started):
        proc.stop()
