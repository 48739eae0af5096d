import datetime
import math
import os
import pickle
import subprocess
import sys
from decimal import Decimal

import cloudpickle
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pyspark.sql import Row

from sinks.files import FileHandle, FileSink, read_committed_rows
from tests.harness import stage
from twophase.sink import CommitFailed, Record, TxnContext

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def ctx(epoch=0, partition=0, attempt=0):
    return TxnContext("app", "q", "run1", epoch, partition, attempt)


@pytest.fixture(params=[("jsonl", True), ("jsonl", False), ("parquet", True), ("parquet", False)],
                ids=["jsonl-fsync", "jsonl-nofsync", "parquet-fsync", "parquet-nofsync"])
def sink(tmp_path, request):
    fmt, fsync = request.param
    return FileSink(str(tmp_path / "out"), fsync=fsync, format=fmt)


@pytest.fixture
def json_sink(tmp_path):
    return FileSink(str(tmp_path / "out"))


@pytest.fixture
def parquet_sink(tmp_path):
    return FileSink(str(tmp_path / "out"), format="parquet")


def stage_batches(sink, ctx, *batches):
    """Begin a transaction and write Arrow batches into it."""
    txn = sink.begin_transaction(ctx)
    for batch in batches:
        sink.write_batch(txn, batch)
    return txn


def files_under(path):
    return sorted(os.path.relpath(os.path.join(d, f), path) for d, _, fs in os.walk(path) for f in fs)


def test_invisible_until_commit(sink):
    txn = stage(sink, ctx(), [{"a": 1}, {"a": 2}])
    assert read_committed_rows(sink.path) == []
    handle = sink.pre_commit(txn)
    assert read_committed_rows(sink.path) == []
    assert os.path.exists(handle.pending) and handle.rows == 2
    sink.commit(handle)
    assert read_committed_rows(sink.path) == [{"a": 1}, {"a": 2}]
    assert files_under(sink.path) == [os.path.basename(handle.final)]


def test_spark_rows_and_json_types(json_sink):
    sink = json_sink
    row = Row(id=1, day=datetime.date(2024, 1, 2), amount=Decimal("1.50"), inner=Row(x="y"))
    handle = sink.pre_commit(stage(sink, ctx(), [row]))
    sink.commit(handle)
    assert read_committed_rows(sink.path) == [
        {"id": 1, "day": "2024-01-02", "amount": "1.50", "inner": {"x": "y"}}
    ]
    with open(handle.final) as f:
        assert ", " not in f.read()


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_custom_serializer_and_unserializable_row(tmp_path, fmt):
    sink = FileSink(str(tmp_path), serializer=lambda t: {"v": t[0]}, format=fmt)
    sink.commit(sink.pre_commit(stage(sink, ctx(), [(7,)])))
    assert read_committed_rows(str(tmp_path)) == [{"v": 7}]
    other = FileSink(str(tmp_path), format=fmt)
    txn = other.begin_transaction(ctx(1))
    with pytest.raises(TypeError, match="serializer="):
        other.write(txn, (7,))
    other.abort_transaction(txn)
    assert read_committed_rows(str(tmp_path)) == [{"v": 7}]


def test_commit_twice_is_once(sink):
    handle = sink.pre_commit(stage(sink, ctx(), [{"a": 1}]))
    sink.commit(handle)
    sink.commit(handle)
    assert read_committed_rows(sink.path) == [{"a": 1}]


def test_abort_before_pre_commit(sink):
    txn = stage(sink, ctx(), [{"a": 1}])
    sink.abort_transaction(txn)
    sink.abort_transaction(txn)
    assert txn.file.closed
    assert files_under(sink.path) == []


def test_abort_after_pre_commit(sink):
    handle = sink.pre_commit(stage(sink, ctx(), [{"a": 1}]))
    sink.abort(handle)
    sink.abort(handle)
    assert files_under(sink.path) == []
    with pytest.raises(CommitFailed, match="lost"):
        sink.commit(handle)


