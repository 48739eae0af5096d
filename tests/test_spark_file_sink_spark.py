"""SparkFileSink in real local Spark against a real ZooKeeper: Spark's own writer, exactly once.

In process: retried tasks, a failed write, the row writers' refusal. As a subprocess
(examples/spark_files_query.py, the chaos harness's job): the driver SIGKILLed mid-write, and between
pre-commit and commit. An independent reader (pyarrow, hive partitions) counts every row.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pyarrow.dataset as ds
import pytest
from pyspark.errors import StreamingQueryException
from pyspark.sql import functions as F

from examples.file_sink_query import INPUT_SCHEMA, fails_first_attempt, write_input
from sinks.spark_files import SparkFileSink
from tests.test_chaos_driver import (ROWS_PER_BATCH, SLOW_MS, children, job, kill_run, query_paths,  # noqa: F401
                                     spark_completed, wait_while_alive, watermark)
from twophase.spark import TwoPhaseBatchSink, TwoPhaseSink, write_stream
from twophase.spark.task_context import task_context
from twophase.verify import count_rows

pytestmark = pytest.mark.spark

# SparkFileSink's committed names, in batch=<n>/: part-<epoch:08d>-<file:05d>-<run id>-<attempt>.snappy.parquet
PART = re.compile(r"batch=(\d+)/part-(\d{8})-(\d{5})-(.+)-(\d+)\.snappy\.parquet")


def visible_files(output: Path) -> dict[str, str]:
    """Every file a reader sees (relative name -> run id); fails on anything but a committed part file, or
    on an epoch committed from two runs."""
    found, runs = {}, {}
    for folder, subfolders, names in os.walk(output):
        subfolders[:] = [d for d in subfolders if not d.startswith(("_", "."))]
        for name in names:
            if name.startswith(("_", ".")):
                continue
            relative = os.path.relpath(os.path.join(folder, name), output)
            match = PART.fullmatch(relative)
            assert match, f"visible but not a committed part file: {relative}"
            assert match[1] == str(int(match[2])), f"{relative}: in another micro-batch's directory"
            runs.setdefault(int(match[2]), set()).add(match[4])
            found[relative] = match[4]
    mixed = {epoch: r for epoch, r in runs.items() if len(r) > 1}
    assert not mixed, f"epochs committed from more than one run: {mixed}"
    return found


def read_ids(output: Path) -> list[int]:
    """The independent reader: pyarrow skips names starting with '_' or '.', as Spark's readers do."""
    if not output.exists() or not visible_files(output):
        return []
    table = ds.dataset(str(output), format="parquet", partitioning="hive").to_table()
    assert all(row["batch"] == row["id"] // ROWS_PER_BATCH for row in table.select(["id", "batch"]).to_pylist())
    return table.column("id").to_pylist()


def parquet_by_batch(tmp_path, batches, app, zk_server, zk_root, spark, empty=()) -> TwoPhaseBatchSink:
    """``batches`` input files of ROWS_PER_BATCH rows (none for those in ``empty``), and a target writing
    Parquet into ``out/batch=<n>/``."""
    for b in range(batches):
        write_input(str(tmp_path / "in"), b, range(0) if b in empty else range(b * ROWS_PER_BATCH, (b + 1) * ROWS_PER_BATCH))
    return TwoPhaseBatchSink(SparkFileSink(str(tmp_path / "out"), partition_by=["batch"]), app=app, zk=zk_server.hosts,
                             root=zk_root, spark=spark)


def failing_first_attempts(marks: Path):
    """``id`` passed through by a UDF whose first attempt of every other (epoch, partition) task fails,
    leaving a mark file per failure: the test sees that Spark did retry."""
    def pass_through(row_id):
        ctx = task_context("files")
        if fails_first_attempt(ctx, 0.5):
            (marks / f"{ctx.epoch}.{ctx.partition}").touch()
            raise RuntimeError("injected failure: first attempt of this task dies mid-write")
        return row_id

    return F.udf(pass_through, "long")


def start(spark, process, tmp_path, marks: Path | None = None):
    df = (spark.readStream.schema(INPUT_SCHEMA).option("maxFilesPerTrigger", 1).json(str(tmp_path / "in"))
          .repartition(4))
    if marks is not None:
        df = df.withColumn("id", failing_first_attempts(marks)("id"))
    return (df.writeStream.foreachBatch(process).option("checkpointLocation", str(tmp_path / "ck"))
            .trigger(availableNow=True).start())


def test_sparks_writer_commits_every_row_once_through_retried_tasks(spark, zk_server, zk_root, tmp_path):
    """Half the first task attempts die mid-write; Spark's commit protocol keeps the retries' files only.
    Micro-batch 1 has no rows: it commits, and adds none."""
    out, marks = tmp_path / "out", tmp_path / "marks"
    marks.mkdir()
    expected = [*range(ROWS_PER_BATCH), *range(2 * ROWS_PER_BATCH, 3 * ROWS_PER_BATCH)]
    with parquet_by_batch(tmp_path, 3, "files", zk_server, zk_root, spark, empty={1}) as files:
        query = start(spark, files.write, tmp_path, marks)
        query.awaitTermination()
        assert files.await_committed(query, timeout=60) == 2
    assert os.listdir(marks), "no task failed: nothing was retried"
    assert count_rows(expected, read_ids(out)).exact
    assert spark.read.parquet(str(out)).count() == len(expected)  # Spark's reader sees the same
    assert os.listdir(out / "_staging") == [] and os.listdir(out / "_pending") == []


def test_a_failed_write_makes_nothing_of_its_micro_batch_visible(spark, zk_server, zk_root, tmp_path):
    out = tmp_path / "out"
    with parquet_by_batch(tmp_path, 2, "failing", zk_server, zk_root, spark) as files:
        def process(batch_df, batch_id):
            poisoned = F.when(F.col("id") == ROWS_PER_BATCH + 7, F.raise_error(F.lit("poison row")))
            files.write(batch_df.withColumn("id", poisoned.otherwise(F.col("id"))), batch_id)

        query = start(spark, process, tmp_path)
        with pytest.raises(StreamingQueryException, match="poison row"):
            query.awaitTermination()
        assert files.await_committed(query, timeout=60) == 0
    assert count_rows(range(ROWS_PER_BATCH), read_ids(out)).exact
    assert os.listdir(out / "_staging") == []  # the failed job's directory went with its transaction


def test_a_partition_column_the_micro_batch_lacks_fails_the_query_naming_it(spark, zk_server, zk_root, tmp_path):
    write_input(str(tmp_path / "in"), 0, range(ROWS_PER_BATCH))
    with TwoPhaseBatchSink(SparkFileSink(str(tmp_path / "out"), partition_by=["day"]), app="nocolumn",
                           zk=zk_server.hosts, root=zk_root, spark=spark) as files:
        query = start(spark, files.write, tmp_path)
        with pytest.raises(StreamingQueryException, match=r"no column\(s\) \['day'\]"):
            query.awaitTermination()
    assert not (tmp_path / "out").exists()  # checked before Spark wrote anything


def test_the_row_writers_refuse_a_sink_spark_writes(spark, zk_server, zk_root, tmp_path):
    sink = SparkFileSink(str(tmp_path / "out"))
    with pytest.raises(TypeError, match="TwoPhaseBatchSink in foreachBatch"):
        TwoPhaseSink(sink, app="rows", zk=zk_server.hosts, root=zk_root, spark=spark)
    df = spark.readStream.schema(INPUT_SCHEMA).json(str(tmp_path))
    with pytest.raises(TypeError, match="TwoPhaseBatchSink in foreachBatch"):
        write_stream(df, sink, app="rows", zk=zk_server.hosts, root=zk_root)


@pytest.mark.chaos
def test_driver_killed_mid_write_restarts_exactly_once(zk, job):
    """SIGKILL while Spark writes an epoch's staging directory; the restart re-runs the micro-batch, and the
    coordinator deletes the dead run's directory."""
    job.write_input()
    run = job.start("--slow-ms", str(SLOW_MS), module="examples.spark_files_query")
    staging = job.output / "_staging"
    wait_while_alive("Spark writing a staging directory", lambda: staging.exists() and os.listdir(staging), job, run)
    kill_run(run)
    committed = range((watermark(zk, job) + 1) * ROWS_PER_BATCH)  # a micro-batch of the first run is an epoch
    assert count_rows(committed, read_ids(job.output)).exact, "visible rows are not those of committed epochs"

    job.run_to_end(module="examples.spark_files_query")
    assert count_rows(job.expected, read_ids(job.output)).exact, job.logs()
    assert os.listdir(staging) == [] and os.listdir(job.output / "_pending") == []


@pytest.mark.chaos
def test_driver_killed_between_pre_commit_and_commit_commits_once(zk, job):
    """No coordinator runs (daemon mode): commits/0 is written, epoch 0 is pre-committed, nothing is visible;
    the driver dies; a restart with the embedded coordinator commits it once."""
    job.write_input()
    run = job.start("--coordinator", "daemon", module="examples.spark_files_query")
    wait_while_alive("commits/0 in the checkpoint", lambda: spark_completed(job, 0), job, run)
    kill_run(run)
    qp = query_paths(zk, job)
    assert watermark(zk, job) < 0 and children(zk, qp.attempts(0)), "epoch 0 should be pre-committed only"
    assert read_ids(job.output) == [] and any(n.split(".")[-3] == "0" for n in os.listdir(job.output / "_pending"))

    job.run_to_end(module="examples.spark_files_query")
    assert count_rows(job.expected, read_ids(job.output)).exact, job.logs()
    assert os.listdir(job.output / "_pending") == []
