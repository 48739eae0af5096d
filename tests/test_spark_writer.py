"""The batch path in real local Spark: write_stream(df, sink) and format("twophase"), against a real ZooKeeper."""

from __future__ import annotations

import pytest
from pyspark.errors import StreamingQueryException
from pyspark.sql import functions as F

from coordinator.layout import AppPaths
from coordinator.state import EpochState
from coordinator.status import read_status
from examples.file_sink_query import INPUT_SCHEMA, FaultyFileSink, write_input
from sinks.files import FileSink, read_committed_rows
from tests.harness import SIGNER
from tests.test_cli import twophase
from tests.waiting import wait_for, wait_until
from twophase.spark import TwoPhaseBatchSink, await_committed, write_stream
from twophase.spark.discovery import write_options
from twophase.spark.driver import DriverHook
from twophase.spark.task_context import NotInStream
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
    # The discovery lets the hook go once no query of the app runs and all it completed is committed.
    wait_until(lambda: DriverHook.current((zk_server.hosts, zk_root, "batch")) is None,
               what="the driver hook of the finished app to be released")
    # Restarted with no new input, the run plans no batch: await_committed finds the app through its hook.
    again = start(spark, lambda df: write_stream(df, sink, app="batch", zk=zk_server.hosts, root=zk_root), tmp_path)
    again.awaitTermination()
    assert await_committed(again, timeout=60) == 2


def test_foreach_batch_writes_one_micro_batch_to_two_sinks_each_exactly_once(spark, zk_server, zk_root, tmp_path):
    for b in range(3):
        write_input(str(tmp_path / "in"), b, range(b * 40, (b + 1) * 40))
    with TwoPhaseBatchSink(FaultyFileSink(str(tmp_path / "all"), fail_rate=0.5), app="all", zk=zk_server.hosts,
                           root=zk_root, spark=spark) as every, \
         TwoPhaseBatchSink(FileSink(str(tmp_path / "even")), app="even", zk=zk_server.hosts, root=zk_root,
                           spark=spark) as even:
        def process(batch_df, batch_id):
            every.write(batch_df, batch_id)
            even.write(batch_df.filter("id % 2 = 0"), batch_id)

        query = start(spark, lambda df: df.writeStream.foreachBatch(process), tmp_path)
        query.awaitTermination()
        assert every.await_committed(query, timeout=60) == 2 and even.await_committed(query, timeout=60) == 2
        # The discovery reads a foreachBatch query as not its own (Spark's ForeachBatchSink.name() throws).
        assert write_options(query._jsq) == ("", {})
    assert count_rows(range(120), [r["id"] for r in read_committed_rows(str(tmp_path / "all"))]).exact
    assert count_rows(range(0, 120, 2), [r["id"] for r in read_committed_rows(str(tmp_path / "even"))]).exact


def test_foreach_batch_refuses_a_second_write_of_one_micro_batch(spark, zk_server, zk_root, tmp_path):
    write_input(str(tmp_path / "in"), 0, range(10))
    with TwoPhaseBatchSink(FileSink(str(tmp_path / "out")), app="twice", zk=zk_server.hosts, root=zk_root,
                           spark=spark) as target:
        def process(batch_df, batch_id):
            target.write(batch_df, batch_id)
            target.write(batch_df, batch_id)

        query = start(spark, lambda df: df.writeStream.foreachBatch(process), tmp_path)
        with pytest.raises(StreamingQueryException, match="already wrote micro-batch 0"):
            query.awaitTermination()


