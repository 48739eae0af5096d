import datetime
import os
import subprocess
import sys
from decimal import Decimal

import cloudpickle
import pytest
from pyspark.sql import Row

from sinks.files import FileHandle, FileSink, read_committed_rows
from tests.harness import stage
from twophase.sink import CommitFailed, TxnContext

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def ctx(epoch=0, partition=0, attempt=0):
    return TxnContext("app", "q", "run1", epoch, partition, attempt)


@pytest.fixture(params=[True, False], ids=["fsync", "nofsync"])
def sink(tmp_path, request):
    return FileSink(str(tmp_path / "out"), fsync=request.param)


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


def test_spark_rows_and_json_types(sink):
    row = Row(id=1, day=datetime.date(2024, 1, 2), amount=Decimal("1.50"), inner=Row(x="y"))
    handle = sink.pre_commit(stage(sink, ctx(), [row]))
    sink.commit(handle)
    assert read_committed_rows(sink.path) == [
        {"id": 1, "day": "2024-01-02", "amount": "1.50", "inner": {"x": "y"}}
    ]
    with open(handle.final) as f:
        assert ", " not in f.read()


def test_custom_serializer_and_unserializable_row(tmp_path):
    sink = FileSink(str(tmp_path), serializer=lambda t: {"v": t[0]})
    sink.commit(sink.pre_commit(stage(sink, ctx(), [(7,)])))
    assert read_committed_rows(str(tmp_path)) == [{"v": 7}]
    with pytest.raises(TypeError):
        stage(FileSink(str(tmp_path)), ctx(1), [(7,)])


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
