"""Chaos through the log sink: a real streaming query into the built-in broker, its driver SIGKILLed.

examples/log_sink_query.py runs as a real subprocess (its own session) through
TwoPhaseSink(LogSink) against the test session's ZooKeeper and a broker that
lives in this test process, so it outlives the driver. A third of first task
attempts fail mid-write; the driver is killed while an epoch is partly
pre-committed and restarted on the same checkpoint. An independent
read_committed confluent-kafka consumer then counts every input row exactly
once, while a read_uncommitted one shows the aborted records are in the log.
The second case kills the driver after Spark completed epoch 0 and before any
coordinator committed it: the pre-committed transactions wait, invisible, for
the restarted driver.

Both cases run against a KIP-939 broker ("prepared": a prepared transaction
never times out) and a classic one ("classic": no two-phase commit, as every
Kafka release; ordinary transactions whose timeout is long enough for the
restart). The third case is the classic mode's hole, made loud: the driver
stays down longer than the broker's transaction timeout, the broker aborts
epoch 0, and recovery marks it FAILED in words instead of losing it silently.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from coordinator.layout import QueryPaths
from coordinator.precommits import PrecommitRegistry
from examples.log_sink_query import read_topic
from tests.broker.conftest import broker_factory  # noqa: F401  (fixture)
from tests.test_chaos_driver import (
    APP,
    JOB_TIMEOUT,
    ROWS_PER_BATCH,
    SLOW_MS,
    Job,
    assert_all_committed,
    children,
    kill_mid_batch,
    kill_run,
    query_paths,
    read_json,
    spark_completed,
    wait_exit,
    wait_while_alive,
    watermark,
)
from tests.harness import SIGNER
from tests.test_cli import twophase as twophase_cli
from tests.waiting import wait_until
from twophase.client import Admin
from twophase.verify import count_rows

pytestmark = [pytest.mark.chaos, pytest.mark.spark]

MODULE = "examples.log_sink_query"
TOPIC = "log-sink-out"
PARTITIONS = 3
CLASSIC_TIMEOUT_MS = 120_000  # far longer than a restart takes: every commit comes in time
SHORT_TIMEOUT_MS = 4_000      # shorter than a dead driver's ZooKeeper session: the commit comes too late
BROKERS = {
    "prepared": {},
    "classic": {"transaction_two_phase_commit": False, "transaction_max_timeout_ms": CLASSIC_TIMEOUT_MS},
}


@dataclass
class LogJob(Job):
    """The chaos Job, with examples.log_sink_query writing to a broker instead of a directory."""

    bootstrap: str = ""
    mode: str = "prepared"  # the broker's: "prepared" (KIP-939) or "classic"
    broker: Any = None      # the Broker it writes to, living in the test process

    def command(self, module: str, flags: tuple[str, ...]) -> list[str]:
        return [sys.executable, "-m", module, "--zk", self.zk_hosts, "--root", self.root,
                "--app", APP, "--bootstrap", self.bootstrap, "--topic", TOPIC, "--input", str(self.input),
                "--checkpoint", str(self.checkpoint), *flags]


@pytest.fixture
def jobs(zk_server, zk_root, tmp_path, broker_factory) -> Iterator[Callable[..., LogJob]]:
    """``jobs(mode, **broker_options)``: a LogJob writing to a new broker made with those options."""
    made: list[LogJob] = []

    def make(mode: str, **broker_options) -> LogJob:
        broker = broker_factory(**broker_options)
        broker.create_topic(TOPIC, PARTITIONS)
        made.append(LogJob(zk_server.hosts, zk_root, tmp_path, batches=5, bootstrap=broker.bootstrap, mode=mode,
                           broker=broker))
        return made[-1]

    yield make
    for job in made:
        for run in job.runs:
            if run.proc.poll() is None:
                kill_run(run)


@pytest.fixture(params=list(BROKERS))
def job(request, jobs) -> LogJob:
    return jobs(request.param, **BROKERS[request.param])


def ids(records) -> list[int]:
    return [json.loads(m.value())["id"] for m in records]


def run_to_end(zk, job: LogJob, *flags: str) -> None:
    run = job.start(*flags, module=MODULE)
    rc = wait_exit(run, JOB_TIMEOUT)
    assert rc == 0, f"{run.label} exited {rc}\n{job.logs()}"
    assert_all_committed(zk, job)


def assert_committed_in_the_brokers_mode(job: LogJob) -> None:
    """Every committed transaction ran with the broker's longest timeout if and only if the broker is classic.

    Classic mode reads transaction.max.timeout.ms (DescribeConfigs) and asks for it; a KIP-939 producer
    keeps the client's default, which the broker does not enforce on a 2PC transaction anyway.
    """
    with Admin(job.bootstrap) as admin:
        configs = admin.describe_broker_configs(["transaction.max.timeout.ms", "transaction.two.phase.commit.enable"])
        listed = [t.transactional_id for t in admin.list_transactions(states=["CompleteCommit"])]
        timeouts = {d.timeout_ms for d in admin.describe_transactions(listed)}
    assert listed, "no committed transaction on the broker"
    assert configs["transaction.two.phase.commit.enable"] == ("false" if job.mode == "classic" else "true")
    longest = int(configs["transaction.max.timeout.ms"])
    assert (timeouts == {longest}) == (job.mode == "classic"), (job.mode, longest, timeouts)


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
    assert_committed_in_the_brokers_mode(job)


def kill_after_spark_completed_epoch_0(zk, job: LogJob) -> QueryPaths:
    """Run with no coordinator, SIGKILL the driver once commits/0 is in the checkpoint; check epoch 0 is
    pre-committed on the broker, invisible and uncommitted. Returns the query's znodes."""
    job.write_input()
    run = job.start("--coordinator", "daemon", "--slow-ms", str(SLOW_MS), module=MODULE)
    wait_while_alive("commits/0 in the checkpoint", lambda: spark_completed(job, 0), job, run)
    kill_run(run)
    assert watermark(zk, job) < 0, "epoch 0 committed although no coordinator ran"
    in_log = ids(read_topic(job.bootstrap, TOPIC, isolation="read_uncommitted"))
    assert set(range(ROWS_PER_BATCH)) <= set(in_log), "epoch 0 was not pre-committed on the broker"
    assert ids(read_topic(job.bootstrap, TOPIC)) == [], "pre-committed records are visible before the commit"
    return query_paths(zk, job)


