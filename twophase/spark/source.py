"""``twophase-kafka``: a PySpark data source (batch and streaming) reading Kafka topics with twophase.client.

It needs no JVM connector: it speaks the Kafka protocol from Python, to the built-in broker or any
Kafka broker. Its rows have the schema of Spark's Kafka source (``key``, ``value``, ``topic``,
``partition``, ``offset``, ``timestamp``, ``timestampType``, and ``headers`` with
``includeHeaders=true``) and it takes Spark's Kafka options (docs/source.md), so a query ports by
changing the format name. It reads ``read_committed`` by default: aborted records and transaction
markers never become rows, and a batch never ends past a partition's last stable offset.

Each Spark task reads one partition's offset range ``[start, end)`` (:class:`KafkaRange`) with a
consumer of its own, and yields one Arrow record batch per fetch; offset gaps (markers, aborted or
compacted records) are normal. The driver side (offsets, partitions, data loss) is in
source_offsets.py, the options in source_options.py.

Example::

    from twophase.spark import register
    register(spark)
    df = (spark.readStream.format("twophase-kafka")
          .option("kafka.bootstrap.servers", "127.0.0.1:9092").option("subscribe", "orders")
          .option("startingOffsets", "earliest").load())
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterator

import pyarrow as pa
from pyspark.sql.datasource import (
    DataSource,
    DataSourceReader,
    DataSourceStreamReader,
    DataSourceWriter,
    InputPartition,
)
from pyspark.sql.pandas.types import to_arrow_schema
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxRows,
    SupportsTriggerAvailableNow,
)
from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    IntegerType,
    LongType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

from twophase.client import EARLIEST, Consumer, Message, OffsetOutOfRange

from .kafka_sink import BATCH_WRITE_REFUSED, kafka_stream_writer
from .source_offsets import OffsetPlanner, Offsets, from_json, report_loss, to_json
from .source_options import SourceOptions, parse_options
from .stream_sink import TwoPhaseStreamWriter
from .task_context import NotInStream

log = logging.getLogger("twophase.spark.source")

NAME = "twophase-kafka"
SCHEMA = StructType([  # Spark's Kafka source schema (KafkaRecordToRowConverter), every field nullable
    StructField("key", BinaryType()), StructField("value", BinaryType()), StructField("topic", StringType()),
    StructField("partition", IntegerType()), StructField("offset", LongType()),
    StructField("timestamp", TimestampType()), StructField("timestampType", IntegerType())])
HEADERS = StructField("headers", ArrayType(StructType([StructField("key", StringType()),
                                                       StructField("value", BinaryType())])))
SCHEMA_WITH_HEADERS = StructType([*SCHEMA.fields, HEADERS])
# What PySpark compares a read() batch's schema with (plan_data_source_read.records_to_arrow_batches):
# timestamps in microseconds, UTC; the same function builds it, so the two cannot drift apart.
ARROW_SCHEMA = to_arrow_schema(SCHEMA, timezone="UTC")
ARROW_SCHEMA_WITH_HEADERS = to_arrow_schema(SCHEMA_WITH_HEADERS, timezone="UTC")


@dataclasses.dataclass(frozen=True)
class KafkaRange(InputPartition):
    """One task's work: offsets ``[start, end)`` of ``topic``-``partition`` (pickled to an executor)."""

    topic: str
    partition: int
    start: int
    end: int
    options: SourceOptions


def plan(options: SourceOptions, start: Offsets, end: Offsets) -> list[KafkaRange]:
    """One KafkaRange per partition with offsets to read from ``start`` to ``end`` (a partition that is
    new in ``end`` is not read this batch: it entered at its earliest offset, see source_offsets)."""
    return [KafkaRange(t, p, start[(t, p)], until, options)
            for (t, p), until in sorted(end.items()) if (t, p) in start and until > start[(t, p)]]


def to_record_batch(messages: list[Message], include_headers: bool) -> pa.RecordBatch:
    """The rows of ``messages`` as one Arrow record batch of the source's schema."""
    columns = [
        pa.array([m.key for m in messages], pa.binary()),
        pa.array([m.value for m in messages], pa.binary()),
        pa.array([m.topic for m in messages], pa.string()),
        pa.array([m.partition for m in messages], pa.int32()),
        pa.array([m.offset for m in messages], pa.int64()),
        pa.array([m.timestamp_ms * 1000 for m in messages], ARROW_SCHEMA.field("timestamp").type),
        pa.array([m.timestamp_type for m in messages], pa.int32()),
    ]
    schema = ARROW_SCHEMA
    if include_headers:
        schema = ARROW_SCHEMA_WITH_HEADERS
        columns.append(pa.array([[{"key": k, "value": v} for k, v in m.headers] for m in messages],
                                schema.field("headers").type))
    return pa.RecordBatch.from_arrays(columns, schema=schema)


