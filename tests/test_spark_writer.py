"""The batch path in real local Spark: write_stream(df, sink) and format("twophase"), against a real ZooKeeper."""

from __future__ import annotations

import pytest

from examples.file_sink_query import INPUT_SCHEMA, FaultyFileSink, write_input
from sinks.files import read_committed_rows
from twophase.spark import await_committed, write_stream
from twophase.verify import count_rows

pytestmark = pytest.mark.spark


def start(spark, writer, tmp_path, partitions=4):
    """Every input file is one micro-batch, spread over ``partitions`` tasks."""
    df = (spark.readStream.schema(INPUT_SCHEMA).option("maxFilesPerTrigger", 1).json(str(tmp_path / "in"))
          .repartition(partitions))
    return writer(df).option("checkpointLocation", str(tmp_path / "ck")).trigger(availableNow=True).start()


def test_write_stream_writes_every_row_exactly_once_through_retried_tasks(spark, zk_server, zk_root, tmp_path):
    """A sink without write_batch of its own gets the default (write per row); half the first attempts die."""
    for b in range(3):
        write_input(str(tmp_path / "in"), b, range(b * 50, (b + 1) * 50))
    sink = FaultyFileSink(str(tmp_path / "out"), fail_rate=0.5)
    query = start(spark, lambda df: write_stream(df, sink, app="batch", zk=zk_server.hosts, root=zk_root), tmp_path)
    query.awaitTermination()
    assert await_committed(query, timeout=60) == 2
    report = count_rows(range(150), [r["id"] for r in read_committed_rows(str(tmp_path / "out"))])
    assert report.exact, report
