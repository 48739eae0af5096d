"""The batch path's driver-side check and options, without Spark (a real ZooKeeper)."""

from __future__ import annotations

import threading

import pytest

from coordinator.layout import AppPaths
from twophase.spark.sink_options import WriterOptionError, exactly_once
from twophase.spark.stream_sink import DriverHookMissing, await_watched
from twophase.task import PhaseTwoHalted


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