def test_abort_after_commit_keeps_data(sink):
    handle = sink.pre_commit(stage(sink, ctx(), [{"a": 1}]))
    sink.commit(handle)
    sink.abort(handle)
    assert read_committed_rows(sink.path) == [{"a": 1}]


def test_empty_transaction(sink):
    handle = sink.pre_commit(stage(sink, ctx(), []))
    assert handle.rows == 0
    sink.commit(handle)
    sink.abort(handle)
    assert files_under(sink.path) == []
    assert read_committed_rows(sink.path) == []


def test_commit_with_both_files_gone_raises(sink):
    handle = sink.pre_commit(stage(sink, ctx(), [{"a": 1}]))
    os.unlink(handle.pending)
    with pytest.raises(CommitFailed):
        sink.commit(handle)


def test_handle_commits_in_another_process(sink, tmp_path):
    handle = sink.pre_commit(stage(sink, ctx(), [{"a": 1}]))
    payload = cloudpickle.dumps((sink, handle))
    assert cloudpickle.loads(payload)[1] == handle
    # A different cwd checks the handle carries absolute paths.
    subprocess.run(
        [sys.executable, "-c",
         "import sys, cloudpickle; s, h = cloudpickle.loads(sys.stdin.buffer.read()); s.commit(h)"],
        input=payload, cwd=tmp_path, env={**os.environ, "PYTHONPATH": ROOT}, check=True,
    )
    assert read_committed_rows(sink.path) == [{"a": 1}]


def test_concurrent_attempts_do_not_clash(sink):
    t0, t1 = sink.begin_transaction(ctx(attempt=0)), sink.begin_transaction(ctx(attempt=1))
    for i in range(3):
        sink.write(t0, {"attempt": 0, "i": i})
        sink.write(t1, {"attempt": 1, "i": i})
    h0, h1 = sink.pre_commit(t0), sink.pre_commit(t1)
    assert len({h0.pending, h1.pending, h0.final, h1.final}) == 4
    sink.commit(h1)
    sink.abort(h0)
    assert read_committed_rows(sink.path) == [{"attempt": 1, "i": i} for i in range(3)]


def test_reader_skips_invisible_and_foreign_files(tmp_path):
    for name in ["_x.jsonl", ".y.jsonl", "notes.txt"]:
        (tmp_path / name).write_text('{"a":1}\n')
    assert read_committed_rows(str(tmp_path)) == []
    assert read_committed_rows(str(tmp_path / "missing")) == []


def test_handle_is_frozen():
    with pytest.raises(AttributeError):
        FileHandle("p", "f", 1).rows = 2


def test_reader_skips_invisible_parquet(tmp_path, parquet_sink):
    parquet_sink.commit(parquet_sink.pre_commit(stage(parquet_sink, ctx(), [{"a": 1}])))
    for name in ["_x.parquet", ".y.parquet"]:
        (tmp_path / "out" / name).write_bytes(b"not parquet at all")
    assert read_committed_rows(parquet_sink.path) == [{"a": 1}]


def test_reader_reads_both_formats_in_name_order(tmp_path):
    for epoch, fmt in enumerate(["parquet", "jsonl"]):
        sink = FileSink(str(tmp_path), format=fmt)
        sink.commit(sink.pre_commit(stage(sink, ctx(epoch), [{"fmt": fmt}])))
    assert read_committed_rows(str(tmp_path)) == [{"fmt": "parquet"}, {"fmt": "jsonl"}]


# --- the batch path: write_batch ---------------------------------------------------------------------


def batch_of(**columns):
    return pa.RecordBatch.from_pydict(columns)


