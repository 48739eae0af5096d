"""The batch path's driver-side check, its ready hint and its options, without Spark (a real ZooKeeper)."""

from __future__ import annotations

import re
import threading

import pytest

from coordinator.app import READY_POLL, AppCoordinator, CommitPolicy, publish_app
from coordinator.layout import AppPaths
from coordinator import zk as zk_module
from coordinator.zk import dump, parse_object, shared_client
from sinks.files import FileSink
from tests.harness import SIGNER, CallCounter, Pipeline, ids_out
from tests.test_cli import fake_checkpoint
from tests.waiting import wait_until
from twophase.signing import Signer
from twophase.spark.host import CoordinatorHost
from twophase.spark.kafka_sink import KAFKA_TWOPHASE, kafka_log_sink
from twophase.spark.waiter import await_watermark
from twophase.supervisor import Supervision
from twophase.spark.sink_options import ExactlyOnce, WriterOptionError, exactly_once
from twophase.spark.stream_sink import (SINK_DIGEST, AttemptReport, DriverHookMissing, SecretMismatch, SinkFormat,
                                        TwoPhaseStreamWriter, await_watched, check_secret, sink_digest)
from twophase.spark.task_context import ContinuousProcessingNotSupported
from twophase.task import PhaseTwoHalted


@pytest.mark.parametrize("extra, message", [
    ({"twophase.commitMode": "eventually"}, "option twophase.commitMode must be one of auto, prepared, classic"),
    ({"twophase.transactionalIdPrefix": "a b"}, "option twophase.transactionalIdPrefix 'a b'"),
])
def test_the_kafka_writers_own_options_are_named_as_the_query_gives_them(extra, message):
    with pytest.raises(WriterOptionError, match=re.escape(message)):
        kafka_log_sink({"kafka.bootstrap.servers": "h:9092", "topic": "t", **extra})
    with pytest.raises(WriterOptionError, match="the writer's twophase options are .*'twophase.commitMode'"):
        exactly_once({"twophase.zk": "h:1", "twophase.app": "a", "twophase.comitMode": "auto"}, also=KAFKA_TWOPHASE)


def test_no_hook_publishing_the_run_fails_the_batch_naming_what_to_do(zk, zk_root):
    query = AppPaths(zk_root, "app").query("q1")
    with pytest.raises(DriverHookMissing, match=r"register\(spark\).*write_stream"):
        await_watched(zk, query, "run-1", "app", timeout=0.2)


def test_a_run_published_while_waiting_passes(zk, zk_root):
    query = AppPaths(zk_root, "app").query("q2")
    waiting = threading.Thread(target=lambda: zk.create(f"{query.run('run-1')}/alive", makepath=True))
    waiting.start()
    await_watched(zk, query, "run-1", "app", timeout=30)
    waiting.join()
    await_watched(zk, query, "run-1", "app", timeout=0)  # remembered: no second wait


def test_a_halted_run_fails_with_its_reason(zk, zk_root):
    query = AppPaths(zk_root, "app").query("q3")
    zk.create(f"{query.run('run-1')}/alive", makepath=True)
    zk.create(query.halted("run-1"), b"the embedded coordinator failed for good", makepath=True)
    with pytest.raises(PhaseTwoHalted, match="failed for good"):
        await_watched(zk, query, "run-1", "app", timeout=30)


def test_a_writer_waits_for_its_apps_sink_until_its_secret_verifies_it(zk, zk_server, zk_root, tmp_path):
    """A first publication in progress (an empty znode), or a restart's hook replacing the last session's sink
    (signed with another secret): the task reads the sink again as it changes. A secret that never verifies
    fails it once the sink stayed unverifiable for replace_wait, naming what to do."""
    where, paths = ExactlyOnce(zk_server.hosts, "secrets", zk_root), AppPaths(zk_root, "secrets")
    secret, other = b"twophase-test-secret-0123456789", Signer(b"the-last-sessions-secret-0123456789")
    with pytest.raises(DriverHookMissing, match=r"no twophase driver hook published app secrets.*register\(spark\)"):
        check_secret(zk, where, secret, timeout=0.2)
    zk.create(paths.sink, b"", makepath=True)
    publishing = threading.Timer(0.2, zk.set, (paths.sink, other.dumps("sink", paths.sink)))
    publishing.start()
    with pytest.raises(SecretMismatch, match="set TWOPHASE_SECRET .* before the SparkSession starts"):
        check_secret(zk, where, secret, timeout=30, replace_wait=0.5)  # the sink is there: no minute's wait
    publishing.join()
    republishing = threading.Timer(0.2, publish_app, (zk, paths, SIGNER, FileSink(str(tmp_path / "out")), "embedded"))
    republishing.start()
    check_secret(zk, where, secret, timeout=30)
    republishing.join()
    zk.set(paths.sink, other.dumps("sink", paths.sink))
    check_secret(zk, where, secret, timeout=0)  # remembered: no second look in this process


