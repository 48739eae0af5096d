"""The driver hook's parts without Spark: stopping, sharing, ZooKeeper outages, what gets published."""

from __future__ import annotations

import threading

import pytest
from kazoo.exceptions import ConnectionLoss

from coordinator.layout import AppPaths
from coordinator.runs import RunRecord
from coordinator.zk import read_json
from sinks.files import FileSink
from twophase.spark.driver import DriverHook, HookConfig
from twophase.spark.publisher import ProgressPublisher, PublishedRun
from twophase.spark.queries import QuerySnapshot
from twophase.supervisor import Supervision
from twophase.zkserver import ZooKeeperServer

from tests.waiting import wait_until


class NoSpark:
    """Stands in for a live SparkSession that runs no streaming query."""

    class sparkContext:  # noqa: N801 - the attribute names the watcher reads
        _jsc = object()

    class _jsparkSession:  # noqa: N801 - the attribute name the watcher reads
        @staticmethod
        def streams():
            return NoSpark._Streams()

    class _Streams:
        @staticmethod
        def active():
            return []


def test_release_returns_and_ends_every_thread_after_zookeeper_went_away(tmp_path):
    server = ZooKeeperServer().start()
    try:
        before = set(threading.enumerate())
        hook = DriverHook.acquire(HookConfig(server.hosts, "/t-close", "app", b"s" * 32),
                                  FileSink(str(tmp_path / "out")), NoSpark())
        server.kill()
        done = threading.Thread(target=hook.release, name="release")
        done.start()
        done.join(120)
        assert not done.is_alive(), "release() hung with ZooKeeper gone"
        assert DriverHook._hooks.get(hook.config.key) is None
        left = [t for t in set(threading.enumerate()) - before if t.is_alive()]
        assert left == [], f"threads left running: {[t.name for t in left]}"
    finally:
        server.stop()


def test_release_of_a_hook_whose_query_still_runs_returns_while_zookeeper_is_away(tmp_path):
    """The hook halts a run still going when it closes, unless ZooKeeper is away: that request would wait for
    ZooKeeper's return, and the interpreter's exit (which closes every hook) with it."""
    server = ZooKeeperServer().start()
    try:
        hook = DriverHook.acquire(HookConfig(server.hosts, "/t-close-live", "app", b"s" * 32),
                                  FileSink(str(tmp_path / "out")), NoSpark())
        hook.publisher.runs[("q-1", "r1")] = PublishedRun("q-1", "r1", published=True)
        hook._still_running = lambda: True  # as if its query still ran in Spark
        server.kill()
        wait_until(lambda: not hook.client.connected, what="the client to see ZooKeeper gone")
        done = threading.Thread(target=hook.release, name="release")
        done.start()
        done.join(120)
        assert not done.is_alive(), "release() hung halting a run with ZooKeeper gone"
    finally:
        server.stop()


def test_sinks_of_one_app_share_a_hook_and_the_last_release_stops_it(zk_server, zk_root, tmp_path):
    config = HookConfig(zk_server.hosts, zk_root, "app", b"s" * 32)
    spark = NoSpark()
    first = DriverHook.acquire(config, FileSink(str(tmp_path / "a")), spark)
    second = DriverHook.acquire(config, FileSink(str(tmp_path / "b")), spark)
    assert first is second
    first.release()
    assert DriverHook._hooks.get(config.key) is second and second.client.connected
    second.release()
    assert DriverHook._hooks.get(config.key) is None and not second.client.connected


def test_zookeeper_trouble_is_waited_out_not_escalated(zk_server, zk_root, tmp_path, monkeypatch):
    """Failure case 8: ZooKeeper away longer than the supervisor's retries must not halt the runs."""
    calls = []
    published = threading.Event()

    def publish_after_an_outage(self):
        calls.append(1)
        if len(calls) <= 10:
            raise ConnectionLoss("ZooKeeper is away")
        published.set()

    monkeypatch.setattr(ProgressPublisher, "publish", publish_after_an_outage)
    quick = Supervision(attempts=2, first_backoff=0.001, max_backoff=0.001)
    hook = DriverHook.acquire(HookConfig(zk_server.hosts, zk_root, "app", b"s" * 32, supervision=quick),
                              FileSink(str(tmp_path / "out")), NoSpark())
    try:
        assert published.wait(60)
        assert hook.failure is None
    finally:
        hook.release()


