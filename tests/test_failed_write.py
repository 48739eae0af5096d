"""A foreachBatch write that failed, and a function that swallowed the error: its epoch is never committed.

TwoPhaseBatchSink.write records the failed write under its epoch (PrecommitRegistry.record_failed_write)
before it raises; Spark then records the micro-batch all the same. Here the driver's part is played by
that one call, against a real ZooKeeper, the real FileSink and the `twophase` CLI; the whole path in
Spark is tests/test_spark_writer.py::test_a_swallowed_failed_write_commits_nothing_of_its_micro_batch.
"""

from __future__ import annotations

import json

import pytest

from coordinator.app import PassOptions
from coordinator.report import AbortReason, AttemptAborted, EpochBlocked, EpochCommitted
from coordinator.state import EpochState
from sinks.files import FileSink
from tests.harness import QUERY, Pipeline, ids_out
from tests.test_cli import fake_checkpoint, twophase
from tests.test_replay import checkpoint_with
from twophase import cli
from twophase.verify import count_rows

WRITE_ERROR = "the write of micro-batch 1 to app app failed (Py4JJavaError('task 2 failed 4 times'))"


@pytest.fixture
def pipe(zk, zk_root, tmp_path):
    return Pipeline(zk, zk_root, FileSink(str(tmp_path / "out")))


def swallowed_failed_write_of_epoch_1(pipe):
    """Epoch 0 committed; run r1's write of micro-batch 1 registered partitions 0 and 1, never 2, and failed."""
    assert pipe.task("r1", 0, 0, range(10))
    pipe.barrier(0, "r1")
    pipe.coordinator().reconcile()
    for p in (0, 1):
        assert pipe.task("r1", 1, p, range(10 + 5 * p, 15 + 5 * p))
    pipe.registry.record_failed_write("r1", 1, WRITE_ERROR)


@pytest.mark.parametrize("proof", ["barrier", "commits/1", "micro-batch 2"])
def test_an_epoch_whose_write_failed_is_failed_not_committed_however_spark_records_it(pipe, tmp_path, proof):
    swallowed_failed_write_of_epoch_1(pipe)
    options = PassOptions()
    if proof == "barrier":
        pipe.barrier(1, "r1")
    elif proof == "commits/1":  # after a driver crash: only the checkpoint says so
        options = PassOptions(checkpoint=fake_checkpoint(tmp_path / "ck", completed=[0, 1]))
    else:  # the halted run's next write fails in every task, and records itself too
        pipe.registry.record_failed_write("r1", 2, "the write of micro-batch 2 to app app failed (PhaseTwoHalted)")
    report = pipe.coordinator().reconcile(options)

    [blocked] = [r for r in report.records if isinstance(r, EpochBlocked)]
    assert (blocked.epoch, blocked.replay) == (1, True) and not report.ok
    assert "the write of run r1 failed" in blocked.error and WRITE_ERROR in blocked.error
    assert "twophase replay --app app --epoch 1" in blocked.error
    # Its pre-commits are aborted at once (a log sink's would hold back read_committed readers meanwhile).
    assert sorted(r.attempt for r in report.records if isinstance(r, AttemptAborted)
                  and r.reason is AbortReason.WRITE_FAILED) == ["r1.1.0.0", "r1.1.1.0"]
    assert not any(isinstance(r, EpochCommitted) for r in report.records)
    record = pipe.record(1)
    assert (record.state, record.run, record.winners, record.error) == (EpochState.FAILED, "r1", (), blocked.error)
    assert count_rows(range(10), ids_out(pipe)).exact and pipe.watermark() == 0

    # Later passes, an operator's retry included, leave it FAILED: only a replay can bring its rows. The
    # record itself says so, should the failed_writes znode be lost.
    assert record.replay
    pipe.zk.delete(pipe.qp.failed_writes(1), recursive=True)
    again = pipe.coordinator("c2").reconcile(PassOptions(retry_failed=True, checkpoint=options.checkpoint))
    assert again.records == (EpochBlocked(QUERY, 1, blocked.error, replay=True),)
    assert count_rows(range(10), ids_out(pipe)).exact and pipe.record(1).state is EpochState.FAILED