@pytest.mark.parametrize("options, message", [
    ({"twophase.app": "a"}, "'twophase.zk' is required"),
    ({"twophase.zk": "h:1"}, "'twophase.app' is required"),
    ({"twophase.zk": "h:1", "twophase.app": "a b"}, "option twophase.app 'a b'"),
    ({"twophase.zk": "h:1", "twophase.app": "a", "twophase.coordinator": "both"}, "coordinator must be one of"),
    ({"twophase.zk": "h:1", "twophase.app": "a", "twophase.root": "rel"}, "root 'rel' must be an absolute"),
    ({"twophase.zk": "h:1", "twophase.app": "a", "twophase.colour": "x"}, r"unknown option\(s\) \['twophase.colour'\]"),
])
def test_bad_exactly_once_options_are_named(options, message):
    with pytest.raises(WriterOptionError, match=message):
        exactly_once(options)


def test_exactly_once_options_match_case_insensitively():
    where = exactly_once({"TwoPhase.ZK": "h:1", "twophase.APP": "a", "twophase.coordinator": "daemon"})
    assert (where.zk, where.app, where.root, where.coordinator) == ("h:1", "a", "/twophase", "daemon")


def counted_host(zk, zk_root, owner: str, *methods: str):
    """An embedded coordinator's loop for app "app", its next full pass a minute away, with a CallCounter on
    each of the coordinator's ``methods``: (coordinator, started host, counters)."""
    coordinator = AppCoordinator(zk, zk_root, "app", SIGNER, owner, CommitPolicy(poll_interval=60.0))
    counters = [CallCounter() for _ in methods]
    for name, counter in zip(methods, counters, strict=True):
        setattr(coordinator, name, counter.wrap(getattr(coordinator, name)))
    host = CoordinatorHost(coordinator, Supervision(), on_give_up=lambda e: None)
    host.start()
    return coordinator, host, counters


def test_a_ready_hint_has_the_coordinator_watch_the_checkpoint_until_spark_records_the_epoch(zk, zk_root, tmp_path):
    """The writer's commit() hints that commits/N is coming: the embedded coordinator, whose next full pass
    is a minute away and which has no barrier, commits epoch 0 once commits/0 appears in the checkpoint.
    While it waits it only looks at the checkpoint: no pass, so no ZooKeeper request, per look."""
    pipe = Pipeline(zk, zk_root, FileSink(str(tmp_path / "out")))
    checkpoint = tmp_path / "ck"
    fake_checkpoint(checkpoint, completed=[])  # Spark's metadata (the query's id) and an empty commits/
    assert pipe.task("r1", 0, 0, [1, 2]) and pipe.task("r1", 0, 1, [3])
    zk.set(pipe.qp.base, dump({"checkpoint": str(checkpoint)}))
    coordinator, host, (passes, looks) = counted_host(zk, zk_root, "c1", "reconcile", "ready_wait")
    try:
        passes.await_calls(1)  # the first (full) pass found epoch 0 incomplete
        before = passes.count
        zk.create(pipe.qp.ready, dump({"epoch": 0, "run": "r1"}))
        passes.await_calls(before + 1)  # the pass the hint asks for
        hinted = passes.count
        looks.await_calls(looks.count + 20)  # the loop keeps looking while the hint waits for commits/0
        # Not a pass per look; a watch the hint's pass set off may still wake one more on a loaded host.
        assert passes.count - hinted < 10 and pipe.watermark() == -1
        (checkpoint / "commits" / "0").write_text("v1\n{}\n")
        await_watermark(zk, pipe.qp.watermark, 0, timeout=30, app="app")
        assert sorted(ids_out(pipe)) == [1, 2, 3]
    finally:
        host.supervisor.stop()


@pytest.mark.parametrize("where", ["none", "not-local", "another-host"])
def test_a_ready_hint_is_dropped_where_the_coordinator_cannot_look_at_the_checkpoint(zk, zk_root, tmp_path, where):
    """No checkpoint recorded, not a local path, or none on this host: nothing to look at, so the loop goes
    back to its usual wait at once (the barrier decides, as without a hint) rather than poll for ten seconds."""
    pipe = Pipeline(zk, zk_root, FileSink(str(tmp_path / "out")))
    assert pipe.task("r1", 0, 0, [1, 2])
    base = {"none": {}, "not-local": {"checkpoint": "hdfs://namenode/ck/orders"},
            "another-host": {"checkpoint": str(tmp_path / "ck-on-the-driver-host")}}[where]
    zk.set(pipe.qp.base, dump(base))
    coordinator = AppCoordinator(zk, zk_root, "app", SIGNER, "c1")
    coordinator.acquire()
    coordinator.reconcile()  # reads where the checkpoint is
    coordinator._on_ready(pipe.qp.query_id, dump({"epoch": 0, "run": "r1"}))
    if where == "none":  # maybe not recorded yet (the driver's publisher polls): one more pass reads it again
        assert coordinator.ready_wait() == READY_POLL
        coordinator.reconcile()
    assert coordinator.ready_wait() is None
    assert coordinator._ready == {}