def test_write_batch_is_invisible_until_commit(sink):
    first, second = batch_of(id=[1, 2], name=["a", None]), batch_of(id=[3], name=["c"])
    txn = stage_batches(sink, ctx(), first, second)
    assert read_committed_rows(sink.path) == []
    handle = sink.pre_commit(txn)
    assert handle.rows == 3 and read_committed_rows(sink.path) == []
    sink.commit(handle)
    assert read_committed_rows(sink.path) == first.to_pylist() + second.to_pylist()
    assert files_under(sink.path) == [os.path.basename(handle.final)]
    assert handle.final.endswith(".parquet" if sink.format == "parquet" else ".jsonl")


def test_a_batch_transaction_aborted_leaves_nothing(sink):
    txn = stage_batches(sink, ctx(attempt=0), batch_of(id=[1, 2]))
    sink.abort_transaction(txn)
    sink.abort_transaction(txn)
    handle = sink.pre_commit(stage_batches(sink, ctx(attempt=1), batch_of(id=[3])))
    sink.abort(handle)
    sink.abort(handle)
    assert files_under(sink.path) == []


def test_empty_batches_leave_no_file(sink):
    handle = sink.pre_commit(stage_batches(sink, ctx(), batch_of(id=pa.array([], pa.int64()))))
    assert handle.rows == 0
    sink.commit(handle)
    assert files_under(sink.path) == []


CRASH = """
import os, sys, cloudpickle
sink, batch, writing, precommitted = cloudpickle.loads(sys.stdin.buffer.read())
txn = sink.begin_transaction(writing)
sink.write_batch(txn, batch)
sink.write_batch(txn, batch)
txn = sink.begin_transaction(precommitted)
sink.write_batch(txn, batch)
sink.pre_commit(txn)
os._exit(9)  # a killed task: one attempt mid-write, one pre-committed, neither registered
"""


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_crash_leftovers_are_invisible_and_cleaned_up(tmp_path, fmt):
    sink = FileSink(str(tmp_path / "out"), format=fmt)
    committed = sink.pre_commit(stage_batches(sink, ctx(partition=2), batch_of(id=[7])))
    sink.commit(committed)
    child = cloudpickle.dumps((sink, batch_of(id=[1, 2]), ctx(partition=0), ctx(partition=1)))
    died = subprocess.run([sys.executable, "-c", CRASH], input=child, env={**os.environ, "PYTHONPATH": ROOT},
                          check=False)
    assert died.returncode == 9
    leftovers = [f"_pending/run1.0.1.0.{fmt}", f"_staging/run1.0.0.0.{fmt}"]
    assert files_under(sink.path) == sorted([*leftovers, os.path.basename(committed.final)])
    assert read_committed_rows(sink.path) == [{"id": 7}]
    for partition in (0, 1):
        sink.abort_unregistered(ctx(partition=partition))
        sink.abort_unregistered(ctx(partition=partition))
    assert files_under(sink.path) == [os.path.basename(committed.final)]


# --- Parquet ---------------------------------------------------------------------------------------


def test_parquet_round_trip_of_spark_rows(parquet_sink):
    sink = parquet_sink
    rows = [
        Row(id=1, day=datetime.date(2024, 1, 2), amount=Decimal("1.50"), inner=Row(x="y"), tags=["a"]),
        Row(id=2, day=None, amount=Decimal("-0.25"), inner=None, tags=[]),
    ]
    handle = sink.pre_commit(stage(sink, ctx(), rows))
    sink.commit(handle)
    assert os.path.basename(handle.final) == "part-00000000-00000-run1-0.parquet"
    assert read_committed_rows(sink.path) == [row.asDict(recursive=True) for row in rows]
    schema = pq.read_schema(handle.final)
    assert (schema.field("day").type, schema.field("amount").type) == (pa.date32(), pa.decimal128(3, 2))


def test_parquet_keeps_a_batch_as_it_is(parquet_sink):
    sink = parquet_sink
    batch = mixed_batch()
    handle = sink.pre_commit(stage_batches(sink, ctx(), batch, batch.slice(1, 2)))
    sink.commit(handle)
    table = pq.read_table(handle.final)
    assert table.schema.equals(batch.schema)
    # repr, because NaN equals nothing, not even itself.
    assert repr(table.to_pylist()) == repr(batch.to_pylist() + batch.slice(1, 2).to_pylist())


