"""Phase two against a real ZooKeeper, with the real FileSink, without Spark."""

from __future__ import annotations

import os
import re
import shutil
import threading
from dataclasses import replace

import pytest

from coordinator.app import PassOptions
from coordinator.fence import Fenced
from coordinator.precommits import PrecommitRegistry
from coordinator.report import (
    AbortReason,
    AttemptAborted,
    AttemptCleanedUp,
    EpochBlocked,
    EpochCommitted,
    EpochSkipped,
    Operation,
    OperationFailed,
    SkipReason,
)
from coordinator.state import EpochRecord, EpochState
from coordinator.zk import RecordError, dump, read_json
from sinks.files import FileSink
from tests.harness import QUERY, Pipeline, ids_out, stage
from tests.test_cli import fake_checkpoint
from twophase.signing import SignatureError
from twophase.sink import AbortFailed, CommitFailed, TxnContext
from twophase.states import IllegalTransition
from twophase.verify import count_rows


def records_of(report, kind):
    return [r for r in report.records if isinstance(r, kind)]


@pytest.fixture
def pipe(zk, zk_root, tmp_path):
    return Pipeline(zk, zk_root, FileSink(str(tmp_path / "out")))


def test_nothing_visible_until_the_barrier(pipe):
    pipe.task("r1", 0, 0, range(0, 10))
    pipe.task("r1", 0, 1, range(10, 20))
    app = pipe.coordinator()
    assert app.reconcile().records == (EpochSkipped(QUERY, 0, SkipReason.INCOMPLETE),)
    assert ids_out(pipe) == [] and pipe.watermark() == -1
    pipe.barrier(0, "r1")
    report = app.reconcile()
    assert report.ok and report.records == (EpochCommitted(QUERY, 0, "r1", ("r1.0.0.0", "r1.0.1.0")),)
    assert count_rows(range(20), ids_out(pipe)).exact
    assert pipe.watermark() == 0 and pipe.record(0).state is EpochState.COMMITTED


def test_a_later_epoch_proves_the_earlier_one_complete(pipe):
    pipe.task("r1", 0, 0, range(10))
    pipe.task("r1", 1, 0, range(10, 20))
    pipe.coordinator().reconcile()
    assert count_rows(range(10), ids_out(pipe)).exact and pipe.watermark() == 0


def test_a_later_epoch_proves_nothing_until_the_driver_recorded_its_run_as_in_order(zk, zk_root, tmp_path):
    """A run with Spark's async progress tracking begins N + 1 while commits/N may be in Spark's memory only: only a
    run the hook recorded as in order vouches for the epoch before the one it began."""
    with Pipeline(zk, zk_root, FileSink(str(tmp_path / "out")), records_runs=False) as pipe:
        pipe.task("r1", 0, 0, range(10))
        pipe.task("r1", 1, 0, range(10, 20))
        app = pipe.coordinator()
        assert app.reconcile().records == (EpochSkipped(QUERY, 0, SkipReason.INCOMPLETE),)  # not recorded yet
        pipe.record_run("r1", in_order=False)  # refused: async progress tracking
        assert app.reconcile().records == (EpochSkipped(QUERY, 0, SkipReason.INCOMPLETE),)
        assert ids_out(pipe) == [] and pipe.watermark() == -1
        pipe.record_run("r1", in_order=True)
        assert records_of(app.reconcile(), EpochCommitted) == [EpochCommitted(QUERY, 0, "r1", ("r1.0.0.0",))]
        assert count_rows(range(10), ids_out(pipe)).exact


def test_recovery_leaves_an_epoch_undecided_when_only_an_unrecorded_run_began_the_next_and_no_checkpoint_tells(
        zk, zk_root, tmp_path):
    """A query of another SparkSession is never recorded by the hook: its next epoch proves nothing, and Spark
    may have completed the epoch anyway (it never runs it again then). Only its checkpoint can tell, so recovery
    without one must not abort it."""
    with Pipeline(zk, zk_root, FileSink(str(tmp_path / "out")), records_runs=False) as pipe:
        pipe.task("r1", 0, 0, range(10))
        pipe.task("r1", 1, 0, range(10, 20))
        recovering = PassOptions(recovering=True, abort_incomplete=True)
        report = pipe.coordinator().reconcile(recovering)
        [blocked] = report.records
        assert isinstance(blocked, EpochBlocked) and blocked.epoch == 0 and not blocked.failed and not report.ok
        assert "twophase recover --checkpoint" in blocked.error
        assert len(pipe.registry.load(0)) == 1 and ids_out(pipe) == []  # nothing aborted, nothing visible
        checkpoint = fake_checkpoint(tmp_path / "ck", completed=[0])
        report = pipe.coordinator("c2").reconcile(replace(recovering, checkpoint=checkpoint))
        assert records_of(report, EpochCommitted) == [EpochCommitted(QUERY, 0, "r1", ("r1.0.0.0",))]
        assert count_rows(range(10), ids_out(pipe)).exact


def test_every_epoch_up_to_the_highest_commit_in_the_checkpoint_is_complete(zk, zk_root, tmp_path):
    """Async progress tracking writes commits/N once an interval, and a restart resumes after the highest one:
    epochs 1 and 2 below commits/3 are never run again, though their own files were never written."""
    with Pipeline(zk, zk_root, FileSink(str(tmp_path / "out")), records_runs=False) as pipe:
        for epoch in range(5):
            pipe.task("r1", epoch, 0, range(epoch * 10, epoch * 10 + 10))
        checkpoint = fake_checkpoint(tmp_path / "ck", completed=[0, 3])
        report = pipe.coordinator().reconcile(PassOptions(checkpoint=checkpoint))
        assert [r.epoch for r in records_of(report, EpochCommitted)] == [0, 1, 2, 3]
        assert records_of(report, EpochSkipped) == [EpochSkipped(QUERY, 4, SkipReason.INCOMPLETE)]
        assert count_rows(range(40), ids_out(pipe)).exact


def test_a_checkpoint_that_proves_an_epoch_spares_the_look_at_the_next_ones_runs(pipe, tmp_path, monkeypatch):
    """A healthy query's commits/N is on disk before epoch N + 1 begins: its passes read no runs."""
    pipe.task("r1", 0, 0, range(10))
    pipe.task("r1", 1, 0, range(10, 20))
    monkeypatch.setattr(PrecommitRegistry, "runs_begun", lambda self, epoch: pytest.fail("runs of the next epoch read"))
    report = pipe.coordinator().reconcile(PassOptions(checkpoint=fake_checkpoint(tmp_path / "ck", completed=[0])))
    assert [r.epoch for r in records_of(report, EpochCommitted)] == [0]


def unrecorded_epochs(pipe, count):
    """``count`` epochs of run r1, which no hook recorded: none proves the one before it complete."""
    for epoch in range(count):
        pipe.task("r1", epoch, 0, range(epoch * 10, epoch * 10 + 10))