def test_a_hint_looks_at_a_checkpoint_recorded_after_a_pass_found_none(zk, zk_root, tmp_path):
    """A query's first pass may run before the driver's publisher recorded where its checkpoint is: the
    first batch's hint must still have the loop look for commits/0, not be dropped as if there were none."""
    pipe = Pipeline(zk, zk_root, FileSink(str(tmp_path / "out")))
    assert pipe.task("r1", 0, 0, [1, 2])
    coordinator = AppCoordinator(zk, zk_root, "app", SIGNER, "c1")
    coordinator.acquire()
    coordinator.reconcile()  # no checkpoint recorded yet
    checkpoint = tmp_path / "ck"
    fake_checkpoint(checkpoint, completed=[])  # Spark's metadata (the query's id) and an empty commits/
    zk.set(pipe.qp.base, dump({"checkpoint": str(checkpoint)}))
    coordinator._on_ready(pipe.qp.query_id, dump({"epoch": 0, "run": "r1"}))
    assert coordinator.ready_wait() == READY_POLL  # asks a pass to read where the checkpoint is
    coordinator.reconcile()
    assert coordinator.ready_wait() == READY_POLL  # looks at commits/0
    (checkpoint / "commits" / "0").write_text("v1\n{}\n")
    assert coordinator.ready_wait() is None and coordinator._ready == {}
    coordinator.reconcile()
    assert pipe.watermark() == 0 and sorted(ids_out(pipe)) == [1, 2]


def test_a_hint_for_an_epoch_no_pass_can_see_asks_for_one_pass_and_is_dropped(zk, zk_root, tmp_path):
    """A hint naming an epoch above the watermark that has no record (say, after `twophase replay` discarded
    it): the pass it asks for finds nothing pending, so never reads the checkpoint. The loop must not ask
    again and again until the hint's window ends."""
    pipe = Pipeline(zk, zk_root, FileSink(str(tmp_path / "out")))
    assert pipe.task("r1", 0, 0, [1, 2])
    pipe.barrier(0, "r1")
    assert pipe.coordinator("c1").reconcile().ok  # committed by an earlier owner: the next never reads where
    coordinator, host, (passes, hints) = counted_host(zk, zk_root, "c2", "reconcile", "_on_ready")
    try:
        passes.await_calls(1)  # the first pass: nothing pending, so the checkpoint is not read
        before, seen = passes.count, hints.count
        zk.create(pipe.qp.ready, dump({"epoch": 3, "run": "r1"}))
        hints.await_calls(seen + 1)
        wait_until(lambda: coordinator._ready == {}, what="the hint to be dropped")
        assert passes.count <= before + 3  # the hint's wake-up and the one pass it asked for (a spin: hundreds)
    finally:
        host.supervisor.stop()


def test_a_new_owner_drops_the_last_hint_of_a_query_whose_epochs_are_committed(zk, zk_root, tmp_path):
    """Its watch reads each query's ready znode when set: the last hint of a query that ended names an epoch
    committed long ago, and must not keep the loop looking (a pass per look) for the hint's window."""
    pipe = Pipeline(zk, zk_root, FileSink(str(tmp_path / "out")))
    assert pipe.task("r1", 0, 0, [1, 2])
    pipe.barrier(0, "r1")
    zk.create(pipe.qp.ready, dump({"epoch": 0, "run": "r1"}))
    assert pipe.coordinator("c1").reconcile().ok and pipe.watermark() == 0
    successor = AppCoordinator(zk, zk_root, "app", SIGNER, "c2")
    successor.prepare()
    wait_until(lambda: pipe.qp.query_id in successor._ready, what="the successor's watch to read the hint")
    successor.reconcile()
    assert successor.ready_wait() is None and successor._ready == {}


