"""TwoPhaseSink(FileSink) in real local Spark against a real ZooKeeper."""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import threading

import pytest
from kazoo.client import KazooClient
from kazoo.recipe.watchers import DataWatch

from examples.custom_sink import SqliteSink
from examples.file_sink_query import FaultyFileSink, start_query, write_input
from sinks.files import read_committed_rows
from twophase.spark import ContinuousProcessingNotSupported, TwoPhaseSink
from twophase.verify import count_rows

pytestmark = pytest.mark.spark


def run_pipeline(spark, zk_server, zk_root, tmp_path, sink, batches=3, rows=50, writer_cls=TwoPhaseSink):
    for b in range(batches):
        write_input(str(tmp_path / "in"), b, range(b * rows, (b + 1) * rows))
    with writer_cls(sink, app="test", zk=zk_server.hosts, root=zk_root, spark=spark) as writer:
        query = start_query(spark, writer, str(tmp_path / "in"), str(tmp_path / "ck"))
        query.awaitTermination()
        assert writer.await_committed(query, timeout=60) == batches - 1
    return range(batches * rows)


def test_every_row_exactly_once(spark, zk_server, zk_root, tmp_path):
    expected = run_pipeline(spark, zk_server, zk_root, tmp_path, FaultyFileSink(str(tmp_path / "out")))
    report = count_rows(expected, [r["id"] for r in read_committed_rows(str(tmp_path / "out"))])
    assert report.exact, report


def test_await_committed_long_after_the_query_stopped(spark, zk_server, zk_root, tmp_path):
    """Regression: once the hook forgot a stopped query, await_committed returned None at once."""
    write_input(str(tmp_path / "in"), 0, range(10))
    with TwoPhaseSink(FaultyFileSink(str(tmp_path / "out")), app="test", zk=zk_server.hosts,
                      root=zk_root, spark=spark) as writer:
        query = start_query(spark, writer, str(tmp_path / "in"), str(tmp_path / "ck"))
        query.awaitTermination()
        writer.await_committed(query, timeout=60)
        writer._hook.publisher.runs.clear()  # what the hook does shortly after termination
        assert writer.await_committed(query, timeout=60) == 0


def test_failed_first_attempts_are_retried_once(spark, zk_server, zk_root, tmp_path):
    sink = FaultyFileSink(str(tmp_path / "out"), fail_rate=0.5)
    expected = run_pipeline(spark, zk_server, zk_root, tmp_path, sink)
    report = count_rows(expected, [r["id"] for r in read_committed_rows(str(tmp_path / "out"))])
    assert report.exact, report


class DiesAfterRegistering(TwoPhaseSink):
    """The first attempt of partition 1 dies after its pre-commit won, before Spark records success."""

    def close(self, *error):  # (error,) from Spark in a task; () on the driver
        attempt = getattr(self, "attempt", None)
        super().close(*error)
        if error == (None,) and attempt is not None and attempt.ctx.partition == 1 and attempt.ctx.attempt == 0:
            os._exit(1)


def test_a_task_dying_after_registration_is_not_written_twice(spark, zk_server, zk_root, tmp_path):
    """DESIGN 4.2: the retry finds the dead attempt's winning pre-commit and skips its rows."""
    out = str(tmp_path / "out")
    expected = run_pipeline(spark, zk_server, zk_root, tmp_path, FaultyFileSink(out),
                            writer_cls=DiesAfterRegistering)
    assert count_rows(expected, [r["id"] for r in read_committed_rows(out)]).exact
    partition_1 = [n for n in os.listdir(out) if n.endswith(".jsonl") and "-00001-" in n]
    assert partition_1 and all(n.endswith("-0.jsonl") for n in partition_1)  # attempt 0's data won


class DiesBeforeRegistering(TwoPhaseSink):
    """The first attempt of partition 1 is killed after its pre-commit, before registering it."""

    def close(self, *error):  # (error,) from Spark in a task; () on the driver
        attempt = getattr(self, "attempt", None)
        if error == (None,) and attempt is not None and attempt.ctx.partition == 1 and attempt.ctx.attempt == 0:
            self.sink.pre_commit(attempt._txn)
            os._exit(1)
        super().close(*error)