def test_parquet_rows_and_batches_keep_their_order_in_row_groups(tmp_path):
    sink = FileSink(str(tmp_path), format="parquet", row_group_size=2)
    txn = sink.begin_transaction(ctx())
    sink.write(txn, {"id": 1})
    sink.write_batch(txn, batch_of(id=[2, 3, 4]))
    sink.write(txn, {"id": 5})
    sink.write(txn, {"id": 6})
    handle = sink.pre_commit(txn)
    sink.commit(handle)
    assert [r["id"] for r in read_committed_rows(str(tmp_path))] == [1, 2, 3, 4, 5, 6]
    assert pq.ParquetFile(handle.final).metadata.num_row_groups == 3  # [1, 2], [3, 4], [5, 6]


def test_parquet_infers_columns_from_every_row(parquet_sink):
    sink = parquet_sink
    sink.commit(sink.pre_commit(stage(sink, ctx(), [{"a": 1}, {"a": 2, "b": "x"}])))
    assert read_committed_rows(sink.path) == [{"a": 1, "b": None}, {"a": 2, "b": "x"}]


def test_parquet_refuses_a_batch_of_another_schema(parquet_sink):
    sink = parquet_sink
    txn = stage_batches(sink, ctx(), batch_of(id=[1]))
    with pytest.raises(ValueError, match="a batch with another schema than the file's") as raised:
        sink.write_batch(txn, batch_of(id=["1"]))
    assert "id: string" in str(raised.value) and "id: int64" in str(raised.value)
    sink.abort_transaction(txn)
    assert files_under(sink.path) == []


def test_parquet_refuses_rows_that_do_not_fit_the_schema(tmp_path):
    sink = FileSink(str(tmp_path), format="parquet", row_group_size=1)
    txn = stage(sink, ctx(), [{"id": 1}])
    with pytest.raises(ValueError, match=r"do not fit .*schema=.*int64"):
        sink.write(txn, {"id": "one"})
    with pytest.raises(ValueError, match=r"columns \['extra'\] that the file's schema has not"):
        sink.write(txn, {"id": 2, "extra": 3})  # pyarrow alone would drop "extra" silently
    sink.abort_transaction(txn)
    assert files_under(str(tmp_path)) == []


def test_parquet_schema_setting_fixes_the_files_schema(tmp_path):
    schema = pa.schema([("id", pa.int64()), ("note", pa.string())])
    sink = FileSink(str(tmp_path), format="parquet", schema=schema)
    handle = sink.pre_commit(stage(sink, ctx(), [{"id": 1, "note": None}, {"id": 2}]))
    sink.commit(handle)
    assert pq.read_schema(handle.final).remove_metadata() == schema
    assert read_committed_rows(str(tmp_path)) == [{"id": 1, "note": None}, {"id": 2, "note": None}]
    txn = sink.begin_transaction(ctx(1))
    with pytest.raises(ValueError, match="another schema"):
        sink.write_batch(txn, batch_of(id=[3]))
    sink.abort_transaction(txn)


def test_parquet_refuses_nanoseconds_it_would_truncate(parquet_sink):
    sink = parquet_sink
    txn = stage_batches(sink, ctx(), batch_of(t=pa.array([1], pa.timestamp("ns"))))
    with pytest.raises(pa.ArrowInvalid, match="would lose data"):
        sink.pre_commit(txn)
    sink.abort_transaction(txn)
    assert files_under(sink.path) == []


# --- JSON lines: write_batch writes what write writes ----------------------------------------------