def test_the_writers_commit_hints_each_batch_and_refuses_a_halted_run(zk, zk_server, zk_root, tmp_path):
    writer = TwoPhaseStreamWriter(FileSink(str(tmp_path / "out")), ExactlyOnce(zk_server.hosts, "app", zk_root),
                                  b"twophase-test-secret-0123456789")
    publish_app(zk, AppPaths(zk_root, "app"), SIGNER, FileSink(str(tmp_path / "out")), "embedded")
    query = AppPaths(zk_root, "app").query("q5")
    zk.create(f"{query.run('r1')}/alive", makepath=True)
    for batch in (0, 1):  # the first hint creates the znode, the next ones set it
        reports = [AttemptReport("q5", "r1", batch, partition, 0, 3, True) for partition in (0, 1)]
        writer.commit(reports, batch)
        assert parse_object(zk.get(query.ready)[0], query.ready) == {"epoch": batch, "run": "r1"}
    # Only a continuous trigger's epochs come without a task's message: Spark dropped their rows.
    with pytest.raises(ContinuousProcessingNotSupported, match="use a micro-batch trigger"):
        writer.commit([AttemptReport("q5", "r1", 2, 0, 0, 3, True), None], 2)
    assert parse_object(zk.get(query.ready)[0], query.ready) == {"epoch": 1, "run": "r1"}
    zk.create(query.halted("r1"), b"the embedded coordinator failed for good")
    with pytest.raises(PhaseTwoHalted, match="failed for good"):
        writer.commit([AttemptReport("q5", "r1", 2, 0, 0, 3, True)], 2)


def test_the_writers_commit_refuses_a_run_whose_hook_signs_with_another_secret(zk, zk_server, zk_root, tmp_path):
    """The tasks may have verified the sink a hook was about to replace; the run's first commit checks the sink its
    own hook published, before Spark records the batch."""
    publish_app(zk, AppPaths(zk_root, "app"), SIGNER, FileSink(str(tmp_path / "out")), "embedded")
    writer = TwoPhaseStreamWriter(FileSink(str(tmp_path / "out")), ExactlyOnce(zk_server.hosts, "app", zk_root),
                                  b"a-secret-found-in-the-jvm-environment")
    query = AppPaths(zk_root, "app").query("q6")
    zk.create(f"{query.run('r1')}/alive", makepath=True)
    with pytest.raises(SecretMismatch, match="before the SparkSession starts"):
        writer.commit([AttemptReport("q6", "r1", 0, 0, 0, 3, True)], 0)


def test_the_twophase_format_refuses_options_it_does_not_take(zk, zk_server, zk_root, tmp_path):
    Pipeline(zk, zk_root, FileSink(str(tmp_path / "out")))
    options = {"twophase.zk": zk_server.hosts, "twophase.root": zk_root, "twophase.app": "app",
               "checkpointLocation": str(tmp_path / "ck"), "compression": "gzip"}
    with pytest.raises(WriterOptionError, match=r"unknown option\(s\) \['compression'\] for the twophase sink"):
        SinkFormat(options).streamWriter(None, False)


def test_the_twophase_format_reads_its_stored_sink_once_per_process_and_sees_a_new_one(zk, zk_server, zk_root,
                                                                                   tmp_path, monkeypatch):
    """Spark asks the driver for a writer twice a micro-batch: the stored sink comes from a data watch, one
    read per process, and a sink another write_stream stored since still stops the query."""
    pipe = Pipeline(zk, zk_root, FileSink(str(tmp_path / "a")))
    options = {"twophase.zk": zk_server.hosts, "twophase.root": zk_root, "twophase.app": "app",
               SINK_DIGEST: sink_digest(zk.get(pipe.paths.sink)[0])}
    client = shared_client(zk_server.hosts)
    reads = CallCounter()
    monkeypatch.setattr(client, "get", reads.wrap(client.get))
    for _ in range(3):
        assert SinkFormat(options).streamWriter(None, False).sink.path == str(tmp_path / "a")
    assert reads.count == 1
    publish_app(zk, pipe.paths, SIGNER, FileSink(str(tmp_path / "b")), "embedded")  # the watch drops the old

    def refused():
        try:
            SinkFormat(options).streamWriter(None, False)
        except WriterOptionError as e:
            return "not the one this query was started with" in str(e)
        return False

    wait_until(refused, what="the writer to refuse the replaced sink")


def test_the_twophase_format_reads_again_before_refusing_what_its_watch_said(zk, zk_server, zk_root, tmp_path):
    """A watch's view may lag (its event not yet in, a session just re-established): a writer refuses a sink
    only on what ZooKeeper holds now."""
    pipe = Pipeline(zk, zk_root, FileSink(str(tmp_path / "a")))
    options = {"twophase.zk": zk_server.hosts, "twophase.root": zk_root, "twophase.app": "app",
               SINK_DIGEST: sink_digest(zk.get(pipe.paths.sink)[0])}
    assert SinkFormat(options).streamWriter(None, False).sink.path == str(tmp_path / "a")
    zk_module._watched[(zk_server.hosts, pipe.paths.sink)] = b""  # as if the watch had seen no sink
    assert SinkFormat(options).streamWriter(None, False).sink.path == str(tmp_path / "a")
