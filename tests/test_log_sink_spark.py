"""Chaos through the log sink: a real streaming query into the built-in broker, its driver SIGKILLed.

examples/log_sink_query.py runs as a real subprocess (its own session) through
TwoPhaseSink(LogSink) against the test session's ZooKeeper and a broker that
lives in this test process, so it outlives the driver. A third of first task
attempts fail mid-write; the driver is killed while an epoch is partly
pre-committed and restarted on the same checkpoint. An independent
read_committed confluent-kafka consumer then counts every input row exactly
once, while a read_uncommitted one shows the aborted records are in the log.
The second case kills the driver after Spark completed epoch 0 and before any
coordinator committed it: the prepared transactions wait, invisible, for the
restarted driver.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from examples.log_sink_query import read_topic
from tests.broker.conftest import broker, broker_factory  # noqa: F401  (fixtures)
from tests.test_chaos_driver import (
    APP,
    JOB_TIMEOUT,
    ROWS_PER_BATCH,
    SLOW_MS,
    Job,
    kill_mid_batch,
    kill_run,
    spark_completed,
    wait_exit,
    wait_while_alive,
    watermark,
)
from twophase.verify import count_rows

pytestmark = [pytest.mark.chaos, pytest.mark.spark]

MODULE = "examples.log_sink_query"
TOPIC = "log-sink-out"
PARTITIONS = 3


@dataclass
class LogJob(Job):
    """The chaos Job, with examples.log_sink_query writing to a broker instead of a directory."""

    bootstrap: str = ""

    def command(self, module: str, flags: tuple[str, ...]) -> list[str]:
        return [sys.executable, "-m", module, "--zk", self.zk_hosts, "--root", self.root,
                "--app", APP, "--bootstrap", self.bootstrap, "--topic", TOPIC, "--input", str(self.input),
                "--checkpoint", str(self.checkpoint), *flags]


@pytest.fixture
def job(zk_server, zk_root, tmp_path, broker) -> Iterator[LogJob]:
    broker.create_topic(TOPIC, PARTITIONS)
    job = LogJob(zk_server.hosts, zk_root, tmp_path, batches=5, bootstrap=broker.bootstrap)
    yield job
    for run in job.runs:
        if run.proc.poll() is None:
            kill_run(run)


def ids(records) -> list[int]:
    return [json.loads(m.value())["id"] for m in records]


def run_to_end(zk, job: LogJob, *flags: str) -> None:
    run = job.start(*flags, module=MODULE)
    rc = wait_exit(run, JOB_TIMEOUT)
    assert rc == 0, f"{run.label} exited {rc}\n{job.logs()}"
    assert watermark(zk, job) == job.batches - 1, job.logs()


def test_driver_killed_mid_batch_and_failing_tasks_exactly_once_on_the_log(zk, job):
    job.write_input()
    run = job.start("--slow-ms", str(SLOW_MS), "--fail-rate", "0.3", module=MODULE)
    epoch, killed_runs, rerun = kill_mid_batch(zk, job, run)

    run_to_end(zk, job, "--fail-rate", "0.3")
    committed = read_topic(job.bootstrap, TOPIC)
    report = count_rows(job.expected, ids(committed))
    assert report.exact, f"{report}\n{job.logs()}"
    runs = {}
    for m in committed:  # each epoch is committed from one run only (provenance headers)
        h = dict(m.headers())
        runs.setdefault(int(h["twophase.epoch"]), set()).add(h["twophase.run_id"].decode())
    assert all(len(r) == 1 for r in runs.values()), runs
    if rerun:
        assert not runs[epoch] & killed_runs, f"epoch {epoch} committed from a killed run: {runs[epoch]}"
    # Failed first attempts and the killed run wrote records that were aborted, not just skipped.
    assert len(read_topic(job.bootstrap, TOPIC, isolation="read_uncommitted")) > len(committed)


def test_prepared_epoch_waits_through_a_dead_driver_and_commits_after_restart(zk, job):
    """commits/0 exists but nobody committed epoch 0 when the driver dies: its prepared transactions
    stay invisible (a 2PC transaction never times out) until the restarted driver commits them."""
    job.write_input()
    run = job.start("--coordinator", "daemon", "--slow-ms", str(SLOW_MS), module=MODULE)
    wait_while_alive("commits/0 in the checkpoint", lambda: spark_completed(job, 0), job, run)
    kill_run(run)
    assert watermark(zk, job) < 0, "epoch 0 committed although no coordinator ran"
    in_log = ids(read_topic(job.bootstrap, TOPIC, isolation="read_uncommitted"))
    assert set(range(ROWS_PER_BATCH)) <= set(in_log), "epoch 0 was not prepared on the broker"
    assert ids(read_topic(job.bootstrap, TOPIC)) == [], "prepared records are visible before the commit"

    run_to_end(zk, job)  # embedded coordinator; Spark does not re-run epoch 0
    report = count_rows(job.expected, ids(read_topic(job.bootstrap, TOPIC)))
    assert report.exact, f"{report}\n{job.logs()}"
