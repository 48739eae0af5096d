#!/usr/bin/env python
"""Rows/s of the batch path (Arrow batches through write_batch) against Spark's own sinks and the foreach path.

Run (from the repo root)::

    source scripts/env.sh
    python bench/batch_path.py                       # 10 batches x 20k rows, 3 rounds
    python bench/batch_path.py --rounds 1 --batches 4 # quick look

Every writer runs the same query over the same input in one shared ``local[2]`` session: JSON files
in (``examples.file_sink_query.write_input``, one file per micro-batch), ``repartition(4)``,
``availableNow``. Writers, in a rotated order each round (after an untimed warm-up of each on the same
input: a shorter one leaves the first timed runs slower than the later ones, still warming up):

- ``noop``: Spark's noop sink, the query's own ceiling;
- ``spark json``: Spark's native JSON file sink (at-least-once per task, its own commit protocol);
- ``foreach FileSink``: ``foreach(TwoPhaseSink(FileSink))``, the row-at-a-time path;
- ``batch FileSink jsonl`` / ``parquet``: ``write_stream(df, FileSink(format=...))``;
- ``plain arrow jsonl`` / ``parquet``: an at-least-once ``DataSourceStreamArrowWriter`` writing the same
  bytes as FileSink (its own serializer) to one file per task, fsynced: the baseline of the batch
  path's exactly-once overhead;
- ``plain arrow drop``: the same Python Arrow writer consuming its batches and writing nothing: the ceiling
  of any writer on PySpark's Python data source API (``mapInArrow`` into a Python worker);
- ``batch LogSink``: ``format("twophase-kafka")`` to the built-in broker (a ``twophase broker``
  process, fsync 1000 ms), key = id, value = the row as JSON (``to_json`` in Spark);
- ``SparkFileSink json`` / ``parquet``: ``foreachBatch(TwoPhaseBatchSink(SparkFileSink(format=...)).write)``,
  Spark's own file writer, exactly once;
- ``plain foreachBatch json``: ``foreachBatch`` appending each micro-batch with Spark's JSON writer, at
  least once: the baseline of SparkFileSink's exactly-once overhead.

The clock runs from ``start()`` to ``awaitTermination()`` and, for exactly-once writers, until the
last epoch is committed (``await_committed``). Every run's output is counted afterwards (outside
the clock): every row exactly once. Per exactly-once writer and its plain twin, a table of CPU seconds
per run by process (bench/cpu.py) says what the exactly-once part costs. Targets (issue 14): FileSink through the batch path
>= Spark's JSON sink and >= 1.25x foreach FileSink (for the batch path proper, and for Spark's writer
through SparkFileSink); each one's exactly-once overhead against its plain twin <= 5 %; batch LogSink >=
0.8x batch FileSink jsonl.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("TWOPHASE_SECRET", "twophase-bench-secret-0123456789")
os.environ.setdefault("PYSPARK_SUBMIT_ARGS", "--conf spark.ui.showConsoleProgress=false pyspark-shell")

from broker_throughput import BrokerRunner  # noqa: E402
from cpu import CpuMeter  # noqa: E402
from pyspark.sql.datasource import DataSource, DataSourceStreamArrowWriter, WriterCommitMessage  # noqa: E402

from examples.file_sink_query import INPUT_SCHEMA, build_spark, write_input  # noqa: E402
from sinks.files import ROW_GROUP_SIZE, FileSink, _json_lines, _ParquetStaging, read_committed_rows  # noqa: E402
from sinks.spark_files import SparkFileSink  # noqa: E402
from twophase.verify import count_rows  # noqa: E402
from twophase.zkserver import ZooKeeperServer  # noqa: E402

if TYPE_CHECKING:
    from twophase.spark import TwoPhaseBatchSink, TwoPhaseSink

APP = "bench-batch-path"


class PlainArrowWriter(DataSourceStreamArrowWriter):
    """At least once: each task writes its batches with FileSink's own serializer to one file, fsynced."""

    def __init__(self, path: str, file_format: str) -> None:
        self.path = path
        self.format = file_format

    def write(self, iterator: Iterator) -> WriterCommitMessage:
        from pyspark import TaskContext

        if self.format == "drop":
            for _batch in iterator:
                pass
            return WriterCommitMessage()
        task = TaskContext.get()
        os.makedirs(self.path, exist_ok=True)
        name = os.path.join(self.path, f"part-{task.getLocalProperty('streaming.sql.batchId')}-"
                                       f"{task.partitionId()}-{task.attemptNumber()}.{self.format}")
        # The same encoders FileSink uses, so both write the same bytes.
        with open(name, "wb") as f:
            if self.format == "parquet":
                staging = _ParquetStaging(f, None, ROW_GROUP_SIZE)
                for batch in iterator:
                    staging.add_batch(batch)
                staging.close()
            else:
                for batch in iterator:
                    f.write(_json_lines(batch).encode())
            f.flush()
            os.fsync(f.fileno())
        fd = os.open(self.path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        return WriterCommitMessage()

    def commit(self, messages, batchId) -> None:  # noqa: N803
        pass

    def abort(self, messages, batchId) -> None:  # noqa: N803
        pass


class PlainArrow(DataSource):
    """``format("bench-plain-arrow")``: options ``path`` and ``format``."""

    @classmethod
    def name(cls) -> str:
        return "bench-plain-arrow"

    def streamWriter(self, schema, overwrite) -> PlainArrowWriter:  # noqa: N802
        return PlainArrowWriter(self.options["path"], self.options["format"])


@dataclass
class Writer:
    name: str
    start: Callable[[object, str, str], object]   # (df, out, checkpoint) -> query
    exactly_once: bool
    read: Callable[[str], list[int]]               # out -> ids seen


class Bench:
    def __init__(self, spark, zk: str, bootstrap: str, workdir: Path) -> None:
        self.spark = spark
        self.zk = zk
        self.bootstrap = bootstrap
        self.workdir = workdir
        self.root = f"/bench-{uuid.uuid4().hex[:8]}"
        self._n = 0
        self.held = {}  # writer name -> its TwoPhaseSink or TwoPhaseBatchSink of the last run

    def source(self, input_dir: str):
        return (self.spark.readStream.schema(INPUT_SCHEMA).option("maxFilesPerTrigger", 1).json(input_dir)
                .repartition(4))

    def writers(self) -> list[Writer]:
        from twophase.spark import TwoPhaseBatchSink, TwoPhaseSink, write_stream

        def files(path: str) -> list[int]:
            return [r["id"] for r in read_committed_rows(path)]

        def spark_json(path: str) -> list[int]:
            return [r.id for r in self.spark.read.schema(INPUT_SCHEMA).json(path).select("id").collect()]

        def plain(path: str) -> list[int]:
            return [r.id for r in (self.spark.read.parquet(path) if any(n.endswith(".parquet") for n in os.listdir(path))
                                   else self.spark.read.schema(INPUT_SCHEMA).json(path)).select("id").collect()]

        def topic(out: str) -> list[int]:
            from examples.log_sink_query import read_topic

            return [int(m.key()) for m in read_topic(self.bootstrap, Path(out).name)]

        def kafka(df, out, ck):
            from twophase.client import Admin

            with Admin(self.bootstrap) as admin:
                admin.create_topics({Path(out).name: 4})
            return (df.selectExpr("CAST(id AS STRING) AS key", "to_json(struct(*)) AS value")
                    .writeStream.format("twophase-kafka").option("kafka.bootstrap.servers", self.bootstrap)
                    .option("topic", Path(out).name).option("kafka.linger.ms", "5")
                    .option("twophase.zk", self.zk).option("twophase.app", f"{APP}-log").option("twophase.root", self.root)
                    .option("checkpointLocation", ck).trigger(availableNow=True).start())

        def stream(writer):
            return lambda df, out, ck: writer(df, out).option("checkpointLocation", ck).trigger(availableNow=True).start()

        def spark_files(fmt: str):
            return lambda df, out: df.writeStream.foreachBatch(self._hold(f"SparkFileSink {fmt}", TwoPhaseBatchSink(
                SparkFileSink(out, format=fmt), app=f"{APP}-spark-{fmt}", zk=self.zk, root=self.root,
                spark=self.spark)).write)

        def append_json(out: str):
            return lambda batch_df, batch_id: batch_df.write.mode("append").json(out)

        return [
            Writer("noop", stream(lambda df, out: df.writeStream.format("noop")), False, lambda out: []),
            Writer("spark json", stream(lambda df, out: df.writeStream.format("json").option("path", out)),
                   False, spark_json),
            Writer("foreach FileSink", stream(lambda df, out: df.writeStream.foreach(self._hold("foreach FileSink",
                   TwoPhaseSink(FileSink(out), app=f"{APP}-foreach", zk=self.zk, root=self.root, spark=self.spark)))),
                   True, files),
            Writer("batch FileSink jsonl", stream(lambda df, out: write_stream(
                df, FileSink(out), app=f"{APP}-jsonl", zk=self.zk, root=self.root)), True, files),
            Writer("plain arrow jsonl", stream(lambda df, out: df.writeStream.format("bench-plain-arrow")
                                               .option("path", out).option("format", "jsonl")), False, plain),
            Writer("batch FileSink parquet", stream(lambda df, out: write_stream(
                df, FileSink(out, format="parquet"), app=f"{APP}-parquet", zk=self.zk, root=self.root)), True, files),
            Writer("plain arrow parquet", stream(lambda df, out: df.writeStream.format("bench-plain-arrow")
                                                 .option("path", out).option("format", "parquet")), False, plain),
            Writer("plain arrow drop", stream(lambda df, out: df.writeStream.format("bench-plain-arrow")
                                              .option("path", out).option("format", "drop")), False, lambda out: []),
            Writer("batch LogSink", kafka, True, topic),
            Writer("SparkFileSink json", stream(spark_files("json")), True, spark_json),
            Writer("SparkFileSink parquet", stream(spark_files("parquet")), True, plain),
            Writer("plain foreachBatch json", stream(lambda df, out: df.writeStream.foreachBatch(append_json(out))),
                   False, spark_json),
        ]

    def _hold(self, name: str, target: TwoPhaseSink | TwoPhaseBatchSink) -> TwoPhaseSink | TwoPhaseBatchSink:
        """The writer's TwoPhaseSink or TwoPhaseBatchSink for this run (its output path), in place of its last."""
        if name in self.held:
            self.held[name].close()
        self.held[name] = target
        return target

    def run(self, writer: Writer, input_dir: str) -> tuple[float, str]:
        from twophase.spark import await_committed

        self._n += 1
        base = self.workdir / f"{self._n:03d}"
        out, ck = str(base / f"out-{uuid.uuid4().hex[:6]}"), str(base / "ck")
        t = time.perf_counter()
        query = writer.start(self.source(input_dir), out, ck)
        query.awaitTermination()
        if writer.name in self.held:
            self.held[writer.name].await_committed(query, timeout=300)
        elif writer.exactly_once:
            await_committed(query, timeout=300)
        return time.perf_counter() - t, out


PAIRS = [("batch FileSink jsonl", "plain arrow jsonl"), ("batch FileSink parquet", "plain arrow parquet"),
         ("SparkFileSink json", "plain foreachBatch json")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=10)
    parser.add_argument("--rows", type=int, default=20_000, help="rows per batch")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--only", nargs="*", help="writer names to run (default: all)")
    args = parser.parse_args(argv)

    workdir = Path(tempfile.mkdtemp(prefix="twophase-batch-path-"))
    total = args.batches * args.rows
    failures: list[str] = []
    times: dict[str, list[float]] = {}
    with ZooKeeperServer() as zk, BrokerRunner(str(workdir / "broker"), "1000", in_process=False) as broker:
        spark = build_spark(args.master)
        from twophase.spark import register

        register(spark)
        spark.dataSource.register(PlainArrow)
        try:
            input_dir = str(workdir / "in")
            for b in range(args.batches):
                write_input(input_dir, b, range(b * args.rows, (b + 1) * args.rows))
            bench = Bench(spark, zk.hosts, broker.bootstrap, workdir)
            writers = [w for w in bench.writers() if not args.only or w.name in args.only]
            for w in writers:
                seconds, _ = bench.run(w, input_dir)
                print(f"warm-up {w.name:24}: {seconds:6.2f} s", file=sys.stderr, flush=True)
            load_before = os.getloadavg()[0]
            meter = CpuMeter()
            for r in range(args.rounds):
                order = writers[r % len(writers):] + writers[:r % len(writers)]
                for w in order:
                    with meter.measure(w.name):
                        seconds, out = bench.run(w, input_dir)
                    if w.name not in ("noop", "plain arrow drop"):
                        report = count_rows(range(total), w.read(out))
                        if not report.exact:
                            failures.append(f"{w.name} round {r + 1}: {report}")
                    shutil.rmtree(Path(out).parent, ignore_errors=True)
                    times.setdefault(w.name, []).append(seconds)
                    print(f"round {r + 1} {w.name:24}: {seconds:6.2f} s {total / seconds:9.0f} rows/s",
                          file=sys.stderr, flush=True)
            load_after = os.getloadavg()[0]
        finally:
            from twophase.spark.driver import DriverHook

            for target in bench.held.values():
                target.close()
            DriverHook.close_all()
            spark.stop()
    shutil.rmtree(workdir, ignore_errors=True)

    rate = {name: total / statistics.median(t) for name, t in times.items()}
    print()
    print(f"{args.batches} batches x {args.rows} rows = {total} rows per run, 4 tasks per batch, {args.master}, "
          f"{args.rounds} round(s), rotated order")
    print()
    print(f"{'writer':<26}{'rows/s (median)':>16}{'min':>10}{'max':>10}")
    print("-" * 62)
    for name, t in times.items():
        print(f"{name:<26}{rate[name]:>16.0f}{total / max(t):>10.0f}{total / min(t):>10.0f}")
    print("-" * 62)

    def ratio(a: str, b: str) -> float | None:
        return rate[a] / rate[b] if a in rate and b in rate else None

    checks = [
        ("batch FileSink jsonl / spark json", ratio("batch FileSink jsonl", "spark json"), 1.0),
        ("batch FileSink jsonl / foreach FileSink", ratio("batch FileSink jsonl", "foreach FileSink"), 1.25),
        ("batch FileSink jsonl / plain arrow jsonl", ratio("batch FileSink jsonl", "plain arrow jsonl"), 0.95),
        ("batch FileSink parquet / plain arrow parquet", ratio("batch FileSink parquet", "plain arrow parquet"), 0.95),
        ("batch LogSink / batch FileSink jsonl", ratio("batch LogSink", "batch FileSink jsonl"), 0.8),
        ("SparkFileSink json / spark json", ratio("SparkFileSink json", "spark json"), 1.0),
        ("SparkFileSink json / foreach FileSink", ratio("SparkFileSink json", "foreach FileSink"), 1.25),
        ("SparkFileSink json / plain foreachBatch json", ratio("SparkFileSink json", "plain foreachBatch json"), 0.95),
    ]
    ceiling = ratio("plain arrow drop", "spark json")
    if ceiling is not None:
        print(f"{'plain arrow drop / spark json':<46} {ceiling:5.2f}  (the Python data source API's ceiling)")
    for label, value, target in checks:
        if value is not None:
            print(f"{label:<46} {value:5.2f}  target >= {target:.2f}  {'PASS' if value >= target else 'MISS'}")
    for exactly_once, plain in PAIRS:  # what exactly-once costs, in CPU: steadier than wall time
        if exactly_once in times and plain in times:
            print()
            print("\n".join(meter.table([plain, exactly_once], baseline=plain)))
            # Wall time per round: the two ran close together (the order rotates), so a round's ratio is
            # steadier than the ratio of medians taken over rounds apart.
            pairs = [e / p - 1 for e, p in zip(times[exactly_once], times[plain])]
            print(f"{exactly_once} vs {plain}, wall time per round: "
                  f"{', '.join(f'{100 * x:+.1f}' for x in pairs)} %; median {100 * statistics.median(pairs):+.1f} %")
    print()
    print(f"output check: {'every run exact' if not failures else 'NOT EXACT: ' + '; '.join(failures)}")
    print(f"host: {os.cpu_count()} CPUs, 1-min load average {load_before:.1f} before the timed rounds, "
          f"{load_after:.1f} after")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