def read_range(r: KafkaRange) -> Iterator[pa.RecordBatch]:
    """The records of ``r`` as Arrow record batches, one per fetch; runs in a Spark task.

    A consumer of its own (no group) reads from ``r.start`` until its position reaches ``r.end``;
    records at or past ``r.end`` (the last fetched batch may straddle it) are dropped. Offsets the
    broker no longer holds follow failOnDataLoss. No progress for kafkaConsumer.pollTimeoutMs is an error.
    """
    opts = r.options
    consumer = Consumer(opts.bootstrap, isolation_level=opts.isolation_level, auto_offset_reset="none",
                        max_partition_bytes=opts.max_partition_fetch_bytes, max_bytes=opts.fetch_max_bytes,
                        request_timeout_ms=opts.request_timeout_ms, client_id=opts.client_id,
                        security=opts.security)
    try:
        consumer.assign([(r.topic, r.partition)])
        consumer.seek(r.topic, r.partition, r.start)
        position, progressed = r.start, time.monotonic()
        while position < r.end:
            try:
                messages = consumer.poll(timeout_s=1.0, max_records=1 << 30)  # all a fetch brought
            except OffsetOutOfRange as exc:
                position = _skip_lost(consumer, r, exc.offset)
                continue
            rows = [m for m in messages if m.offset < r.end]
            if rows:
                yield to_record_batch(rows, opts.include_headers)
            now_at = consumer.position(r.topic, r.partition)
            if now_at > position:
                position, progressed = now_at, time.monotonic()
            elif time.monotonic() - progressed > opts.poll_timeout_ms / 1000:
                raise TimeoutError(f"{r.topic}-{r.partition}: no progress at offset {position} for "
                                   f"kafkaConsumer.pollTimeoutMs={opts.poll_timeout_ms} while reading to {r.end}")
    finally:
        consumer.close()


def _skip_lost(consumer: Consumer, r: KafkaRange, at: int) -> int:
    """After OFFSET_OUT_OF_RANGE at ``at``: DataLoss, or (failOnDataLoss=false) the position skipped to."""
    where = f"{r.topic}-{r.partition}"
    report_loss(r.options.fail_on_data_loss, f"{where}: offset {at} (reading [{r.start}, {r.end})) is no longer "
                                             "in the log (deleted by retention, or the topic was recreated)")
    consumer.seek(r.topic, r.partition, EARLIEST)
    earliest = consumer.position(r.topic, r.partition)
    if earliest <= at or earliest >= r.end:  # recreated (its offsets restart below), or all of the range gone
        log.warning("%s: offsets %d to %d skipped", where, at, r.end)
        return r.end
    log.warning("%s: offsets %d to %d skipped", where, at, earliest)
    return earliest


class KafkaBatchReader(DataSourceReader):
    """``spark.read.format("twophase-kafka")``: offsets from startingOffsets to endingOffsets, planned on the driver."""

    def __init__(self, options: SourceOptions) -> None:
        self.options = options

    def partitions(self) -> list[KafkaRange]:
        """One range per partition with records between the starting and ending offsets."""
        with OffsetPlanner(self.options) as planner:
            partitions = planner.current_partitions()
            start = planner.resolve(self.options.starting, "startingOffsets", partitions)
            end = planner.resolve(self.options.ending, "endingOffsets", partitions)
            earliest = planner.earliest(partitions)
        for tp in partitions:
            if start[tp] > end[tp]:
                report_loss(self.options.fail_on_data_loss, f"{tp[0]}-{tp[1]}: startingOffsets {start[tp]} is "
                                                            f"past endingOffsets {end[tp]}")
            elif start[tp] < earliest[tp]:
                report_loss(self.options.fail_on_data_loss, f"{tp[0]}-{tp[1]}: offsets {start[tp]} to "
                                                            f"{earliest[tp]} were deleted (retention?)")
        return plan(self.options, start, end)

    def read(self, partition: KafkaRange) -> Iterator[pa.RecordBatch]:
        """The records of one range (see :func:`read_range`)."""
        return read_range(partition)


class KafkaStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """``spark.readStream.format("twophase-kafka")``: micro-batches over Spark Kafka offsets.

    Its driver-side calls share one admin client, opened at the first and closed by ``stop()``;
    Spark also pickles the reader to its executors for ``read``, without that client.
    """

    def __init__(self, options: SourceOptions) -> None:
        self.options = options
        self._planner: OffsetPlanner | None = None
        self._target: Offsets | None = None  # Trigger.AvailableNow: where the query stops

    def __getstate__(self) -> dict:
        return {"options": self.options, "_planner": None, "_target": None}

    @property
    def planner(self) -> OffsetPlanner:
        if self._planner is None:
            self._planner = OffsetPlanner(self.options)
        return self._planner

    def initialOffset(self) -> dict:
        """startingOffsets resolved against the partitions there are now."""
        partitions = self.planner.current_partitions()
        return to_json(self.planner.resolve(self.options.starting, "startingOffsets", partitions))

    def getDefaultReadLimit(self) -> ReadLimit:
        """maxOffsetsPerTrigger as ReadMaxRows, else everything available."""
        limit = self.options.max_offsets_per_trigger
        return ReadAllAvailable() if limit is None else ReadMaxRows(limit)

    def latestOffset(self, start: dict, limit: ReadLimit) -> dict:
        """The next batch's end (see OffsetPlanner.latest_offsets); ``limit`` is what Spark asks for."""
        max_rows = limit.max_rows if isinstance(limit, ReadMaxRows) else None
        return to_json(self.planner.latest_offsets(from_json(start), max_rows, self._target))

    def reportLatestOffset(self) -> dict | None:
        """Every offset readable when the last batch was planned, past maxOffsetsPerTrigger and
        Trigger.AvailableNow's end (the query progress's ``latestOffset``: the backlog, for lag)."""
        available = self._planner.available if self._planner is not None else None
        return None if available is None else to_json(available)

    def prepareForTriggerAvailableNow(self) -> None:
        """Trigger.AvailableNow: the query ends at the offsets readable now."""
        partitions = self.planner.current_partitions()
        self._target = self.planner.latest(partitions)
        log.info("Trigger.AvailableNow: reading up to %s", to_json(self._target))

    def partitions(self, start: dict, end: dict) -> list[KafkaRange]:
        """One range per partition with offsets between ``start`` and ``end``."""
        return plan(self.options, from_json(start), from_json(end))

    def read(self, partition: KafkaRange) -> Iterator[pa.RecordBatch]:
        """The records of one range (see :func:`read_range`)."""
        return read_range(partition)

    def stop(self) -> None:
        """Close the driver-side client."""
        if self._planner is not None:
            self._planner.close()
            self._planner = None


class KafkaSource(DataSource):
    """The ``twophase-kafka`` data source; options are checked when the DataFrame is defined.

    Usage::

        twophase.spark.register(spark)   # not spark.dataSource.register: see streams._register_with_shared_environment
        spark.read.format("twophase-kafka").option("kafka.bootstrap.servers", "h:9092") \\
            .option("subscribe", "orders").load()
    """

    @classmethod
    def name(cls) -> str:
        return NAME

    def schema(self) -> StructType:
        """Spark Kafka's schema, with ``headers`` under includeHeaders=true."""
        return SCHEMA_WITH_HEADERS if parse_options(self.options, streaming=None).include_headers else SCHEMA

    def reader(self, schema: StructType) -> KafkaBatchReader:
        return KafkaBatchReader(parse_options(self.options, streaming=False))

    def streamReader(self, schema: StructType) -> KafkaStreamReader:
        return KafkaStreamReader(parse_options(self.options, streaming=True))

    def streamWriter(self, schema: StructType, overwrite: bool) -> TwoPhaseStreamWriter:  # noqa: N802
        """Spark's Kafka sink, exactly once (twophase/spark/kafka_sink.py)."""
        return kafka_stream_writer(self.options, schema)

    def writer(self, schema: StructType, overwrite: bool) -> DataSourceWriter:
        """Refused: a batch DataFrame has no micro-batch epoch to commit on (Spark's own Kafka batch write is
        at least once)."""
        raise NotInStream(BATCH_WRITE_REFUSED)