def test_a_task_killed_before_registering_leaves_nothing_behind(spark, zk_server, zk_root, tmp_path):
    out = str(tmp_path / "out")
    expected = run_pipeline(spark, zk_server, zk_root, tmp_path, FaultyFileSink(out),
                            writer_cls=DiesBeforeRegistering)
    assert count_rows(expected, [r["id"] for r in read_committed_rows(out)]).exact
    assert os.listdir(os.path.join(out, "_pending")) == []  # cleaned up before the epochs count as committed
    partition_1 = [n for n in os.listdir(out) if n.endswith(".jsonl") and "-00001-" in n]
    assert partition_1 and all(n.endswith("-1.jsonl") for n in partition_1)  # the retries' data


def expire_session(client, hosts):
    """Expire a kazoo session for real: another client with the same credentials closes it."""
    session_id, password = client.client_id
    twin = KazooClient(hosts=hosts, client_id=(session_id, password))
    twin.start()
    twin.stop()
    twin.close()


def test_zookeeper_restart_and_session_expiry_mid_stream(spark, zk_server, zk_root, tmp_path):
    """DESIGN 4.8: the pipeline stalls through ZooKeeper trouble and loses nothing."""
    for b in range(6):
        write_input(str(tmp_path / "in"), b, range(b * 40, (b + 1) * 40))
    with TwoPhaseSink(FaultyFileSink(str(tmp_path / "out"), slow_ms=5), app="test", zk=zk_server.hosts,
                      root=zk_root, spark=spark) as writer:
        hook = writer._hook
        query = start_query(spark, writer, str(tmp_path / "in"), str(tmp_path / "ck"))
        reached = threading.Event()
        DataWatch(hook.client, writer.paths.query(str(query.id)).watermark, lambda data, _: data and reached.set())
        assert reached.wait(120), "first epoch never committed"
        expire_session(hook.client, zk_server.hosts)
        zk_server.restart()
        query.awaitTermination()
        assert writer.await_committed(query, timeout=120) == 5
    assert count_rows(range(240), [r["id"] for r in read_committed_rows(str(tmp_path / "out"))]).exact


def test_a_user_written_sink_gets_exactly_once_too(spark, zk_server, zk_root, tmp_path):
    """examples/custom_sink.py (SQLite, staging-table 2PC) through Spark with failing first attempts."""
    sink = SqliteSink(str(tmp_path / "out.db"))
    expected = run_pipeline(spark, zk_server, zk_root, tmp_path, sink)
    with contextlib.closing(sqlite3.connect(tmp_path / "out.db")) as db:
        ids = [json.loads(data)["id"] for (data,) in db.execute("SELECT data FROM rows")]
        staged = db.execute("SELECT COUNT(*) FROM staging").fetchone()[0]
    assert count_rows(expected, ids).exact and staged == 0


def test_continuous_processing_is_refused_with_a_clear_error(spark, zk_server, zk_root, tmp_path):
    writer = TwoPhaseSink(FaultyFileSink(str(tmp_path / "out")), app="test", zk=zk_server.hosts,
                          root=zk_root, spark=spark)
    query = (spark.readStream.format("rate").load().writeStream.foreach(writer)
             .option("checkpointLocation", str(tmp_path / "ck")).trigger(continuous="1 second").start())
    # Continuous mode never retries a task, so Spark reports that rather than our error (which
    # is in the executor log); test_open_refuses_continuous_processing checks the message itself.
    with pytest.raises(Exception, match="STREAM_FAILED"):
        query.awaitTermination(120)
    assert read_committed_rows(str(tmp_path / "out")) == []


class FakeTaskContext:
    def __init__(self, **properties):
        self.properties = properties

    def getLocalProperty(self, key):
        return self.properties.get(key)

    def attemptNumber(self):
        return 0


def test_open_refuses_continuous_processing(monkeypatch, zk_server, zk_root, tmp_path, spark):
    writer = TwoPhaseSink(FaultyFileSink(str(tmp_path / "out")), app="test", zk=zk_server.hosts,
                          root=zk_root, spark=spark)
    fake = FakeTaskContext(**{"__is_continuous_processing": "true"})
    monkeypatch.setattr("twophase.spark.task_context.TaskContext.get", lambda: fake)
    with pytest.raises(ContinuousProcessingNotSupported, match="use a micro-batch trigger"):
        writer.open(0, 0)
