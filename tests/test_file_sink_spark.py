"""Spark reads what FileSink commits as Parquet, and nothing it has not committed.

FileSink is driven directly (no streaming query): one attempt writes Arrow batches, one writes
rows, one is pre-committed but never committed, and a killed one left half a file in staging. ``spark.read.parquet`` of
the directory must return exactly the committed rows, with Spark's types.
"""

from __future__ import annotations

import datetime
from decimal import Decimal

import pyarrow as pa
import pytest

from sinks.files import FileSink, read_committed_rows
from twophase.sink import TxnContext

pytestmark = pytest.mark.spark

UTC = datetime.UTC
# What Spark's Arrow batches carry: microsecond timestamps with the session's zone.
SCHEMA = pa.schema([
    ("id", pa.int64()),
    ("name", pa.string()),
    ("amount", pa.float64()),
    ("ok", pa.bool_()),
    ("at", pa.timestamp("us", tz="UTC")),
    ("day", pa.date32()),
    ("price", pa.decimal128(7, 2)),
    ("raw", pa.binary()),
    ("inner", pa.struct([("x", pa.int32()), ("y", pa.string())])),
    ("tags", pa.list_(pa.string())),
])


def row(i: int) -> dict:
    return {
        "id": i,
        "name": None if i % 3 == 0 else f"name-{i}",
        "amount": i / 4,
        "ok": i % 2 == 0,
        "at": datetime.datetime(2024, 1, 1, tzinfo=UTC) + datetime.timedelta(seconds=i, microseconds=i),
        "day": datetime.date(2024, 1, 1) + datetime.timedelta(days=i),
        "price": Decimal(i) / 100,
        "raw": bytes([i % 256, 0]),
        "inner": None if i % 5 == 0 else {"x": i, "y": "y"},
        "tags": [] if i % 4 == 0 else ["a", str(i)],
    }


def ctx(partition: int) -> TxnContext:
    return TxnContext("app", "q", "run1", 0, partition, 0)


def test_spark_reads_the_committed_parquet_files_only(spark, tmp_path):
    sink = FileSink(str(tmp_path / "out"), format="parquet", schema=SCHEMA, row_group_size=100)
    batches = sink.begin_transaction(ctx(0))
    for start in (0, 150):
        sink.write_batch(batches, pa.RecordBatch.from_pylist([row(i) for i in range(start, start + 150)], SCHEMA))
    rows = sink.begin_transaction(ctx(1))
    for i in range(300, 350):
        sink.write(rows, row(i))
    handles = [sink.pre_commit(txn) for txn in (batches, rows)]
    for handle in handles:
        sink.commit(handle)
    never_committed = sink.begin_transaction(ctx(2))
    sink.write_batch(never_committed, pa.RecordBatch.from_pylist([row(1000)], SCHEMA))
    sink.pre_commit(never_committed)
    # What a task killed mid-write leaves: a staging file without its footer.
    with open(handles[0].final, "rb") as f:
        (tmp_path / "out" / "_staging" / f"{ctx(3).name}.parquet").write_bytes(f.read(1000))

    frame = spark.read.parquet(sink.path)
    assert frame.schema.simpleString() == (
        "struct<id:bigint,name:string,amount:double,ok:boolean,at:timestamp,day:date,price:decimal(7,2),"
        "raw:binary,inner:struct<x:int,y:string>,tags:array<string>>"
    )
    # Timestamps as microseconds since the epoch: Spark hands back local, zone-less datetimes.
    seen = sorted((r.asDict(recursive=True) for r in frame.selectExpr("*", "unix_micros(at) AS at_us").collect()),
                  key=lambda r: r["id"])
    expected = [row(i) for i in range(350)]
    assert [r["id"] for r in seen] == list(range(350))
    for got, want in zip(seen, expected):
        got["at"] = got.pop("at_us")
        want["at"] = (want["at"] - datetime.datetime(1970, 1, 1, tzinfo=UTC)) // datetime.timedelta(microseconds=1)
        assert got == want
    assert len(read_committed_rows(sink.path)) == 350
