"""TwoPhaseSink(FileSink) in real local Spark against a real ZooKeeper."""

from __future__ import annotations

import os
import threading

import pytest
from kazoo.client import KazooClient
from kazoo.recipe.watchers import DataWatch

from examples.file_sink_query import FaultyFileSink, start_query, write_input
from sinks.files import read_committed_rows
from twophase.spark import TwoPhaseSink
from twophase.spark.driver import DriverHook
from twophase.verify import count_rows

pytestmark = pytest.mark.spark


def run_pipeline(spark, zk_server, zk_root, tmp_path, sink, batches=3, rows=50, writer_cls=TwoPhaseSink):
    for b in range(batches):
        write_input(str(tmp_path / "in"), b, range(b * rows, (b + 1) * rows))
    writer = writer_cls(sink, app="test", zk=zk_server.hosts, root=zk_root, spark=spark)
    query = start_query(spark, writer, str(tmp_path / "in"), str(tmp_path / "ck"))
    query.awaitTermination()
    assert writer.await_committed(query, timeout=60) == batches - 1
    return range(batches * rows)


def test_every_row_exactly_once(spark, zk_server, zk_root, tmp_path):
    expected = run_pipeline(spark, zk_server, zk_root, tmp_path, FaultyFileSink(str(tmp_path / "out")))
    report = count_rows(expected, [r["id"] for r in read_committed_rows(str(tmp_path / "out"))])
    assert report.exact, report


def test_failed_first_attempts_are_retried_once(spark, zk_server, zk_root, tmp_path):
    sink = FaultyFileSink(str(tmp_path / "out"), fail_rate=0.5)
    expected = run_pipeline(spark, zk_server, zk_root, tmp_path, sink)
    report = count_rows(expected, [r["id"] for r in read_committed_rows(str(tmp_path / "out"))])
    assert report.exact, report


class DiesAfterRegistering(TwoPhaseSink):
    """The first attempt of partition 1 dies after its pre-commit won, before Spark records success."""

    def close(self, error):
        super().close(error)
        if error is None and self._ctx.partition == 1 and self._ctx.attempt == 0:
            os._exit(1)


def test_a_task_dying_after_registration_is_not_written_twice(spark, zk_server, zk_root, tmp_path):
    """DESIGN 4.2: the retry finds the dead attempt's winning pre-commit and skips its rows."""
    out = str(tmp_path / "out")
    expected = run_pipeline(spark, zk_server, zk_root, tmp_path, FaultyFileSink(out),
                            writer_cls=DiesAfterRegistering)
    assert count_rows(expected, [r["id"] for r in read_committed_rows(out)]).exact
    partition_1 = [n for n in os.listdir(out) if n.endswith(".jsonl") and "-00001-" in n]
    assert partition_1 and all(n.endswith("-0.jsonl") for n in partition_1)  # attempt 0's data won


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
    writer = TwoPhaseSink(FaultyFileSink(str(tmp_path / "out"), slow_ms=5), app="test", zk=zk_server.hosts,
                          root=zk_root, spark=spark)
    hook = DriverHook.get(writer._hook_key)
    query = start_query(spark, writer, str(tmp_path / "in"), str(tmp_path / "ck"))
    reached = threading.Event()
    DataWatch(hook.client, writer.paths.query(str(query.id)).watermark, lambda data, _: data and reached.set())
    assert reached.wait(120), "first epoch never committed"
    expire_session(hook.client, zk_server.hosts)
    zk_server.restart()
    query.awaitTermination()
    assert writer.await_committed(query, timeout=120) == 5
    assert count_rows(range(240), [r["id"] for r in read_committed_rows(str(tmp_path / "out"))]).exact