def test_a_checkpoint_this_host_cannot_read_proves_nothing_and_is_warned_about_once(zk, zk_root, tmp_path, caplog):
    with Pipeline(zk, zk_root, FileSink(str(tmp_path / "out")), records_runs=False) as pipe:
        unrecorded_epochs(pipe, 2)
        elsewhere = fake_checkpoint(tmp_path / "on-another-host", completed=[0, 1])
        shutil.rmtree(os.path.join(elsewhere, "commits"))  # what a host without the checkpoint's files sees
        app = pipe.coordinator()
        for _ in range(3):
            assert app.reconcile(PassOptions(checkpoint=elsewhere)).records == (
                EpochSkipped(QUERY, 0, SkipReason.INCOMPLETE),)
        assert [r.getMessage() for r in caplog.records].count(
            f"app app query {QUERY}: cannot read checkpoint {elsewhere}: no directory {elsewhere}/commits; "
            "it proves nothing") == 1
        assert ids_out(pipe) == []


@pytest.mark.parametrize("its_commits", [[], [0, 1, 2]], ids=["fewer", "more"])
def test_a_checkpoint_of_another_query_proves_nothing_for_this_one(zk, zk_root, tmp_path, its_commits):
    """A fresh query started at the recorded path (a new id), or an operator's --checkpoint of another query of
    the app: its commits say nothing of this query's epochs, neither to abort them nor to commit them."""
    with Pipeline(zk, zk_root, FileSink(str(tmp_path / "out")), records_runs=False) as pipe:
        unrecorded_epochs(pipe, 3)
        other = fake_checkpoint(tmp_path / "other", completed=its_commits)
        (tmp_path / "other" / "metadata").write_text('{"id": "another-query"}\n')
        zk.set(pipe.qp.base, dump({"checkpoint": other}))  # as recorded by the publisher
        recovering = PassOptions(recovering=True, abort_incomplete=True)
        for options in (recovering, replace(recovering, checkpoint=other)):
            report = pipe.coordinator().reconcile(options)
            assert [(type(r), r.epoch) for r in report.records] == [(EpochBlocked, 0)]
            assert [len(pipe.registry.load(n)) for n in range(3)] == [1, 1, 1]  # nothing aborted, nothing committed
        mine = fake_checkpoint(tmp_path / "mine", completed=[0, 1])
        report = pipe.coordinator().reconcile(replace(recovering, checkpoint=mine))
        assert [r.epoch for r in records_of(report, EpochCommitted)] == [0, 1]
        assert count_rows(range(20), ids_out(pipe)).exact


def test_an_operators_checkpoint_of_another_query_leaves_this_ones_recorded_checkpoint_in_force(
        zk, zk_root, tmp_path):
    """recover --checkpoint names one query's checkpoint; the app's other queries keep the ones the hook recorded."""
    with Pipeline(zk, zk_root, FileSink(str(tmp_path / "out")), records_runs=False) as pipe:
        unrecorded_epochs(pipe, 3)
        zk.set(pipe.qp.base, dump({"checkpoint": fake_checkpoint(tmp_path / "mine", completed=[0, 1])}))
        other = fake_checkpoint(tmp_path / "other", completed=[])
        (tmp_path / "other" / "metadata").write_text('{"id": "another-query"}\n')
        report = pipe.coordinator().reconcile(PassOptions(recovering=True, abort_incomplete=True, checkpoint=other))
        assert [r.epoch for r in records_of(report, EpochCommitted)] == [0, 1]
        assert count_rows(range(20), ids_out(pipe)).exact


def test_recovery_resumes_a_decided_epoch_whatever_proves_it_now(zk, zk_root, tmp_path):
    """The decision (COMMITTING) was made on a proof; a pass that no longer sees it finishes the epoch, never
    aborts what is left of it."""
    with Pipeline(zk, zk_root, FlakyCommitSink(str(tmp_path / "out"), failures=1), records_runs=False) as pipe:
        unrecorded_epochs(pipe, 2)
        app = pipe.coordinator(attempts=1, max_backoff=0.01)
        report = app.reconcile(PassOptions(checkpoint=fake_checkpoint(tmp_path / "ck", completed=[0])))
        assert not report.ok and pipe.record(0).state is EpochState.COMMITTING
        recovery = pipe.coordinator("c2", attempts=2, max_backoff=0.01)  # its sink's first commit fails too
        report = recovery.reconcile(PassOptions(recovering=True, abort_incomplete=True))
        assert [r.epoch for r in records_of(report, EpochCommitted)] == [0]
        assert count_rows(range(10), ids_out(pipe)).exact


def test_the_runs_that_began_an_epoch_are_read_from_its_intents_winners_and_failed_writes(pipe):
    assert pipe.begin("run.with.dots", 0, 0) is not None  # an intent only
    pipe.task("r2.b", 0, 1, range(10))  # a winner; its intent dropped, as phase two would
    pipe.registry.drop_intent(TxnContext("app", QUERY, "r2.b", 0, 1, 0))
    pipe.registry.record_failed_write("r3.x", 0, "the write of micro-batch 0 failed")
    assert pipe.registry.runs_begun(0) == {"run.with.dots", "r2.b", "r3.x"}
    assert pipe.registry.runs_begun(1) == set()


def test_a_malformed_run_record_is_named_and_nothing_commits(zk, zk_root, tmp_path):
    with Pipeline(zk, zk_root, FileSink(str(tmp_path / "out")), records_runs=False) as pipe:
        pipe.task("r1", 0, 0, range(10))
        pipe.task("r1", 1, 0, range(10, 20))
        zk.set(pipe.qp.run("r1"), dump({"started": 1.0, "driver": "d", "in_order": "yes"}))
        with pytest.raises(RecordError, match=re.escape(pipe.qp.run("r1")) + ".*in_order"):
            pipe.coordinator().reconcile()
        assert ids_out(pipe) == [] and pipe.watermark() == -1


def test_a_retry_after_a_registered_attempt_skips_its_rows(pipe):
    assert pipe.task("r1", 0, 0, range(10), attempt=0) is True
    assert pipe.task("r1", 0, 0, range(10), attempt=1) is None  # finds the winner: no second copy
    pipe.barrier(0, "r1")
    pipe.coordinator().reconcile()
    assert count_rows(range(10), ids_out(pipe)).exact