def test_status_names_the_failed_write_retry_is_refused_and_replay_writes_the_batch_once(pipe, zk_server,
                                                                                         zk_root, tmp_path):
    swallowed_failed_write_of_epoch_1(pipe)
    pipe.barrier(1, "r1")
    pipe.coordinator().reconcile()
    args = ("--zk", zk_server.hosts, "--root", zk_root, "--app", "app")

    status = twophase("status", *args)
    assert status.returncode == 1, status.stderr
    assert "epoch 1: failed  error: the write of run r1 failed" in status.stdout
    assert "twophase replay --app app --epoch 1" in status.stdout
    [epoch] = [e for e in json.loads(twophase("status", *args, "--json").stdout)["queries"][0]["epochs"]
               if e["epoch"] == 1]
    assert (epoch["state"], epoch["committed"]) == ("failed", False) and WRITE_ERROR in epoch["error"]

    retried = twophase("recover", *args, "--retry-failed")
    assert retried.returncode == 1 and "epoch 1: FAILED (the write of run r1 failed" in retried.stdout

    checkpoint = checkpoint_with(tmp_path / "ckpt", range(2))
    done = twophase("replay", *args, "--checkpoint", checkpoint, "--epoch", "1")
    assert done.returncode == 0, done.stdout + done.stderr
    assert not pipe.zk.exists(pipe.qp.epoch(1))
    for p in range(3):  # the restarted query runs micro-batch 1 again, every partition this time
        assert pipe.task("r2", 1, p, range(10 + 5 * p, 15 + 5 * p))
    pipe.barrier(1, "r2")
    assert pipe.coordinator().reconcile().ok
    assert count_rows(range(25), ids_out(pipe)).exact and pipe.watermark() == 1


def test_a_write_that_failed_before_any_task_began_fails_its_epoch_instead_of_committing_it_empty(pipe):
    pipe.registry.record_failed_write("r1", 0, "the write of micro-batch 0 to app app failed (AnalysisException)")
    assert all(pipe.zk.exists(path) for path in (pipe.qp.intents(0), pipe.qp.attempts(0), pipe.qp.winners(0)))
    pipe.barrier(0, "r1")
    report = pipe.coordinator().reconcile()
    assert [(type(r), r.epoch) for r in report.records] == [(EpochBlocked, 0)]
    assert pipe.record(0).state is EpochState.FAILED and pipe.watermark() == -1


def test_the_failed_write_of_a_run_that_stopped_does_not_fail_the_run_that_wrote_the_epoch_again(pipe):
    """The function let the error fail it: Spark never recorded micro-batch 0, and the restarted query
    (run r2) wrote it again, into the epoch's nodes the failed write made."""
    assert pipe.task("r1", 0, 0, range(5))
    pipe.registry.record_failed_write("r1", 0, "the write of micro-batch 0 to app app failed (boom)")
    for p in range(2):
        assert pipe.task("r2", 0, p, range(10 * p, 10 * p + 10))
    pipe.barrier(0, "r2")
    report = pipe.coordinator().reconcile()
    assert report.ok and EpochCommitted(QUERY, 0, "r2", ("r2.0.0.0", "r2.0.1.0")) in report.records
    assert AttemptAborted(QUERY, 0, "r1.0.0.0", AbortReason.SUPERSEDED) in report.records
    assert count_rows(range(20), ids_out(pipe)).exact and pipe.watermark() == 0


def test_a_damaged_failed_write_record_is_named_and_recover_changes_nothing(pipe, zk_server, zk_root, capsys):
    assert pipe.task("r1", 0, 0, range(3))
    pipe.barrier(0, "r1")
    path = f"{pipe.qp.failed_writes(0)}/r1"
    pipe.zk.create(path, b'{"error": 7}', makepath=True)
    code = cli.main(["recover", "--zk", zk_server.hosts, "--root", zk_root, "--app", "app"])
    err = capsys.readouterr().err
    assert code == 2 and path in err and "is not a string" in err and "Traceback" not in err
    assert pipe.record(0).state is EpochState.OPEN and pipe.watermark() == -1 and ids_out(pipe) == []