def mixed_batch():
    utc = datetime.UTC
    return pa.RecordBatch.from_pydict({
        "i": pa.array([1, None, -(2**63), 2**63 - 1], pa.int64()),
        "u8": pa.array([0, 255, None, 7], pa.uint8()),
        "f": [0.1, None, math.inf, math.nan],
        "f32": pa.array([1.5, None, -math.inf, 1e-7], pa.float32()),
        "big": [1e20, 1.0, -0.0, 123456789.125],
        "ok": [True, False, None, True],
        "s": ["plain", None, 'quote " comma , pct %s slash \\ é 🙂 \n tab\t', ""],
        "ls": pa.array(["x", "y,z", None, "\x00"], pa.large_string()),
        'we%ird "key" clé': [1, 2, 3, 4],
        "n": [{"x": 1, "y": "a"}, None, {"x": None, "y": "b,c"}, {"x": 2, "y": None}],
        "l": [[1, 2], [], None, [None]],
        "m": pa.array([[("k", 1)], None, [], [("a", None)]], pa.map_(pa.string(), pa.int64())),
        "ts": pa.array([datetime.datetime(2024, 1, 2, 3, 4, 5), datetime.datetime(2024, 1, 2, 3, 4, 5, 7),
                        None, datetime.datetime(1970, 1, 1)], pa.timestamp("us")),
        "tz": pa.array([datetime.datetime(2024, 1, 2, 3, 4, 5, tzinfo=utc), None,
                        datetime.datetime(2024, 6, 1, tzinfo=utc), datetime.datetime(2000, 1, 1, tzinfo=utc)],
                       pa.timestamp("us", tz="UTC")),
        "d": pa.array([datetime.date(2024, 1, 2), None, datetime.date(1, 1, 1), datetime.date(9999, 12, 31)]),
        "dec": pa.array([Decimal("1.50"), None, Decimal("-0.01"), Decimal("123.00")], pa.decimal128(5, 2)),
        "bin": [b"\x00ab'\"", None, b"", b"x,y"],
        "dur": pa.array([datetime.timedelta(seconds=90), None, datetime.timedelta(0), datetime.timedelta(days=-1)]),
        "nothing": pa.array([None] * 4, pa.null()),
    })


def json_written(path, write):
    sink = FileSink(str(path))
    txn = sink.begin_transaction(ctx())
    write(sink, txn)
    handle = sink.pre_commit(txn)
    sink.commit(handle)
    with open(handle.final, "rb") as f:
        return f.read()


@pytest.mark.parametrize("batch", [
    mixed_batch(),
    pa.RecordBatch.from_arrays([pa.array([1]), pa.array([2])], names=["a", "a"]),  # a row dict keeps one
    pa.RecordBatch.from_struct_array(pa.array([{}, {}], pa.struct([]))),  # rows without columns
], ids=["types", "duplicate-names", "no-columns"])
def test_json_lines_of_a_batch_are_those_of_its_rows(tmp_path, batch):
    by_rows = json_written(tmp_path / "rows", lambda sink, txn: [sink.write(txn, Record(r)) for r in batch.to_pylist()])
    by_batch = json_written(tmp_path / "batch", lambda sink, txn: sink.write_batch(txn, batch))
    assert by_batch == by_rows and by_batch.count(b"\n") == batch.num_rows


def test_json_lines_of_a_batch_spell_values_as_json_dumps_with_default_str(tmp_path):
    batch = mixed_batch().select(["i", "f", "s", "ts", "tz", "bin", "dec"]).slice(0, 1)
    line = json_written(tmp_path, lambda sink, txn: sink.write_batch(txn, batch)).decode()
    # Binary is the JSON string of str(bytes), as json.dumps(default=str) makes it; timestamps str(datetime).
    assert line == (r'''{"i":1,"f":0.1,"s":"plain","ts":"2024-01-02 03:04:05","tz":"2024-01-02 03:04:05+00:00",'''
                    r'''"bin":"b'\\x00ab\\'\"'","dec":"1.50"}''' "\n")


