"""The driver hook stops what it started, even once ZooKeeper is gone (no Spark needed)."""

from __future__ import annotations

import threading

from kazoo.exceptions import ConnectionLoss

from sinks.files import FileSink
from twophase.spark.driver import DriverHook, HookConfig
from twophase.spark.publisher import ProgressPublisher
from twophase.supervisor import Supervision
from twophase.zkserver import ZooKeeperServer


class NoSpark:
    """Stands in for a SparkSession: the hook's watcher only asks for a live SparkContext."""


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


def test_sinks_of_one_app_share_a_hook_and_the_last_release_stops_it(zk_server, zk_root, tmp_path):
    config = HookConfig(zk_server.hosts, zk_root, "app", b"s" * 32)
    first = DriverHook.acquire(config, FileSink(str(tmp_path / "a")), NoSpark())
    second = DriverHook.acquire(config, FileSink(str(tmp_path / "b")), NoSpark())
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
