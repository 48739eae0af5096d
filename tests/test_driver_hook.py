"""The driver hook in real local Spark: no Python callbacks to hang on, and no silent stall."""

from __future__ import annotations

import os
import resource

import pytest
from pyspark.errors import StreamingQueryException

from coordinator.app import AppCoordinator
from coordinator.report import EpochCommitted, EpochSkipped, SkipReason
from coordinator.runs import RunRecord
from coordinator.zk import read_json
from examples.file_sink_query import FaultyFileSink, start_query, write_input
from sinks.files import FileSink, read_committed_rows
from tests.waiting import wait_until
from twophase.checkpoint import highest_commit
from twophase.signing import Signer, load_secret
from twophase.spark import TwoPhaseSink
from twophase.spark.driver import HookFailed
from twophase.spark.publisher import ProgressPublisher
from twophase.supervisor import Supervision
from twophase.verify import count_rows

pytestmark = pytest.mark.spark

# py4j's callback server select()s its sockets and dies on a descriptor >= 1024 (docs/spark-facts.md).
DESCRIPTORS = 1100


@pytest.fixture
def many_descriptors():
    """Hold 1,100 open descriptors in this (the driver's) process for the test's duration."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = DESCRIPTORS + 512
    if soft < needed:
        if hard != resource.RLIM_INFINITY and hard < needed:
            pytest.fail(f"the descriptor limit ({hard}) is below {needed}: cannot run this test")
        resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))
    fds = [os.open(os.devnull, os.O_RDONLY) for _ in range(DESCRIPTORS)]
    try:
        assert max(fds) >= 1024
        yield fds
    finally:
        for fd in fds:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_query_runs_to_the_end_with_1100_descriptors_open_in_the_driver(spark, zk_server, zk_root, tmp_path,
                                                                       many_descriptors):
    for b in range(3):
        write_input(str(tmp_path / "in"), b, range(b * 20, (b + 1) * 20))
    with TwoPhaseSink(FaultyFileSink(str(tmp_path / "out"), fail_rate=0.3), app="fds", zk=zk_server.hosts,
                      root=zk_root, spark=spark) as writer:
        query = start_query(spark, writer, str(tmp_path / "in"), str(tmp_path / "ck"))
        query.awaitTermination()
        assert writer.await_committed(query, timeout=120) == 2
    report = count_rows(range(60), [r["id"] for r in read_committed_rows(str(tmp_path / "out"))])
    assert report.exact, report


def test_a_publisher_failing_for_good_stops_the_query_with_its_cause(spark, zk, zk_server, zk_root, tmp_path,
                                                                     monkeypatch):
    publish = ProgressPublisher.publish

    def publish_then_fail(self):
        publish(self)
        if any(run.published for run in self.runs.values()):  # once a run is there to halt
            raise RuntimeError("injected publisher failure")

    monkeypatch.setattr(ProgressPublisher, "publish", publish_then_fail)
    write_input(str(tmp_path / "in"), 0, range(10))
    quick = Supervision(attempts=3, first_backoff=0.01, max_backoff=0.05)
    with TwoPhaseSink(FileSink(str(tmp_path / "out")), app="halts", zk=zk_server.hosts, root=zk_root,
                      supervision=quick, spark=spark) as writer:
        query = (spark.readStream.schema("id LONG, batch LONG, payload STRING").json(str(tmp_path / "in"))
                 .writeStream.foreach(writer).option("checkpointLocation", str(tmp_path / "ck"))
                 .trigger(processingTime="100 milliseconds").start())
        try:
            halted = writer.paths.query(str(query.id)).halted(str(query.runId))
            wait_until(lambda: zk.exists(halted), timeout=120, what="the hook to halt the run")
            assert b"injected publisher failure" in zk.get(halted)[0]
            with pytest.raises(HookFailed, match="progress publisher failed for good"):
                writer.await_committed(query, timeout=60)
            write_input(str(tmp_path / "in"), 1, range(10, 20))  # the next batch's tasks refuse
            with pytest.raises(StreamingQueryException, match="injected publisher failure"):
                query.awaitTermination(120)
        finally:
            query.stop()
    # Nothing of the refused batch became visible.
    assert {r["id"] for r in read_committed_rows(str(tmp_path / "out"))} <= set(range(10))


def test_a_hook_closed_under_a_running_query_halts_its_run_and_one_closed_after_does_not(spark, zk, zk_server,
                                                                                         zk_root, tmp_path):
    write_input(str(tmp_path / "in"), 0, range(10))
    writer = TwoPhaseSink(FileSink(str(tmp_path / "out")), app="closes", zk=zk_server.hosts, root=zk_root,
                          spark=spark)
    query = (spark.readStream.schema("id LONG, batch LONG, payload STRING").json(str(tmp_path / "in"))
             .writeStream.foreach(writer).option("checkpointLocation", str(tmp_path / "ck"))
             .trigger(processingTime="100 milliseconds").start())
    try:
        wait_until(lambda: writer.await_committed(query, timeout=120) == 0, timeout=120, what="epoch 0 committed")
        halted = writer.paths.query(str(query.id)).halted(str(query.runId))
        writer.close()  # phase two stops with it: the run must not pre-commit what nothing would commit
        assert b"closed in the driver while its query was still running" in zk.get(halted)[0]
        write_input(str(tmp_path / "in"), 1, range(10, 20))
        with pytest.raises(StreamingQueryException, match="closed in the driver"):
            query.awaitTermination(120)
    finally:
        query.stop()
    write_input(str(tmp_path / "in"), 2, range(20, 30))
    with TwoPhaseSink(FileSink(str(tmp_path / "out2")), app="closes-after", zk=zk_server.hosts, root=zk_root,
                      spark=spark) as after:
        ended = start_query(spark, after, str(tmp_path / "in"), str(tmp_path / "ck2"))
        ended.awaitTermination()
        after.await_committed(ended, timeout=120)
    assert not zk.exists(after.paths.query(str(ended.id)).halted(str(ended.runId)))


def start_async_query(spark, writer, tmp_path, **read_options):
    """A foreach query over tmp_path/in with async progress tracking, whose logs are written once in 10 minutes."""
    return (spark.readStream.schema("id LONG, batch LONG, payload STRING").options(**read_options)
            .json(str(tmp_path / "in"))
            .writeStream.foreach(writer).option("checkpointLocation", str(tmp_path / "ck"))
            .option("asyncProgressTrackingEnabled", "true")
            .option("asyncProgressTrackingCheckpointIntervalMs", "600000")
            .trigger(processingTime="100 milliseconds").start())


def test_a_query_with_async_progress_tracking_is_refused_before_spark_could_run_a_committed_batch_again(
        spark, zk, zk_server, zk_root, tmp_path):
    """Spark allows async progress tracking with foreach sinks. Such a run records batches as done in memory and
    writes its checkpoint's logs once an interval: a restart could run them again with other rows. The hook
    halts it at its first poll, naming the option, and publishes no barrier from Spark's memory."""
    write_input(str(tmp_path / "in"), 0, range(10))
    with TwoPhaseSink(FileSink(str(tmp_path / "out")), app="async", zk=zk_server.hosts, root=zk_root,
                      spark=spark) as writer:
        query = start_async_query(spark, writer, tmp_path)
        try:
            qp = writer.paths.query(str(query.id))
            wait_until(lambda: zk.exists(qp.halted(str(query.runId))), timeout=120, what="the hook to halt the run")
            assert b"asyncProgressTrackingEnabled" in zk.get(qp.halted(str(query.runId)))[0]
            with pytest.raises(ValueError, match="async progress tracking"):
                writer.await_committed(query, timeout=60)
            # Batch 0's tasks refuse to open; had they opened before the first poll, batch 1's refuse.
            write_input(str(tmp_path / "in"), 1, range(10, 20))
            with pytest.raises(StreamingQueryException, match="asyncProgressTrackingEnabled"):
                query.awaitTermination(120)
            assert read_json(zk, qp.barrier, None) is None
        finally:
            query.stop()
    # Nothing, or batch 0 once Spark's checkpoint held it (commits/0 on disk: a restart does not run it again).
    visible = {r["id"] for r in read_committed_rows(str(tmp_path / "out"))}
    assert visible == set() or (visible == set(range(10)) and (tmp_path / "ck" / "commits" / "0").exists())