def test_a_second_sink_of_the_app_with_other_settings_is_refused(zk_server, zk_root, tmp_path):
    spark = NoSpark()
    hook = DriverHook.acquire(HookConfig(zk_server.hosts, zk_root, "app", b"s" * 32), FileSink(str(tmp_path)), spark)
    try:
        with pytest.raises(ValueError, match="other settings"):
            DriverHook.acquire(HookConfig(zk_server.hosts, zk_root, "app", b"s" * 32, mode="daemon"),
                               FileSink(str(tmp_path)), spark)
    finally:
        hook.release()


def test_a_hook_whose_spark_context_stopped_is_replaced(zk_server, zk_root, tmp_path):
    class StoppedSpark(NoSpark):
        class sparkContext:  # noqa: N801
            _jsc = None

    config = HookConfig(zk_server.hosts, zk_root, "app", b"s" * 32)
    stale = DriverHook.acquire(config, FileSink(str(tmp_path)), StoppedSpark())
    assert stale._publisher_job.join(60)  # its publisher ends with the SparkContext
    fresh = DriverHook.acquire(config, FileSink(str(tmp_path)), NoSpark())
    try:
        assert fresh is not stale and not stale.client.connected
    finally:
        fresh.release()


def test_the_last_batch_of_a_run_that_ended_between_polls_is_published(zk, zk_root):
    paths = AppPaths(zk_root, "app")
    qp = paths.query("q")
    zk.ensure_path(qp.base)  # the query wrote through the app
    publisher = ProgressPublisher(zk, paths, "driver")
    try:
        publisher.update({"q": QuerySnapshot("q", "r1", "/ck", 3)})
        publisher.publish()
        assert zk.exists(f"{qp.run('r1')}/alive")
        publisher.update({}, [QuerySnapshot("q", "r1", "/ck", 4)])  # batch 4 finished, then the query stopped
        publisher.publish()
        assert read_json(zk, qp.barrier, {}) == {"epoch": 4, "run": "r1"}
        assert not zk.exists(f"{qp.run('r1')}/alive")
    finally:
        publisher.close()


def test_a_halt_reaches_runs_published_after_it(zk, zk_root):
    paths = AppPaths(zk_root, "app")
    zk.ensure_path(paths.query("q").base)
    publisher = ProgressPublisher(zk, paths, "driver")
    try:
        publisher.halt("the coordinator failed for good")
        publisher.update({"q": QuerySnapshot("q", "r2", "/ck", None)})  # a run that starts afterwards
        publisher.publish()
        assert zk.get(paths.query("q").halted("r2"))[0] == b"the coordinator failed for good"
    finally:
        publisher.close()


def test_a_refused_run_is_halted_with_its_reason_once_it_wrote_through_the_app_and_gets_no_barrier(zk, zk_root):
    paths = AppPaths(zk_root, "app")
    qp = paths.query("q")
    publisher = ProgressPublisher(zk, paths, "driver")
    refused = QuerySnapshot("q", "r1", "/ck", None, refused="Spark runs this query with async progress tracking")
    try:
        publisher.update({"q": refused})
        publisher.publish()
        assert not zk.exists(qp.base)  # a query of another sink, maybe: nothing of it is made
        publisher.woken.clear()
        zk.ensure_path(qp.run("r1"))  # its first task's open (PrecommitRegistry.ensure_run)
        assert publisher.woken.wait(60), "the query's node did not wake the publisher"
        publisher.publish()
        assert zk.get(qp.halted("r1"))[0] == refused.refused.encode()
        assert publisher.halted is None  # the app's other runs go on
        assert not zk.exists(qp.barrier)
        assert RunRecord.read(zk, qp.run("r1")).in_order is False  # its next epoch proves nothing
    finally:
        publisher.close()


def test_a_query_that_never_wrote_through_the_app_costs_one_watched_exists_not_one_per_poll(zk, zk_root):
    paths = AppPaths(zk_root, "app")
    qp = paths.query("q")
    publisher = ProgressPublisher(zk, paths, "driver")
    asked = []
    exists = zk.exists
    zk.exists = lambda path, watch=None: (asked.append(path), exists(path, watch=watch))[1]
    try:
        publisher.update({"q": QuerySnapshot("q", "r1", "/ck", 0)})  # a query of the session, not of the app
        for _ in range(5):
            publisher.publish()
        assert asked == [qp.base] and not publisher.live_runs()
        zk.ensure_path(qp.base)  # its first pre-commit through the app: the watch fires
        wait_until(lambda: (publisher.publish(), publisher.live_runs())[1], what="the run to be published")
        assert read_json(zk, qp.barrier, {}) == {"epoch": 0, "run": "r1"}
        assert RunRecord.read(zk, qp.run("r1")).in_order is True
        assert asked.count(qp.base) >= 2
    finally:
        del zk.exists
        publisher.close()