def test_a_custom_serializer_sees_every_row_of_a_batch(tmp_path):
    sink = FileSink(str(tmp_path), serializer=lambda row: {"double": row.id * 2})
    sink.commit(sink.pre_commit(stage_batches(sink, ctx(), batch_of(id=[1, 2]))))
    assert read_committed_rows(str(tmp_path)) == [{"double": 2}, {"double": 4}]


# --- compatibility and settings --------------------------------------------------------------------

# pickle.dumps((FileSink("/OLD/out"), FileHandle(...)), protocol=0) by the JSON-lines-only FileSink
# (commit ca33034): the sink and the handle as ZooKeeper may hold them from before the upgrade.
OLD_PICKLE = (
    b"(ccopy_reg\n_reconstructor\np0\n(csinks.files\nFileSink\np1\nc__builtin__\nobject\np2\nNtp3\nRp4\n(dp5\n"
    b"Vpath\np6\nV/OLD/out\np7\nsVfsync\np8\nI01\nsVserializer\np9\ncsinks.files\n_default_serializer\np10\nsbg0\n"
    b"(csinks.files\nFileHandle\np11\ng2\nNtp12\nRp13\n(dp14\nVpending\np15\nV/OLD/out/_pending/r0.3.1.0.jsonl\n"
    b"p16\nsVfinal\np17\nV/OLD/out/part-00000003-00001-r0-0.jsonl\np18\nsVrows\np19\nI2\nsbtp20\n."
)


def test_a_sink_and_handle_pickled_before_parquet_still_commit_and_clean_up(tmp_path):
    sink, handle = pickle.loads(OLD_PICKLE.replace(b"/OLD", str(tmp_path).encode()))
    os.makedirs(tmp_path / "out" / "_pending")
    with open(handle.pending, "w") as f:
        f.write('{"a":1}\n{"a":2}\n')
    sink.commit(handle)
    sink.commit(handle)
    assert read_committed_rows(sink.path) == [{"a": 1}, {"a": 2}]
    assert (sink.format, sink.schema) == ("jsonl", None)
    staged = sink.pre_commit(stage_batches(sink, ctx(epoch=4), batch_of(a=[3])))
    sink.commit(staged)
    assert read_committed_rows(sink.path) == [{"a": 1}, {"a": 2}, {"a": 3}]
    stage_batches(sink, ctx(1), batch_of(a=[4])).file.close()  # a dead attempt's staging file
    sink.abort_unregistered(ctx(1))
    assert files_under(sink.path) == sorted(os.path.basename(h.final) for h in (handle, staged))


@pytest.mark.parametrize("settings, named", [
    ({"format": "csv"}, "format='csv'"),
    ({"format": "jsonl", "schema": pa.schema([("a", pa.int64())])}, "schema="),
    ({"format": "parquet", "schema": {"a": "int64"}}, "schema="),
    ({"format": "parquet", "row_group_size": 0}, "row_group_size=0"),
    ({"path": "s3a://bucket/out"}, "not a URL"),
])
def test_bad_settings_are_refused_by_name(tmp_path, settings, named):
    with pytest.raises(ValueError, match=named.replace("(", r"\(")):
        FileSink(**{"path": str(tmp_path), **settings})


@settings(max_examples=100, deadline=None)
@given(st.lists(st.one_of(st.none(), st.datetimes(), st.datetimes().map(lambda t: t.replace(microsecond=0))),
                min_size=1, max_size=20),
       st.sampled_from([None, "UTC"]))
def test_json_lines_of_any_timestamps_are_those_of_their_rows(tmp_path_factory, times, zone):
    zoned = [t if t is None or zone is None else t.replace(tzinfo=datetime.UTC) for t in times]
    batch = batch_of(t=pa.array(zoned, pa.timestamp("us", tz=zone)))
    path = tmp_path_factory.mktemp("times")
    by_rows = json_written(path / "rows", lambda sink, txn: [sink.write(txn, Record(r)) for r in batch.to_pylist()])
    assert json_written(path / "batch", lambda sink, txn: sink.write_batch(txn, batch)) == by_rows