def test_concurrent_attempts_of_one_partition_commit_once(pipe):
    """DESIGN 4.3: speculation or a zombie; exactly one attempt wins."""
    start = threading.Barrier(4)
    results = []

    def attempt(n):
        start.wait()
        results.append(pipe.precommit(TxnContext("app", QUERY, "r1", 0, 0, n), range(10)))

    threads = [threading.Thread(target=attempt, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == [False, False, False, True]
    pipe.barrier(0, "r1")
    pipe.coordinator().reconcile()
    assert count_rows(range(10), ids_out(pipe)).exact


def test_the_run_that_completed_the_epoch_wins_over_an_earlier_run(pipe):
    """DESIGN 4.9: the re-run partitions differently; only its pre-commits count."""
    pipe.task("r1", 0, 0, range(0, 5))  # r1 died mid-epoch with one of four partitions done
    for p, ids in enumerate([range(0, 10), range(10, 20)]):
        pipe.task("r2", 0, p, ids)      # r2 re-ran epoch 0 with two partitions
    pipe.barrier(0, "r2")
    pipe.coordinator().reconcile()
    assert count_rows(range(20), ids_out(pipe)).exact
    assert pipe.registry.load(0) == []


def test_a_zombie_writer_of_a_dead_run_registering_late_does_not_win(pipe):
    """A task of a killed driver finishes its registration after the new run re-ran the epoch."""
    pipe.registry.ensure_run("r1")
    pipe.task("r1", 0, 0, range(0, 5))
    pipe.registry.ensure_run("r2")
    for p, ids in enumerate([range(0, 10), range(10, 20)]):
        pipe.task("r2", 0, p, ids)
    pipe.task("r1", 0, 1, range(5, 10))  # the zombie, last to register
    pipe.barrier(0, "r2")
    pipe.coordinator().reconcile()
    assert count_rows(range(20), ids_out(pipe)).exact


def test_pre_commits_of_a_replaced_run_are_aborted_before_the_epoch_completes(pipe):
    pipe.task("r1", 0, 0, range(5))
    app = pipe.coordinator()
    pipe.task("r2", 0, 1, range(5, 10))
    app.reconcile()
    assert [a.run for a in pipe.registry.load(0)] == ["r2"]
    assert pipe.watermark() == -1


def test_a_deposed_coordinator_cannot_commit(pipe):
    """DESIGN 4.7: fencing: the old owner fails atomically and touches nothing."""
    pipe.task("r1", 0, 0, range(10))
    pipe.barrier(0, "r1")
    old = pipe.coordinator("old")
    pipe.coordinator("new")
    with pytest.raises(Fenced):
        old.reconcile()
    assert ids_out(pipe) == [] and pipe.record(0).state is EpochState.OPEN


def test_a_successor_finishes_a_decided_epoch(pipe):
    """DESIGN 4.6 (in-process part): the decision survives the owner; commits are idempotent."""
    for p in range(3):
        pipe.task("r1", 0, p, range(p * 10, p * 10 + 10))
    pipe.barrier(0, "r1")
    app = pipe.coordinator("first")
    first = pipe.registry.load(0)[0]
    record = pipe.record(0).transition(EpochState.COMMITTING, run="r1",
                               winners=tuple(a.name for a in pipe.registry.load(0)))
    pipe.zk.set(pipe.qp.epoch(0), record.encode())
    pipe.sink.commit(first.handle)  # the first owner committed one partition, then died
    del app
    pipe.coordinator("second").reconcile()
    assert count_rows(range(30), ids_out(pipe)).exact and pipe.watermark() == 0


class FlakyCommitSink(FileSink):
    def __init__(self, path, failures, permanent=False):
        super().__init__(path)
        self.failures = failures
        self.permanent = permanent

    def commit(self, handle):
        if self.failures > 0:
            self.failures -= 1
            raise (CommitFailed if self.permanent else ConnectionError)("injected commit failure")
        super().commit(handle)


def test_a_failing_commit_is_retried_then_recorded_and_blocks_the_epoch(zk, zk_root, tmp_path):
    pipe = Pipeline(zk, zk_root, FlakyCommitSink(str(tmp_path / "out"), failures=2))
    pipe.task("r1", 0, 0, range(10))
    pipe.barrier(0, "r1")
    pipe.coordinator(attempts=3, max_backoff=0.01).reconcile()
    assert count_rows(range(10), ids_out(pipe)).exact  # third try succeeded

    pipe = Pipeline(zk, zk_root + "-b", FlakyCommitSink(str(tmp_path / "out-b"), failures=100))
    pipe.task("r1", 0, 0, range(10))
    pipe.barrier(0, "r1")
    app = pipe.coordinator(attempts=2, max_backoff=0.01)
    app.sink().failures = 100
    report = app.reconcile()
    assert not report.ok
    assert [(r.attempt, r.operation, r.tries, r.permanent) for r in report.records] == [
        ("r1.0.0.0", Operation.COMMIT, 2, False)]
    assert ids_out(pipe) == [] and pipe.watermark() == -1
    assert pipe.record(0).state is EpochState.COMMITTING
    assert zk.get_children(pipe.qp.failures(0)) == ["r1.0.0.0"]
    app.reconcile()
    assert read_json(zk, f"{pipe.qp.failures(0)}/r1.0.0.0")["count"] == 4  # the tries really made: 2 per pass
    zk.delete(zk_root + "-b", recursive=True)


def test_a_handle_that_can_never_commit_marks_the_epoch_failed_until_retried(zk, zk_root, tmp_path):
    pipe = Pipeline(zk, zk_root, FlakyCommitSink(str(tmp_path / "out"), failures=1, permanent=True))
    pipe.task("r1", 0, 0, range(10))
    pipe.task("r1", 1, 0, range(10, 20))
    app = pipe.coordinator(max_backoff=0.01)
    failed = app.reconcile()
    assert [(r.operation, r.tries, r.permanent) for r in failed.records] == [(Operation.COMMIT, 1, True)]
    assert read_json(pipe.zk, f"{pipe.qp.failures(0)}/r1.0.0.0")["count"] == 1  # CommitFailed is not retried
    assert pipe.record(0).state is EpochState.FAILED and pipe.watermark() == -1
    blocked = app.reconcile()  # stays failed, later epochs wait
    assert blocked.records == (EpochBlocked(QUERY, 0, "r1.0.0.0: injected commit failure"),) and not blocked.ok
    retried = app.reconcile(PassOptions(retry_failed=True))  # the operator fixed the cause
    assert retried.ok and records_of(retried, EpochCommitted) == [EpochCommitted(QUERY, 0, "r1", ("r1.0.0.0",))]
    assert count_rows(range(10), ids_out(pipe)).exact and pipe.watermark() == 0


class CommittedBehindOurBackSink(FileSink):
    """A sink whose loser handles turn out committed already: abort can only refuse."""

    def abort(self, handle):
        raise AbortFailed(f"{handle.pending} was committed already")


def test_an_abort_refused_because_committed_is_not_retried_and_marks_the_epoch_failed(zk, zk_root, tmp_path):
    pipe = Pipeline(zk, zk_root, CommittedBehindOurBackSink(str(tmp_path / "out")))
    speculative = pipe.begin("r1", 0, 0, attempt=1)
    pipe.task("r1", 0, 0, range(10))
    with pytest.raises(AbortFailed):  # the loser's own abort, in its task: its pre-commit stays registered
        pipe.finish(speculative, range(10))
    pipe.barrier(0, "r1")
    report = pipe.coordinator(max_backoff=0.01).reconcile()
    assert [(r.attempt, r.operation, r.tries, r.permanent) for r in report.records
            if isinstance(r, OperationFailed)] == [("r1.0.0.1", Operation.ABORT, 1, True)]
    assert pipe.record(0).state is EpochState.FAILED and pipe.watermark() == -1


class ConcurrentCommitSink(FileSink):
    """Every commit waits at a barrier of ``commit_concurrency`` parties: sequential commits would break it."""

    commit_concurrency = 4

    def __init__(self, path, failing_partition=None):
        super().__init__(path)
        self.failing_partition = failing_partition
        self.__setstate__(self.__dict__)

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k != "barrier"}

    def __setstate__(self, state):
        self.__dict__.update(state, barrier=threading.Barrier(self.commit_concurrency, timeout=10))

    def commit(self, handle):
        self.barrier.wait()
        if f"-{self.failing_partition:05d}-" in handle.final:
            raise ConnectionError("injected commit failure")
        super().commit(handle)


def test_commits_of_one_epoch_run_concurrently_up_to_the_sinks_limit(zk, zk_root, tmp_path):
    pipe = Pipeline(zk, zk_root, ConcurrentCommitSink(str(tmp_path / "out"), failing_partition=-1))
    for partition in range(8):
        pipe.task("r1", 0, partition, range(partition * 10, partition * 10 + 10))
    pipe.barrier(0, "r1")
    pipe.coordinator().reconcile()
    assert count_rows(range(80), ids_out(pipe)).exact and pipe.watermark() == 0


def test_one_failing_commit_among_concurrent_ones_holds_the_epoch_and_is_retried_alone(zk, zk_root, tmp_path):
    pipe = Pipeline(zk, zk_root, ConcurrentCommitSink(str(tmp_path / "out"), failing_partition=5))
    for partition in range(8):
        pipe.task("r1", 0, partition, range(partition * 10, partition * 10 + 10))
    pipe.barrier(0, "r1")
    app = pipe.coordinator(attempts=1)
    app.reconcile()
    assert pipe.watermark() == -1 and pipe.record(0).state is EpochState.COMMITTING
    assert sorted(ids_out(pipe)) == [i for i in range(80) if not 50 <= i < 60]
    assert [a.name for a in pipe.registry.load(0)] == ["r1.0.5.0"]  # only the failed one is left to do
    sink = app.sink()
    sink.failing_partition, sink.barrier = -1, threading.Barrier(1)
    app.reconcile()
    assert count_rows(range(80), ids_out(pipe)).exact and pipe.watermark() == 0


def pending_files(pipe):
    pending = os.path.join(pipe.sink.path, "_pending")
    return sorted(os.listdir(pending)) if os.path.isdir(pending) else []


def test_an_attempt_killed_before_registering_is_cleaned_up_when_its_epoch_commits(pipe):
    dead = TxnContext("app", QUERY, "r1", 0, 1, 0)
    pipe.registry.intend(dead)
    pipe.sink.pre_commit(stage(pipe.sink, dead, [{"id": 999}]))  # then the task is killed: no registration
    pipe.task("r1", 0, 0, range(10))
    pipe.task("r1", 0, 1, range(10, 20), attempt=1)  # Spark's retry
    assert pending_files(pipe) == ["r1.0.0.0.jsonl", "r1.0.1.0.jsonl", "r1.0.1.1.jsonl"]
    app = pipe.coordinator()
    assert records_of(app.reconcile(PassOptions(dry_run=True)), AttemptCleanedUp) == []
    assert len(pending_files(pipe)) == 3  # nothing settled yet: the dead attempt might still be running
    pipe.barrier(0, "r1")
    report = app.reconcile()
    assert records_of(report, AttemptCleanedUp) == [AttemptCleanedUp(QUERY, 0, "r1.0.1.0")]
    assert count_rows(range(20), ids_out(pipe)).exact and pending_files(pipe) == []
    assert pipe.zk.get_children(pipe.qp.intents(0)) == []


def test_an_unregistered_attempt_that_began_after_the_commit_is_cleaned_up_by_gc(pipe):
    pipe.task("r1", 0, 0, range(10))
    pipe.barrier(0, "r1")
    app = pipe.coordinator(retain_epochs=1)
    app.reconcile()
    zombie = TxnContext("app", QUERY, "r0", 0, 0, 0)
    pipe.registry.intend(zombie)
    pipe.sink.pre_commit(stage(pipe.sink, zombie, [{"id": 999}]))
    for epoch in (1, 2):
        pipe.task("r1", epoch, 0, range(epoch * 10, epoch * 10 + 10))
        pipe.barrier(epoch, "r1")
        app.reconcile()
    assert count_rows(range(30), ids_out(pipe)).exact and pending_files(pipe) == []
    assert not pipe.zk.exists(pipe.qp.epoch(0))


DEPOSED = {"calls": 0, "after": 0, "deposed": threading.Event(), "on_first_commit": None}


class DeposingSink(FileSink):
    """The first commit deposes the committing coordinator; every other commit waits until that is
    done, so those that run are exactly the ones a deposed coordinator lets through."""

    commit_concurrency = 2

    def commit(self, handle):
        DEPOSED["calls"] += 1
        if DEPOSED["calls"] == 1:
            DEPOSED["on_first_commit"]()
            DEPOSED["deposed"].set()
        else:
            assert DEPOSED["deposed"].wait(60), "the first commit never finished deposing its coordinator"
            DEPOSED["after"] += 1
        super().commit(handle)


def test_a_coordinator_deposed_mid_epoch_stops_committing_concurrently(zk, zk_root, tmp_path):
    pipe = Pipeline(zk, zk_root, DeposingSink(str(tmp_path / "out")))
    for partition in range(16):
        pipe.task("r1", 0, partition, range(partition * 10, partition * 10 + 10))
    pipe.barrier(0, "r1")
    old = pipe.coordinator("old")
    DEPOSED.update(calls=0, after=0, deposed=threading.Event(), on_first_commit=lambda: pipe.coordinator("new"))
    with pytest.raises(Fenced):
        old.reconcile()
    # Once deposed, at most the commit its other thread had already begun runs: none starts after.
    assert DEPOSED["after"] <= DeposingSink.commit_concurrency - 1
    DEPOSED["on_first_commit"] = lambda: None
    successor = pipe.coordinator("successor")
    successor.reconcile()
    assert count_rows(range(160), ids_out(pipe)).exact and pipe.watermark() == 0


class CleanupFailsSink(FileSink):
    cleanup_works = False

    def abort_unregistered(self, ctx):
        if not self.cleanup_works:
            raise ConnectionError("injected cleanup failure")
        super().abort_unregistered(ctx)


def test_a_failing_cleanup_of_a_dead_attempt_does_not_hold_back_the_epoch(zk, zk_root, tmp_path):
    pipe = Pipeline(zk, zk_root, CleanupFailsSink(str(tmp_path / "out")))
    dead = TxnContext("app", QUERY, "r1", 0, 1, 0)
    pipe.registry.intend(dead)
    pipe.sink.pre_commit(stage(pipe.sink, dead, [{"id": 999}]))
    pipe.task("r1", 0, 0, range(10))
    pipe.task("r1", 0, 1, range(10, 20), attempt=1)
    pipe.task("r1", 1, 0, range(20, 30))
    pipe.barrier(1, "r1")
    app = pipe.coordinator(attempts=1)
    report = app.reconcile()
    assert [(r.epoch, r.attempt, r.operation) for r in records_of(report, OperationFailed)] == [
        (0, "r1.0.1.0", Operation.CLEANUP)]
    assert [r.epoch for r in records_of(report, EpochCommitted)] == [0, 1] and not report.ok
    assert pipe.watermark() == 1 and count_rows(range(30), ids_out(pipe)).exact
    assert pending_files(pipe) == ["r1.0.1.0.jsonl"]  # still there, and retried on the next passes
    app.sink().cleanup_works = True
    assert app.reconcile().records == (AttemptCleanedUp(QUERY, 0, "r1.0.1.0"),)
    assert pending_files(pipe) == []


def test_committed_epochs_are_garbage_collected_beyond_retention(pipe):
    for epoch in range(6):
        pipe.task("r1", epoch, 0, range(epoch * 10, epoch * 10 + 10))
    pipe.barrier(5, "r1")
    app = pipe.coordinator(retain_epochs=2)
    app.reconcile()
    app.reconcile()
    assert pipe.watermark() == 5
    assert [int(n) for n in sorted(pipe.zk.get_children(pipe.qp.epochs))] == [4, 5]
    assert count_rows(range(60), ids_out(pipe)).exact


def test_a_tampered_handle_is_refused_and_nothing_commits(pipe):
    pipe.task("r1", 0, 0, range(10))
    pipe.barrier(0, "r1")
    name = pipe.zk.get_children(pipe.qp.attempts(0))[0]
    path = f"{pipe.qp.attempts(0)}/{name}"
    raw, _ = pipe.zk.get(path)
    pipe.zk.set(path, raw[:-1] + bytes([raw[-1] ^ 1]))
    with pytest.raises(SignatureError, match="bad signature"):
        pipe.coordinator().reconcile()
    assert ids_out(pipe) == [] and pipe.watermark() == -1


def test_phase_two_survives_a_zookeeper_restart(pipe, zk_server):
    """DESIGN 4.8: state is in ZooKeeper, so a restart loses nothing."""
    pipe.task("r1", 0, 0, range(10))
    zk_server.restart()
    pipe.task("r1", 0, 1, range(10, 20))
    pipe.barrier(0, "r1")
    pipe.coordinator().reconcile()
    assert count_rows(range(20), ids_out(pipe)).exact


@pytest.mark.parametrize("made", ["attempts", "epoch"])
def test_registration_wins_while_another_task_is_halfway_through_creating_the_epoch(pipe, made):
    """Regression: the first tasks of an epoch race to create its znodes. A task that finds
    attempts/ created but winners/ not yet (an earlier version's task between its two ensure_path
    calls), or the epoch node without its children (made by hand), must still record its intent and
    win its partition, not take itself for a loser."""
    pipe.zk.ensure_path(pipe.qp.attempts(0) if made == "attempts" else pipe.qp.epoch(0))
    assert pipe.task("r1", 0, 1, range(10)) is True
    pipe.barrier(0, "r1")
    pipe.coordinator().reconcile()
    assert count_rows(range(10), ids_out(pipe)).exact


def test_a_pass_reports_what_it_aborted_and_why(pipe):
    pipe.registry.ensure_run("r0")
    pipe.task("r0", 0, 0, range(5))                                 # a run that died mid-epoch
    pipe.registry.ensure_run("r1")
    pipe.task("r1", 0, 0, range(10))
    loser = TxnContext("app", QUERY, "r1", 0, 0, 1)                  # a speculative copy that lost and died
    pipe.registry.intend(loser)
    assert not pipe.registry.register(loser, pipe.sink.pre_commit(stage(pipe.sink, loser, [{"id": 0}])))
    pipe.barrier(0, "r1")
    app = pipe.coordinator()
    dry = app.reconcile(PassOptions(dry_run=True))
    assert dry.dry_run and all(r.dry_run for r in dry.records)
    report = app.reconcile()
    assert sorted(records_of(report, AttemptAborted), key=lambda r: r.attempt) == [
        AttemptAborted(QUERY, 0, "r0.0.0.0", AbortReason.SUPERSEDED),
        AttemptAborted(QUERY, 0, "r1.0.0.1", AbortReason.LOST)]
    assert records_of(report, EpochCommitted) == [EpochCommitted(QUERY, 0, "r1", ("r1.0.0.0",))]
    assert app.reconcile().records == ()  # nothing left to do
    assert count_rows(range(10), ids_out(pipe)).exact and pending_files(pipe) == []


@pytest.mark.parametrize("told", ["checkpoint", "abort-unproven"])
def test_recovery_aborts_every_pre_commit_of_an_epoch_spark_never_completed(pipe, tmp_path, told):
    """Told by the query's checkpoint (no commits/0), or by the operator (--abort-unproven)."""
    pipe.task("r1", 0, 0, range(10))
    options = (PassOptions(recovering=True, abort_incomplete=True, checkpoint=fake_checkpoint(tmp_path / "ck", []))
               if told == "checkpoint" else
               PassOptions(recovering=True, abort_incomplete=True, abort_unproven=frozenset({QUERY})))
    report = pipe.coordinator().reconcile(options)
    aborted, skipped = ((AbortReason.INCOMPLETE, SkipReason.INCOMPLETE) if told == "checkpoint" else
                        (AbortReason.UNPROVEN, SkipReason.UNPROVEN))
    assert report.records == (AttemptAborted(QUERY, 0, "r1.0.0.0", aborted), EpochSkipped(QUERY, 0, skipped))
    assert pipe.registry.load(0) == [] and pending_files(pipe) == []


@pytest.mark.parametrize("recorded", ["no checkpoint", "one on another host"])
def test_recovery_leaves_a_last_epoch_nothing_proves_either_way_undecided(pipe, tmp_path, recorded):
    """No barrier, no later epoch, no checkpoint readable here: Spark may have written commits/0 just as the driver
    died, and aborting would lose the epoch's rows for good (a restart never runs it again)."""
    pipe.task("r1", 0, 0, range(10))
    pipe.task("r1", 0, 1, [])  # a registered empty pre-commit of the same epoch
    if recorded != "no checkpoint":
        pipe.zk.set(pipe.qp.base, dump({"checkpoint": str(tmp_path / "elsewhere")}))
    report = pipe.coordinator().reconcile(PassOptions(recovering=True, abort_incomplete=True))
    [blocked] = report.records
    assert (type(blocked), blocked.epoch, blocked.failed) == (EpochBlocked, 0, False) and not report.ok
    assert "--checkpoint DIR" in blocked.error and "--abort-unproven" in blocked.error
    assert len(pipe.registry.load(0)) == 2 and len(pending_files(pipe)) == 1  # nothing aborted
    pipe.barrier(0, "r1")  # what the driver would have published had it lived a poll longer
    pipe.coordinator().reconcile(PassOptions(recovering=True, abort_incomplete=True))
    assert count_rows(range(10), ids_out(pipe)).exact


@pytest.mark.parametrize("told", ["checkpoint", "abort-unproven"])
def test_recovery_goes_on_past_an_epoch_spark_never_completed_to_the_later_ones(zk, zk_root, tmp_path, told):
    """None of them can be complete if the first is not: every one is aborted in one pass, none left open."""
    with Pipeline(zk, zk_root, FileSink(str(tmp_path / "out")), records_runs=False) as pipe:
        for epoch in range(3):
            pipe.task("r1", epoch, 0, range(epoch * 10, epoch * 10 + 10))
        options = PassOptions(recovering=True, abort_incomplete=True)
        options = (replace(options, checkpoint=fake_checkpoint(tmp_path / "ck", [])) if told == "checkpoint" else
                   replace(options, abort_unproven=frozenset({QUERY})))
        report = pipe.coordinator().reconcile(options)
        assert [r.epoch for r in records_of(report, AttemptAborted)] == [0, 1, 2] and report.ok
        assert [len(pipe.registry.load(n)) for n in range(3)] == [0, 0, 0] and pending_files(pipe) == []


def test_recovery_aborts_superseded_pre_commits_before_it_waits_for_the_latest_runs(pipe):
    """r2 began epoch 0 after r1 registered it: r1's pre-commit is superseded whatever Spark did, and goes; r2's
    registered one is what may be complete, and waits."""
    pipe.task("r1", 0, 0, range(10))
    pipe.task("r2", 0, 0, range(10))
    report = pipe.coordinator().reconcile(PassOptions(recovering=True, abort_incomplete=True))
    assert records_of(report, AttemptAborted) == [AttemptAborted(QUERY, 0, "r1.0.0.0", AbortReason.SUPERSEDED)]
    assert [type(r) for r in report.records][-1] is EpochBlocked and not report.ok
    assert [a.name for a in pipe.registry.load(0)] == ["r2.0.0.0"]


def test_recovery_refuses_a_checkpoint_copy_the_readable_recorded_checkpoint_contradicts(pipe, tmp_path):
    """A copy taken before Spark wrote commits/0 would have epoch 0 aborted; the recorded checkpoint says it is
    complete."""
    pipe.task("r1", 0, 0, range(10))
    pipe.zk.set(pipe.qp.base, dump({"checkpoint": fake_checkpoint(tmp_path / "recorded", [0])}))
    stale = fake_checkpoint(tmp_path / "copy", [])
    report = pipe.coordinator().reconcile(PassOptions(recovering=True, abort_incomplete=True, checkpoint=stale))
    [blocked] = report.records
    assert isinstance(blocked, EpochBlocked) and "copy must be made after the query stopped" in blocked.error
    assert len(pipe.registry.load(0)) == 1
    report = pipe.coordinator().reconcile(PassOptions(recovering=True, abort_incomplete=True))
    assert [r.epoch for r in records_of(report, EpochCommitted)] == [0] and count_rows(range(10), ids_out(pipe)).exact


@pytest.mark.parametrize("vouched", [False, True], ids=["waits", "abort-unproven"])
def test_in_recovery_any_later_epoch_begun_in_order_proves_every_one_below_it(zk, zk_root, tmp_path, vouched):
    """r1 (not recorded in order) began epochs 0 and 1; r2, recorded in order, began 2: commits/1 was on disk, and
    no restart runs 0 or 1 again. Only epoch 2 is unproven; --abort-unproven aborts it and nothing below it."""
    with Pipeline(zk, zk_root, FileSink(str(tmp_path / "out")), records_runs=False) as pipe:
        pipe.task("r1", 0, 0, range(10))
        pipe.task("r1", 1, 0, range(10, 20))
        pipe.record_run("r2", in_order=True)
        pipe.task("r2", 2, 0, range(20, 30))
        options = PassOptions(recovering=True, abort_incomplete=True,
                              abort_unproven=frozenset({QUERY}) if vouched else frozenset())
        report = pipe.coordinator().reconcile(options)
        assert [r.epoch for r in records_of(report, EpochCommitted)] == [0, 1]
        assert count_rows(range(20), ids_out(pipe)).exact
        if vouched:
            assert records_of(report, AttemptAborted) == [AttemptAborted(QUERY, 2, "r2.2.0.0", AbortReason.UNPROVEN)]
        else:
            assert [(type(r), r.epoch) for r in report.records][-1] == (EpochBlocked, 2)


def test_recovery_refuses_a_checkpoint_copy_older_than_what_the_barrier_proves(pipe, tmp_path):
    """The recorded checkpoint is on another host; the copy, made while the query still ran, lacks commits/1 that
    the driver's barrier shows: it decides nothing, and the query waits, its pre-commits untouched."""
    for epoch in range(3):
        pipe.task("r1", epoch, 0, range(epoch * 10, epoch * 10 + 10))
    pipe.zk.set(pipe.qp.base, dump({"checkpoint": "hdfs://nn/checkpoints/q-1"}))
    pipe.barrier(1, "r1")
    stale = fake_checkpoint(tmp_path / "copy", [0])
    report = pipe.coordinator().reconcile(PassOptions(recovering=True, abort_incomplete=True, checkpoint=stale))
    assert [(type(r), r.epoch) for r in report.records] == [(EpochBlocked, 0)]
    assert "Spark completed batch 1" in report.records[0].error
    assert [len(pipe.registry.load(n)) for n in range(3)] == [1, 1, 1]


def test_recovery_refuses_a_checkpoint_copy_ahead_of_the_readable_recorded_one(pipe, tmp_path):
    """One of the two is not the query's checkpoint as it is now: neither decides."""
    pipe.task("r1", 0, 0, range(10))
    pipe.task("r1", 1, 0, range(10, 20))
    pipe.zk.set(pipe.qp.base, dump({"checkpoint": fake_checkpoint(tmp_path / "recorded", [])}))
    ahead = fake_checkpoint(tmp_path / "copy", [0, 1])
    report = pipe.coordinator().reconcile(PassOptions(recovering=True, abort_incomplete=True, checkpoint=ahead))
    [blocked] = report.records
    assert isinstance(blocked, EpochBlocked) and "one of them is not the query's checkpoint" in blocked.error
    assert [len(pipe.registry.load(n)) for n in range(2)] == [1, 1] and ids_out(pipe) == []


def test_recovery_aborts_what_was_begun_but_never_pre_committed_without_asking(pipe):
    """An epoch with intents only (tasks killed before registering) holds nothing Spark could count as written."""
    assert pipe.begin("r1", 0, 0) is not None
    report = pipe.coordinator().reconcile(PassOptions(recovering=True, abort_incomplete=True))
    assert [type(r) for r in report.records] == [AttemptCleanedUp, EpochSkipped] and report.ok
    assert pipe.zk.get_children(pipe.qp.intents(0)) == []


def test_attempt_and_intent_nodes_are_named_by_the_txn_context():
    ctx = TxnContext("app", QUERY, "run.with.dots", 7, 3, 2)
    assert ctx.name == "run.with.dots.7.3.2"
    assert TxnContext.from_name("app", QUERY, ctx.name) == ctx
    with pytest.raises(ValueError):
        TxnContext.from_name("app", QUERY, "r1.3.0")


def test_registered_nodes_use_the_txn_context_name(pipe):
    ctx = TxnContext("app", QUERY, "r1", 4, 2, 0)
    pipe.registry.intend(ctx)
    assert pipe.zk.get_children(pipe.qp.intents(4)) == [ctx.name]
    pipe.registry.register(ctx, "handle")
    assert pipe.zk.get_children(pipe.qp.attempts(4)) == [ctx.name]
    assert [(a.name, a.run, a.partition, a.attempt) for a in pipe.registry.load(4)] == [("r1.4.2.0", "r1", 2, 0)]


def test_epoch_records_refuse_undeclared_moves():
    committing = EpochRecord().transition(EpochState.COMMITTING, run="r1")
    assert committing.transition(EpochState.FAILED).transition(EpochState.COMMITTING).state is EpochState.COMMITTING
    with pytest.raises(IllegalTransition, match="epoch: open -> committed is not allowed"):
        EpochRecord().transition(EpochState.COMMITTED)
    with pytest.raises(IllegalTransition):
        committing.transition(EpochState.COMMITTED).transition(EpochState.COMMITTING)


def test_a_pass_woken_by_a_watch_skips_a_quiet_query_until_its_watches_fire(pipe):
    from tests.waiting import wait_until

    pipe.task("r1", 0, 0, range(10))
    pipe.barrier(0, "r1")
    app = pipe.coordinator()
    app.prepare()  # watches the query's epochs and barrier
    wait_until(lambda: app._stirs.get(QUERY, 0) >= 2)  # each watch fires once when set
    visited = []
    reconcile_query = app._reconcile_query
    app._reconcile_query = lambda qp, this_pass: (visited.append(qp.query_id), reconcile_query(qp, this_pass))

    app.reconcile(changed_only=True)  # never found quiet yet: visited, epoch 0 committed
    app.reconcile(changed_only=True)  # visited again: finds it quiet
    assert visited == [QUERY, QUERY] and pipe.watermark() == 0
    app.reconcile(changed_only=True)
    assert visited == [QUERY, QUERY]  # skipped: no watch fired
    app.reconcile()
    assert visited == [QUERY] * 3  # a full pass visits every query

    stirs = app._stirs[QUERY]
    pipe.task("r1", 1, 0, range(10, 20))  # epoch 1 appears: proves nothing new (0 is committed)
    pipe.barrier(1, "r1")                 # the barrier completes it
    wait_until(lambda: app._stirs[QUERY] > stirs)
    app.reconcile(changed_only=True)
    assert visited == [QUERY] * 4 and pipe.watermark() == 1
    assert count_rows(range(20), ids_out(pipe)).exact


def test_a_query_waiting_for_spark_to_complete_its_epoch_is_quiet_until_a_watch_fires(pipe):
    """Between batches the loop wakes often (ready hints, other queries): a query whose only pending epoch
    Spark has not completed yet, with nothing of it to clean up, costs those passes no ZooKeeper request."""
    from tests.waiting import wait_until

    pipe.task("r1", 0, 0, range(10))  # no barrier, no checkpoint, no epoch 1: incomplete
    app = pipe.coordinator()
    app.prepare()
    wait_until(lambda: app._stirs.get(QUERY, 0) >= 2)  # each watch fires once when set
    visited = []
    reconcile_query = app._reconcile_query
    app._reconcile_query = lambda qp, this_pass: (visited.append(qp.query_id), reconcile_query(qp, this_pass))

    app.reconcile(changed_only=True)  # visited: epoch 0 is incomplete, nothing to clean up
    app.reconcile(changed_only=True)
    assert visited == [QUERY] and pipe.watermark() == -1  # skipped: nothing can be due before a watch fires
    stirs = app._stirs[QUERY]
    pipe.barrier(0, "r1")
    wait_until(lambda: app._stirs[QUERY] > stirs)
    app.reconcile(changed_only=True)
    assert visited == [QUERY] * 2 and pipe.watermark() == 0
    assert count_rows(range(10), ids_out(pipe)).exact


def test_watches_wake_the_loop_only_for_an_epoch_or_a_barrier_that_can_complete_one(pipe):
    pipe.task("r1", 0, 0, range(10))
    pipe.barrier(0, "r1")
    app = pipe.coordinator()
    app.reconcile()
    assert pipe.watermark() == 0
    app._on_epochs(QUERY, ["0000000000000000000"])                        # first sight: a pass
    app._on_barrier(QUERY, b'{"epoch": 0, "run": "r1"}')                  # committed already: none
    app._on_epochs(QUERY, ["0000000000000000000", "0000000000000000001"])  # proves only 0 complete: none
    app._on_epochs(QUERY, ["0000000000000000001"])                        # one collected: none
    assert app._stirs[QUERY] == 1
    app._on_epochs(QUERY, ["0000000000000000001", "0000000000000000002"])  # proves 1 complete
    app._on_barrier(QUERY, b'{"epoch": 1, "run": "r1"}')                  # above the last commit
    app._on_barrier(QUERY, b"[]")                                         # malformed: the pass reports it
    assert app._stirs[QUERY] == 4


def test_a_dead_attempt_of_a_superseded_run_is_cleaned_up_while_the_new_run_writes_the_epoch(pipe):
    """A task of run r1 killed after its pre-commit, before registering, may hold what r2 writes again (a
    PostgreSQL row lock on a key): its transaction is cleaned up once r2 began the epoch, not only once
    r2 completed it, which it might never do while the lock is held. r2's own running attempt is left alone."""
    pipe.registry.ensure_run("r1")
    dead = TxnContext("app", QUERY, "r1", 0, 0, 0)
    pipe.registry.intend(dead)
    pipe.sink.pre_commit(stage(pipe.sink, dead, [{"id": 999}]))
    running = pipe.begin("r2", 0, 0)  # its intent recorded, its rows being written, nothing registered
    app = pipe.coordinator()
    report = app.reconcile()
    assert records_of(report, AttemptCleanedUp) == [AttemptCleanedUp(QUERY, 0, "r1.0.0.0")]
    assert pending_files(pipe) == [] and pipe.watermark() == -1
    assert pipe.finish(running, range(10))  # its intent was kept: it registers and wins
    pipe.barrier(0, "r2")
    app.reconcile()
    assert pipe.watermark() == 0 and count_rows(range(10), ids_out(pipe)).exact


FORGETTING = {"registry": None}


class ForgettingSink(FileSink):
    """A loser's own task drops its records (``forget``) while the coordinator aborts it too."""

    commit_concurrency = 16  # every attempt of the epoch below at once: one wave

    def abort(self, handle):
        super().abort(handle)
        registry = FORGETTING["registry"]
        loser = next(a for a in registry.load(0) if not a.won)
        registry.forget(TxnContext("app", QUERY, loser.run, 0, loser.partition, loser.attempt))


def test_an_epoch_is_recorded_committed_in_the_multi_op_that_drops_its_attempts_records(zk, zk_root, tmp_path):
    pipe = Pipeline(zk, zk_root, ForgettingSink(str(tmp_path / "out")))
    FORGETTING["registry"] = pipe.registry
    for partition in range(8):
        pipe.task("r1", 0, partition, range(partition * 10, partition * 10 + 10))
    assert pipe.begin("r1", 0, 0, attempt=1) is None  # a speculative copy that finds the winner: skips its rows
    copy = pipe.registry.intend(TxnContext("app", QUERY, "r1", 0, 3, 1))  # one that finished second: a loser
    assert pipe.registry.register(copy, pipe.sink.pre_commit(stage(pipe.sink, copy, [{"id": 999}]))) is False
    pipe.barrier(0, "r1")
    app = pipe.coordinator()
    multi_ops = []
    commit = app.fence.commit
    app.fence.commit = lambda txn: (multi_ops.append(len(txn.operations)), commit(txn))[1]
    report = app.reconcile()
    # The decision, then one multi-op (the loser's records gone meanwhile: it is made again without them):
    # the fence check, the epoch, the watermark and the attempt and intent of each of the 8 winners.
    assert multi_ops[0] == 2 and multi_ops[-1] == 1 + 2 + 2 * 8 and len(multi_ops) == 3
    assert records_of(report, EpochCommitted)[0].epoch == 0 and pipe.watermark() == 0
    assert pipe.zk.get_children(pipe.qp.attempts(0)) == [] and pipe.zk.get_children(pipe.qp.intents(0)) == []
    assert count_rows(range(80), ids_out(pipe)).exact


def test_a_pass_woken_by_a_watch_reads_nothing_the_owner_knows(pipe, tmp_path):
    from tests.waiting import wait_until

    (tmp_path / "ck").mkdir()
    pipe.task("r1", 0, 0, range(10))
    pipe.zk.set(pipe.qp.base, dump({"checkpoint": str(tmp_path / "ck")}))  # as the driver's publisher records it
    pipe.barrier(0, "r1")
    app = pipe.coordinator()
    app.prepare()
    app.reconcile()  # a full pass: reads them all, commits epoch 0
    stirs = app._stirs.get(QUERY, 0)
    pipe.task("r1", 1, 0, range(10, 20))
    pipe.barrier(1, "r1")
    wait_until(lambda: app._stirs[QUERY] > stirs and app._known[QUERY].get("barrier") == 1)
    paths = []
    send = pipe.zk._call
    pipe.zk._call = lambda request, async_object: (paths.append(getattr(request, "path", None)),
                                                   send(request, async_object))[1]
    try:
        report = app.reconcile(changed_only=True)
    finally:
        del pipe.zk._call
    assert records_of(report, EpochCommitted)[0].epoch == 1 and pipe.watermark() == 1
    known = {pipe.paths.queries, pipe.qp.epochs, pipe.qp.watermark, pipe.qp.barrier, pipe.qp.base, pipe.qp.replay}
    # Nor what it needs no request for: the fence before an OPEN epoch's decision (a fenced write), the run
    # nodes when one run wrote the epoch, the slots of a sink that claims none (none held at the last read).
    needless = {pipe.paths.fence, pipe.qp.run("r1"), pipe.qp.slots}
    assert paths and not (known | needless) & set(paths)
    assert count_rows(range(20), ids_out(pipe)).exact


def test_an_epoch_larger_than_the_commit_concurrency_drops_its_records_a_wave_at_a_time(pipe):
    """So that a crash mid-epoch leaves at most a wave of committed attempts with records (replay takes an
    attempt with records for one it may abort)."""
    for partition in range(20):
        pipe.task("r1", 0, partition, range(partition * 10, partition * 10 + 10))
    pipe.barrier(0, "r1")
    app = pipe.coordinator()
    multi_ops = []
    commit = app.fence.commit
    app.fence.commit = lambda txn: (multi_ops.append(len(txn.operations)), commit(txn))[1]
    app.reconcile()
    assert FileSink.commit_concurrency == 8
    # The decision; two waves of 8 attempts (fence check, attempt and intent each); the last 4 with the epoch.
    assert multi_ops == [2, 1 + 2 * 8, 1 + 2 * 8, 1 + 2 + 2 * 4]
    assert pipe.watermark() == 0 and pipe.zk.get_children(pipe.qp.attempts(0)) == []
    assert count_rows(range(200), ids_out(pipe)).exact


def test_an_epoch_found_committed_above_the_known_watermark_is_taken_as_committed(pipe):
    """The multi-op that committed it went through but its answer was lost: the owner's known watermark is
    behind. A pass woken by a watch must not try to commit the epoch again."""
    pipe.task("r1", 0, 0, range(10))
    pipe.barrier(0, "r1")
    app = pipe.coordinator()
    app.prepare()
    app.reconcile()
    assert pipe.watermark() == 0
    app._known[QUERY]["watermark"] = -1  # as if the commit's answer had been lost
    app._committed.pop(QUERY)
    app._quiet_at.clear()
    report = app.reconcile(changed_only=True)
    assert report.ok and records_of(report, EpochCommitted) == []
    assert app._known[QUERY]["watermark"] == 0 and pipe.watermark() == 0
    assert count_rows(range(10), ids_out(pipe)).exact


def test_full_passes_visit_a_settled_query_less_and_less_often_until_its_watch_fires(pipe):
    """An app keeps every query it ever ran; full passes (in case a watch was lost) need not read each one's
    nodes every poll_interval once it has been settled for a while."""
    from coordinator.app import SETTLED_VISITS_MAX
    from tests.waiting import wait_until

    pipe.task("r1", 0, 0, range(10))
    pipe.barrier(0, "r1")
    app = pipe.coordinator()
    app.prepare()
    app.reconcile()  # commits epoch 0
    reads = []
    send = pipe.zk._call
    pipe.zk._call = lambda request, async_object: (reads.append(getattr(request, "path", None)),
                                                   send(request, async_object))[1]
    visited = []
    try:
        for _ in range(2 * SETTLED_VISITS_MAX + 1):
            reads.clear()
            app.reconcile()  # a full pass
            visited.append(int(pipe.qp.watermark in reads))
    finally:
        del pipe.zk._call
    # Found settled, then visited every 2nd, 4th, 8th, 16th full pass, and no less often.
    expected = [1, 1, 0, 1, 0, 0, 0, 1] + [0] * 7 + [1] + [0] * 15 + [1] + [0]
    assert visited == expected[:len(visited)]
    reads.clear()
    pipe.zk._call = lambda request, async_object: (reads.append(getattr(request, "path", None)),
                                                   send(request, async_object))[1]
    try:
        app.reconcile(all_queries=True)  # a pass asked for (await_committed) visits every query
    finally:
        del pipe.zk._call
    assert pipe.qp.watermark in reads
    began = app._began.get(QUERY, 0)
    pipe.task("r1", 1, 0, range(10, 20))  # a run began an epoch: the next full pass visits the query
    wait_until(lambda: app._began.get(QUERY, 0) > began, what="the epochs watch to fire")
    assert records_of(app.reconcile(), EpochSkipped)[0].epoch == 1
    stirs = app._stirs.get(QUERY, 0)
    pipe.barrier(1, "r1")
    wait_until(lambda: app._stirs.get(QUERY, 0) > stirs, what="the barrier watch to fire")
    app.reconcile(changed_only=True)
    assert pipe.watermark() == 1 and count_rows(range(20), ids_out(pipe)).exact
