"""A streaming query through TwoPhaseSink(FileSink): JSON files in, exactly-once JSON lines out.

Run it against a ZooKeeper of your own::

    python -m examples.file_sink_query --zk 127.0.0.1:2181 --input /tmp/in \\
        --output /tmp/out --checkpoint /tmp/ck

It processes every file in --input (one file per micro-batch) and exits once
all of them are committed. --fail-rate makes the first attempt of
some partitions fail, as a flaky executor would; Spark retries them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import zlib
from typing import Any

from sinks.files import FileSink

INPUT_SCHEMA = "id LONG, batch LONG, payload STRING"


def write_input(input_dir: str, batch: int, ids: range) -> None:
    """Write one input file atomically, so the file source never sees half of it."""
    os.makedirs(input_dir, exist_ok=True)
    tmp = os.path.join(input_dir, f".batch-{batch:05d}.tmp")
    with open(tmp, "w") as f:
        for i in ids:
            f.write(json.dumps({"id": i, "batch": batch, "payload": f"row-{i}"}) + "\n")
    path = os.path.join(input_dir, f"batch-{batch:05d}.json")
    os.rename(tmp, path)
    # Spark's file source takes files in modification-time order at millisecond resolution: files
    # written within one millisecond would be taken in any order, so batch b gets b centiseconds more.
    stamp = time.time() + batch / 100
    os.utime(path, (stamp, stamp))


def fails_first_attempt(ctx, fail_rate: float) -> bool:
    """Whether this attempt is one chosen to fail: a hash, so every worker chooses alike."""
    key = f"{ctx.run_id}:{ctx.epoch}:{ctx.partition}".encode()
    return ctx.attempt == 0 and zlib.crc32(key) % 1000 < fail_rate * 1000


class FaultyFileSink(FileSink):
    """A FileSink whose first task attempts fail now and then, and which can be slow.

    fail_rate is the share of (epoch, partition) pairs whose first attempt raises
    mid-write; the choice is a hash, so it is the same in every worker.
    """

    def __init__(self, path: str, fail_rate: float = 0.0, slow_ms: int = 0) -> None:
        super().__init__(path)
        self.fail_rate = fail_rate
        self.slow_ms = slow_ms

    def begin_transaction(self, ctx):
        """Begin a file transaction and decide whether this attempt is one that fails."""
        txn = super().begin_transaction(ctx)
        txn.fail = fails_first_attempt(ctx, self.fail_rate)
        return txn

    def write(self, txn, row: Any) -> None:
        """Write one row, slowly if asked; raise RuntimeError after the first row of a failing attempt."""
        if self.slow_ms:
            time.sleep(self.slow_ms / 1000)
        super().write(txn, row)
        if txn.fail and txn.rows >= 1:
            raise RuntimeError("injected failure: first attempt of this partition dies mid-write")

    def write_batch(self, txn, batch) -> None:
        """The batch path's write: slow per row if asked; raise after the first batch of a failing attempt."""
        if self.slow_ms:
            time.sleep(self.slow_ms / 1000 * batch.num_rows)
        super().write_batch(txn, batch)
        if txn.fail and txn.rows >= 1:
            raise RuntimeError("injected failure: first attempt of this partition dies mid-batch")


def build_spark(master: str = "local[2,4]"):
    """A local SparkSession bound to 127.0.0.1, without UI, with 4 shuffle partitions."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    spark = (SparkSession.builder.master(master).appName("twophase-file-sink")
             .config("spark.ui.enabled", "false")
             .config("spark.sql.shuffle.partitions", "4")
             .config("spark.driver.host", "127.0.0.1")
             .config("spark.driver.bindAddress", "127.0.0.1")
             .getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def start_query(spark, writer, input_dir: str, checkpoint: str, partitions: int = 4):
    """Every input file is one micro-batch; rows are spread over `partitions` tasks."""
    return (spark.readStream.schema(INPUT_SCHEMA).option("maxFilesPerTrigger", 1).json(input_dir)
            .repartition(partitions)
            .writeStream.foreach(writer)
            .option("checkpointLocation", checkpoint)
            .trigger(availableNow=True)
            .start())


def query_parser(description: str, app: str) -> argparse.ArgumentParser:
    """The options of every example query; each example adds where its rows go."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--zk", required=True)
    parser.add_argument("--input", required=True)
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--app", default=app)
    parser.add_argument("--root", default="/twophase")
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--fail-rate", type=float, default=0.0)
    parser.add_argument("--slow-ms", type=int, default=0)
    parser.add_argument("--coordinator", choices=("embedded", "daemon"), default="embedded")
    return parser


def run_query(sink, args: argparse.Namespace) -> int:
    """Stream args.input through TwoPhaseSink(sink) until the input is used up and committed."""
    from twophase.spark import TwoPhaseSink

    spark = build_spark()
    with TwoPhaseSink(sink, app=args.app, zk=args.zk, root=args.root, coordinator=args.coordinator) as writer:
        query = start_query(spark, writer, args.input, args.checkpoint, args.partitions)
        query.awaitTermination()
        if args.coordinator == "embedded":
            writer.await_committed(query, timeout=120)
    spark.stop()
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run the example query into ``--output`` until it stops; return its exit code."""
    parser = query_parser(__doc__.splitlines()[0], app="file-sink-example")
    parser.add_argument("--output", required=True)
    args = parser.parse_args(argv)
    return run_query(FaultyFileSink(args.output, fail_rate=args.fail_rate, slow_ms=args.slow_ms), args)


if __name__ == "__main__":
    sys.exit(main())
