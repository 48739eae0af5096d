"""LogSink in classic mode: a broker without KIP-939 (`twophase broker --no-two-phase-commit`).

Each attempt writes an ordinary transaction with the broker's longest timeout; the coordinator
commits it with EndTxn. A commit that comes after the timeout finds it aborted by the broker:
CommitFailed in plain words, the epoch FAILED, nothing of it visible, nothing written twice.
An independent confluent-kafka read_committed reader counts every row.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from examples.log_sink_query import read_topic
from sinks.log import LogSink
from tests.broker.conftest import broker_factory, topic  # noqa: F401  (fixtures)
from tests.harness import QUERY, Pipeline, stage
from tests.waiting import wait_until
from twophase.client import Admin, KafkaError
from twophase.sink import AbortFailed, CommitFailed, CommitOutcomeUnknown, TxnContext

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT_MS = 3_000
SECRET = "twophase-test-secret-0123456789"  # tests.harness.SIGNER's


def ctx(run="r1", epoch=0, partition=0, attempt=0) -> TxnContext:
    return TxnContext("app", "q-1", run, epoch, partition, attempt)


@pytest.fixture
def classic(broker_factory):
    """A broker as Kafka is: no two-phase commit; open transactions aborted after a few seconds."""
    return broker_factory(transaction_two_phase_commit=False, transaction_max_timeout_ms=TIMEOUT_MS,
                          transaction_check_interval_ms=100)


@pytest.fixture
def sink(classic, topic) -> LogSink:
    classic.create_topic(topic, 3)
    return LogSink(classic.bootstrap, topic, key="id")


def committed_ids(sink: LogSink) -> list[int]:
    return sorted(json.loads(m.value())["id"] for m in read_topic(sink.bootstrap, sink.topic))


def prepare(sink: LogSink, context: TxnContext, ids):
    return sink.pre_commit(stage(sink, context, [{"id": i} for i in ids]))


def await_aborted_by_the_broker(bootstrap: str, transactional_id: str) -> None:
    with Admin(bootstrap) as admin:
        wait_until(lambda: admin.describe_transactions([transactional_id])[0].state == "CompleteAbort",
                   what=f"the broker to abort {transactional_id} after its timeout")


def test_auto_mode_commits_ordinary_transactions_with_the_brokers_longest_timeout(sink):
    handle = prepare(sink, ctx(), range(10))
    assert (handle.mode, handle.timeout_ms, handle.records) == ("classic", TIMEOUT_MS, 10)
    assert committed_ids(sink) == []   # flushed, durable, invisible
    sink.commit(handle)
    sink.commit(handle)                # a retried commit: once
    assert committed_ids(sink) == list(range(10))
    with pytest.raises(AbortFailed, match="committed"):
        sink.abort(handle)


def test_the_brokers_settings_are_described_to_any_kafka_client(classic):
    from confluent_kafka.admin import AdminClient, ConfigResource, ResourceType

    admin = AdminClient({"bootstrap.servers": classic.bootstrap})
    [future] = admin.describe_configs([ConfigResource(ResourceType.BROKER, "0")]).values()
    configs = future.result(timeout=30)
    assert configs["transaction.max.timeout.ms"].value == str(TIMEOUT_MS)
    assert configs["transaction.two.phase.commit.enable"].value == "false"


def test_a_commit_after_the_timeout_fails_loudly_in_plain_words(sink):
    handle = prepare(sink, ctx(), range(5))
    await_aborted_by_the_broker(sink.bootstrap, handle.transactional_id)
    with pytest.raises(CommitFailed) as failed:
        sink.commit(handle)
    words = str(failed.value)
    assert handle.transactional_id in words and "5 records" in words
    assert "aborted by the broker" in words and "longer than its transaction timeout of 3.0s" in words
    sink.abort(handle)   # gone already: an abort is a no-op
    assert committed_ids(sink) == []


def test_an_abort_ends_it_at_once_and_later_transactions_go_on(sink):
    first = prepare(sink, ctx(attempt=0), range(3))
    sink.abort(first)
    sink.abort(first)
    later = prepare(sink, ctx(attempt=1), range(3, 6))
    sink.commit(later)
    assert committed_ids(sink) == [3, 4, 5]


def test_forced_modes(classic, broker_factory, topic):
    classic.create_topic(topic, 1)
    prepared_only = LogSink(classic.bootstrap, topic, key="id", commit_mode="prepared")
    with pytest.raises(KafkaError, match="TRANSACTIONAL_ID_AUTHORIZATION_FAILED"):
        prepare(prepared_only, ctx(), [1])
    two_phase = broker_factory()
    two_phase.create_topic(topic, 1)
    forced = LogSink(two_phase.bootstrap, topic, key="id", commit_mode="classic", transaction_timeout_ms=60_000)
    handle = prepare(forced, ctx(), [1, 2])
    assert (handle.mode, handle.timeout_ms) == ("classic", 60_000)
    forced.commit(handle)
    assert committed_ids(forced) == [1, 2]


def test_a_timeout_above_the_brokers_maximum_is_refused_with_the_setting_named(classic, topic):
    classic.create_topic(topic, 1)
    sink = LogSink(classic.bootstrap, topic, key="id", transaction_timeout_ms=TIMEOUT_MS + 1, commit_mode="classic")
    with pytest.raises(ValueError, match=r"transaction_timeout_ms=.*transaction.max.timeout.ms"):
        prepare(sink, ctx(), [1])


@pytest.mark.parametrize("kwargs", [{"commit_mode": "2pc"}, {"transaction_timeout_ms": 0},
                                    {"producer": {"transaction_timeout_ms": 5}}])
def test_bad_settings_are_refused(kwargs):
    with pytest.raises(ValueError):
        LogSink("127.0.0.1:9092", "t", **kwargs)


def twophase(*args):
    return subprocess.run([sys.executable, "-m", "twophase.cli", *args], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=REPO, TWOPHASE_SECRET=SECRET), timeout=60)


def test_coordinator_down_past_the_timeout_fails_the_epoch_and_loses_nothing_silently(
        zk, zk_server, zk_root, sink):
    """Epoch 0 commits in time. Epoch 1 is pre-committed, then the coordinator stays away longer than
    the broker's timeout: its commit is CommitFailed, the epoch FAILED, `twophase status` and
    `recover` say which transaction, how old, which timeout, and exit non-zero. The reader sees
    epoch 0 once and nothing of epoch 1."""
    pipe = Pipeline(zk, zk_root, sink)
    for partition in range(2):
        assert pipe.task("r1", 0, partition, range(partition * 10, partition * 10 + 10))
    pipe.barrier(0, "r1")
    pipe.coordinator().reconcile()
    assert pipe.watermark() == 0
    for partition in range(2):
        assert pipe.task("r1", 1, partition, range(100 + partition * 10, 110 + partition * 10))
    pipe.barrier(1, "r1")
    attempts = pipe.registry.load(1)
    for each in attempts:  # both: the broker's periodic check may abort the second one a sweep later
        await_aborted_by_the_broker(sink.bootstrap, each.handle.transactional_id)
    attempt = attempts[0]

    report = pipe.coordinator().reconcile()
    assert not report.ok
    record = pipe.record(1)
    assert record.state.value == "failed" and "aborted by the broker" in record.error
    assert pipe.watermark() == 0
    status = twophase("status", "--zk", zk_server.hosts, "--root", zk_root, "--app", "app")
    assert status.returncode == 1, status.stderr
    assert "FAILED" in status.stdout and attempt.handle.transactional_id in status.stdout
    assert "transaction timeout of 3.0s" in status.stdout
    recover = twophase("recover", "--zk", zk_server.hosts, "--root", zk_root, "--app", "app")
    assert recover.returncode == 1 and "FAILED" in recover.stdout, recover.stdout + recover.stderr
    assert committed_ids(sink) == list(range(20))   # epoch 0 once; nothing of epoch 1


def fake_checkpoint(path, batches):
    """The parts of a Spark checkpoint that replay reads and rewinds: metadata, offsets/N, commits/N."""
    for d in ("offsets", "commits"):
        (path / d).mkdir(parents=True)
    (path / "metadata").write_text(json.dumps({"id": QUERY}) + "\n")
    for n in batches:
        (path / "offsets" / str(n)).write_text("v1\n{}\n")
        (path / "commits" / str(n)).write_text("v1\n{}\n")
    return path


def test_a_failed_epoch_is_replayed_exactly_once(zk, zk_server, zk_root, sink, tmp_path):
    """The way back: `twophase replay` rewinds the checkpoint to the FAILED epoch and discards it and the
    later epochs in ZooKeeper; the restarted query (here: a new run of tasks) writes it again, and the
    reader sees every row of every epoch once."""
    pipe = Pipeline(zk, zk_root, sink)
    assert pipe.task("r1", 0, 0, range(0, 10))
    pipe.barrier(0, "r1")
    pipe.coordinator().reconcile()
    assert pipe.task("r1", 1, 0, range(10, 20))
    assert pipe.task("r1", 2, 0, range(20, 30))   # later epoch, waiting behind 1
    pipe.barrier(2, "r1")
    [attempt] = pipe.registry.load(1)
    await_aborted_by_the_broker(sink.bootstrap, attempt.handle.transactional_id)
    pipe.coordinator().reconcile()
    assert pipe.record(1).state.value == "failed"
    checkpoint = fake_checkpoint(tmp_path / "ckpt", range(3))

    args = ("--zk", zk_server.hosts, "--root", zk_root, "--app", "app", "--checkpoint", str(checkpoint))
    refused = twophase("replay", *args, "--epoch", "2")
    assert refused.returncode == 2 and "only a FAILED epoch" in refused.stderr, refused.stderr
    done = twophase("replay", *args, "--epoch", "1")
    assert done.returncode == 0, done.stdout + done.stderr
    assert sorted(os.listdir(checkpoint / "commits")) == ["0"]
    assert sorted(os.listdir(checkpoint / "offsets")) == ["0", "1"]
    assert not zk.exists(pipe.qp.epoch(1)) and not zk.exists(pipe.qp.epoch(2))
    assert committed_ids(sink) == list(range(10))

    assert pipe.task("r2", 1, 0, range(10, 20))   # Spark re-runs batch 1, then plans batch 2 anew
    assert pipe.task("r2", 2, 0, range(20, 30))
    pipe.barrier(2, "r2")
    pipe.coordinator().reconcile()
    assert pipe.watermark() == 2
    assert committed_ids(sink) == list(range(30))


def test_a_commit_retried_after_the_broker_forgot_the_id_is_an_unknown_outcome(broker_factory, topic):
    """The coordinator died after its EndTxn and came back after transactional.id.expiration.ms: the
    broker no longer knows the id, so whether the transaction committed cannot be told. That is
    CommitOutcomeUnknown (never "aborted, none visible"), which `twophase replay` refuses."""
    broker = broker_factory(transaction_two_phase_commit=False, transaction_max_timeout_ms=TIMEOUT_MS,
                            transactional_id_expiration_ms=500, transaction_check_interval_ms=100)
    broker.create_topic(topic, 1)
    sink = LogSink(broker.bootstrap, topic, key="id")
    handle = prepare(sink, ctx(), range(3))
    sink.commit(handle)
    with Admin(sink.bootstrap) as admin:
        def forgotten():
            try:
                admin.describe_transactions([handle.transactional_id])
            except KafkaError:
                return True
            return False
        wait_until(forgotten, what="the broker to expire the idle transactional id")
    with pytest.raises(CommitOutcomeUnknown, match="cannot be told"):
        sink.commit(handle)
    assert committed_ids(sink) == [0, 1, 2]
