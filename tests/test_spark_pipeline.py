"""TwoPhaseSink(FileSink) in real local Spark against a real ZooKeeper."""

from __future__ import annotations

import pytest

from examples.file_sink_query import FaultyFileSink, start_query, write_input
from sinks.files import read_committed_rows
from twophase.spark import TwoPhaseSink
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
