import contextlib
import json
import os
import sqlite3
import subprocess
import sys
import threading

import cloudpickle
import pytest
from pyspark.sql import Row

from examples.custom_sink import SqliteSink
from tests.harness import stage
from twophase.sink import TxnContext

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def ctx(epoch=0, partition=0, attempt=0):
    return TxnContext("app", "q", "run1", epoch, partition, attempt)


@pytest.fixture
def sink(tmp_path):
    return SqliteSink(str(tmp_path / "out.db"))


def visible(sink):
    # closing(): a sqlite3 connection's own context manager ends the transaction but leaves the file open.
    with contextlib.closing(sqlite3.connect(sink.path)) as db:
        return [json.loads(d) for (d,) in db.execute("SELECT data FROM rows ORDER BY rowid")]


def staged(sink):
    with contextlib.closing(sqlite3.connect(sink.path)) as db:
        return db.execute("SELECT count(*) FROM staging").fetchone()[0]


def test_invisible_until_commit(sink):
    txn = stage(sink, ctx(), [Row(a=1), {"a": 2}])
    handle = sink.pre_commit(txn)
    assert visible(sink) == [] and staged(sink) == 2
    # Staged rows are committed in SQLite: a fresh process-like instance sees them.
    assert staged(cloudpickle.loads(cloudpickle.dumps(sink))) == 2
    sink.commit(handle)
    assert visible(sink) == [{"a": 1}, {"a": 2}] and staged(sink) == 0


def test_commit_twice_is_once(sink):
    handle = sink.pre_commit(stage(sink, ctx(), [{"a": 1}]))
    sink.commit(handle)
    sink.commit(handle)
    assert visible(sink) == [{"a": 1}]


def test_abort_before_pre_commit(sink):
    txn = stage(sink, ctx(), [{"a": 1}])
    sink.abort_transaction(txn)
    sink.abort_transaction(txn)
    assert txn.rows == [] and not os.path.exists(sink.path)  # buffered only: the database was never touched


def test_abort_after_pre_commit(sink):
    handle = sink.pre_commit(stage(sink, ctx(), [{"a": 1}]))
    sink.abort(handle)
    sink.abort(handle)
    assert staged(sink) == 0
    sink.commit(handle)
    assert visible(sink) == []


def test_abort_after_commit_keeps_data(sink):
    handle = sink.pre_commit(stage(sink, ctx(), [{"a": 1}]))
    sink.commit(handle)
    sink.abort(handle)
    assert visible(sink) == [{"a": 1}]


def test_empty_transaction(sink):
    handle = sink.pre_commit(stage(sink, ctx(), []))
    sink.commit(handle)
    sink.commit(handle)
    sink.abort(handle)
    assert visible(sink) == [] and staged(sink) == 0


def test_handle_commits_in_another_process(sink, tmp_path):
    handle = sink.pre_commit(stage(sink, ctx(), [{"a": 1}]))
    payload = cloudpickle.dumps((sink, handle))
    subprocess.run(
        [sys.executable, "-c",
         "import sys, cloudpickle; s, h = cloudpickle.loads(sys.stdin.buffer.read()); s.commit(h)"],
        input=payload, cwd=tmp_path, env={**os.environ, "PYTHONPATH": ROOT}, check=True,
    )
    assert visible(sink) == [{"a": 1}]


def test_usable_from_other_threads(sink):
    handle = sink.pre_commit(stage(sink, ctx(), [{"a": 1}]))

    def commit_in_this_thread():
        sink.commit(handle)

    t = threading.Thread(target=commit_in_this_thread)
    t.start()
    t.join()
    assert visible(sink) == [{"a": 1}]


def test_concurrent_attempts_do_not_clash(sink):
    t0, t1 = sink.begin_transaction(ctx(attempt=0)), sink.begin_transaction(ctx(attempt=1))
    for i in range(3):
        sink.write(t0, {"attempt": 0, "i": i})
        sink.write(t1, {"attempt": 1, "i": i})
    h0, h1 = sink.pre_commit(t0), sink.pre_commit(t1)
    assert h0 != h1
    sink.commit(h1)
    sink.abort(h0)
    assert visible(sink) == [{"attempt": 1, "i": i} for i in range(3)]
    assert staged(sink) == 0