def test_a_swallowed_failed_write_commits_nothing_of_its_micro_batch(spark, zk_server, zk_root, zk, tmp_path):
    """The foreachBatch function catches the failed write of micro-batch 1 (row 57 fails its task every
    time; the other partitions pre-committed) and returns, so Spark records the micro-batch. None of its
    rows become visible: epoch 1 is FAILED, naming the write, and the next micro-batch fails naming it.
    The way back: `twophase replay`, and the restarted query writes micro-batches 1 and 2 once."""
    for b in range(3):
        write_input(str(tmp_path / "in"), b, range(b * 40, (b + 1) * 40))
    out, poison, swallowed = str(tmp_path / "out"), [57], []

    def process_with(target):
        def process(batch_df, batch_id):
            if batch_id == 1 and poison:
                failing = F.when(F.col("id").isin(poison), F.raise_error(F.lit("poison row"))).otherwise(F.col("id"))
                try:
                    target.write(batch_df.withColumn("id", failing), batch_id)
                except Exception as e:  # noqa: BLE001 - the mistake under test
                    swallowed.append(e)
                return
            target.write(batch_df, batch_id)
        return process

    with TwoPhaseBatchSink(FileSink(out), app="swallow", zk=zk_server.hosts, root=zk_root, spark=spark) as target:
        query = start(spark, lambda df: df.writeStream.foreachBatch(process_with(target)), tmp_path)
        with pytest.raises(StreamingQueryException, match="the write of micro-batch 1 to app swallow failed"):
            query.awaitTermination()
        assert len(swallowed) == 1 and "poison row" in str(swallowed[0])
        paths = AppPaths(zk_root, "swallow")
        epoch = wait_for(lambda: next((e for q in read_status(zk, paths, SIGNER).queries for e in q.epochs
                                       if e.epoch == 1 and e.state is EpochState.FAILED), None),
                         what="epoch 1 to be FAILED")
        assert "the write of micro-batch 1 to app swallow failed" in epoch.error and "twophase replay" in epoch.error
        assert (read_status(zk, paths, SIGNER).queries[0].watermark, epoch.winners) == (0, ())
    # An independent reader: micro-batch 0 once, nothing of micro-batch 1 (nor of 2, which failed).
    assert count_rows(range(40), [r["id"] for r in read_committed_rows(out)]).exact

    replayed = twophase("replay", "--zk", zk_server.hosts, "--root", zk_root, "--app", "swallow",
                        "--checkpoint", str(tmp_path / "ck"), "--epoch", "1")
    assert replayed.returncode == 0, replayed.stdout + replayed.stderr
    poison.clear()
    with TwoPhaseBatchSink(FileSink(out), app="swallow", zk=zk_server.hosts, root=zk_root, spark=spark) as target:
        query = start(spark, lambda df: df.writeStream.foreachBatch(process_with(target)), tmp_path)
        query.awaitTermination()
        assert target.await_committed(query, timeout=60) == 2
    assert count_rows(range(120), [r["id"] for r in read_committed_rows(out)]).exact


def test_two_sinks_stored_for_one_app_stop_the_query_instead_of_mixing_output(spark, zk_server, zk_root, tmp_path):
    """write_stream stores the sink for its app; a second one for the same app replaces it, and the first
    query, whose writer would now load the other sink, fails naming the cause instead."""
    write_input(str(tmp_path / "in"), 0, range(10))
    first = lambda df: write_stream(df, FileSink(str(tmp_path / "a")), app="same", zk=zk_server.hosts, root=zk_root)
    df = spark.readStream.schema(INPUT_SCHEMA).json(str(tmp_path / "in"))
    writer = first(df)
    write_stream(df, FileSink(str(tmp_path / "b")), app="same", zk=zk_server.hosts, root=zk_root)
    query = writer.option("checkpointLocation", str(tmp_path / "ck")).trigger(availableNow=True).start()
    with pytest.raises(StreamingQueryException, match="One sink per app"):
        query.awaitTermination()
    assert read_committed_rows(str(tmp_path / "a")) == [] and read_committed_rows(str(tmp_path / "b")) == []


def test_a_batch_dataframe_cannot_use_the_exactly_once_writer(spark, zk_server, zk_root, tmp_path):
    with TwoPhaseBatchSink(FileSink(str(tmp_path / "out")), app="batch", zk=zk_server.hosts, root=zk_root,
                           spark=spark) as target:
        with pytest.raises(NotInStream, match="foreachBatch"):
            target.write(spark.range(3), 0)