def test_a_later_epoch_of_an_async_run_proves_nothing_even_if_the_halt_came_too_late(
        spark, zk, zk_server, zk_root, tmp_path, monkeypatch):
    """The halt above needs the run's first task to have opened: until then a second micro-batch of an async run
    could begin. Its epoch must not prove the first complete, as it would for a run that writes ``commits/N``
    before the next batch starts: the coordinator takes a later epoch as proof only from a run the driver hook
    vetted. Here the hook never halts (its halt is disabled), so the async run writes six batches."""
    monkeypatch.setattr(ProgressPublisher, "_halt_run", lambda self, run: None)
    for batch in range(6):
        write_input(str(tmp_path / "in"), batch, range(batch * 10, batch * 10 + 10))
    with TwoPhaseSink(FileSink(str(tmp_path / "out")), app="late", zk=zk_server.hosts, root=zk_root,
                      coordinator="daemon", spark=spark) as writer:
        query = start_async_query(spark, writer, tmp_path, maxFilesPerTrigger=1)
        try:
            qp = writer.paths.query(str(query.id))
            wait_until(lambda: zk.exists(qp.epoch(5)), timeout=120, what="the async run to begin batch 5")
            wait_until(lambda: RunRecord.read(zk, qp.run(str(query.runId))), timeout=60,
                       what="the hook to record the run")
            assert RunRecord.read(zk, qp.run(str(query.runId))).in_order is False
            app = AppCoordinator(zk, zk_root, "late", Signer(load_secret()), "test")
            try:
                app.acquire()
                before = highest_commit(str(tmp_path / "ck"))
                report = app.reconcile()
                after = highest_commit(str(tmp_path / "ck"))
            finally:
                app.close()
            assert after < 4  # the async log kept batches 4 and 5 in memory: epochs 0-4 all had a next epoch
            # Every epoch up to the highest commits/N the pass could have seen is committed, and none above it.
            committed = [r.epoch for r in report.records if isinstance(r, EpochCommitted)]
            assert committed == list(range(len(committed))) and before <= len(committed) - 1 <= after
            assert EpochSkipped(str(query.id), len(committed), SkipReason.INCOMPLETE) in report.records
        finally:
            query.stop()