def test_prepared_epoch_waits_through_a_dead_driver_and_commits_after_restart(zk, job):
    """commits/0 exists but nobody committed epoch 0 when the driver dies: its pre-committed transactions
    stay invisible (prepared: a 2PC transaction never times out; classic: the restart comes well
    within the broker's transaction timeout) until the restarted driver commits them."""
    kill_after_spark_completed_epoch_0(zk, job)

    run_to_end(zk, job)  # embedded coordinator; Spark does not re-run epoch 0
    report = count_rows(job.expected, ids(read_topic(job.bootstrap, TOPIC)))
    assert report.exact, f"{report}\n{job.logs()}"
    assert_committed_in_the_brokers_mode(job)


def test_classic_epoch_outliving_the_transaction_timeout_is_failed_in_words_then_replayed(
        zk, zk_server, jobs, broker_factory):
    """Classic mode with a 4 s timeout: the driver dies after Spark completed epoch 0 and before any
    coordinator committed it; the broker aborts epoch 0's transactions when their timeout passes.
    Recovery then cannot commit them: epoch 0 is FAILED with the transaction and its timeout named,
    `twophase recover` and `status` exit 1, and a reader sees nothing of epoch 0 and nothing twice.
    The way back: the operator raises the broker's timeout, `twophase replay` rewinds epoch 0, and the
    restarted query runs it again: every input row exactly once."""
    job = jobs("classic", transaction_two_phase_commit=False, transaction_max_timeout_ms=SHORT_TIMEOUT_MS,
               transaction_check_interval_ms=100)
    qp = kill_after_spark_completed_epoch_0(zk, job)
    tids = [a.handle.transactional_id for a in PrecommitRegistry(zk, qp, SIGNER).load(0)]
    assert tids, "epoch 0 has no pre-commit in ZooKeeper"
    with Admin(job.bootstrap) as admin:
        wait_until(lambda: {d.state for d in admin.describe_transactions(tids)} == {"CompleteAbort"},
                   what=f"the broker to abort epoch 0's transactions {tids} after {SHORT_TIMEOUT_MS} ms")
        assert {d.timeout_ms for d in admin.describe_transactions(tids)} == {SHORT_TIMEOUT_MS}
    # `recover` refuses while a run looks alive: the killed driver's ephemeral znode lasts its session.
    wait_until(lambda: not any(zk.exists(f"{qp.run(r)}/alive") for r in children(zk, qp.runs)),
               what="the killed driver's ZooKeeper session to expire")

    where = ("--zk", zk_server.hosts, "--root", job.root, "--app", APP)
    recover = twophase_cli("recover", *where)
    assert recover.returncode == 1, recover.stdout + recover.stderr
    assert "FAILED" in recover.stdout, recover.stdout
    record = read_json(zk, qp.epoch(0))
    assert record["state"] == "failed", record
    error = record["error"]
    assert any(tid in error for tid in tids), error
    assert "aborted by the broker" in error and "longer than its transaction timeout of 4.0s" in error, error
    assert watermark(zk, job) < 0

    status = twophase_cli("status", *where)
    assert status.returncode == 1, status.stdout + status.stderr
    assert "epoch 0: failed" in status.stdout and "transaction timeout of 4.0s" in status.stdout, status.stdout
    assert any(tid in status.stdout for tid in tids), status.stdout

    visible = ids(read_topic(job.bootstrap, TOPIC))
    assert not set(visible) & set(range(ROWS_PER_BATCH)), "rows of the FAILED epoch 0 are visible"
    assert len(visible) == len(set(visible)), f"rows visible twice: {sorted(visible)}"

    port, data_dir = job.broker.port, job.broker.data_dir
    job.broker.stop()
    job.broker = broker_factory(data_dir=data_dir, port=port, transaction_two_phase_commit=False,
                                transaction_max_timeout_ms=CLASSIC_TIMEOUT_MS)
    replay = twophase_cli("replay", *where, "--checkpoint", str(job.checkpoint), "--epoch", "0")
    assert replay.returncode == 0, replay.stdout + replay.stderr
    run_to_end(zk, job)
    report = count_rows(job.expected, ids(read_topic(job.bootstrap, TOPIC)))
    assert report.exact, f"{report}\n{job.logs()}"
