"""The contract's batch step: the default hands each row of an Arrow batch to ``write``."""

import pickle

import pyarrow as pa
import pytest

from twophase.sink import Record, TwoPhaseCommitSink


class ListSink(TwoPhaseCommitSink):
    """Keeps written rows in the transaction (a list); only write matters here."""

    def begin_transaction(self, ctx):
        return []

    def write(self, txn, row):
        txn.append(row)

    def pre_commit(self, txn):
        return list(txn)

    def commit(self, handle):
        pass

    def abort(self, handle):
        pass

    def abort_transaction(self, txn):
        pass


def test_default_write_batch_writes_every_row_in_order():
    batch = pa.RecordBatch.from_pydict({"id": [1, 2, 3], "name": ["a", None, "c"]})
    txn = []
    ListSink().write_batch(txn, batch)
    assert txn == [{"id": 1, "name": "a"}, {"id": 2, "name": None}, {"id": 3, "name": "c"}]


def test_an_empty_batch_writes_nothing():
    txn = []
    ListSink().write_batch(txn, pa.RecordBatch.from_pydict({"id": pa.array([], pa.int64())}))
    assert txn == []


def test_a_record_reads_like_a_spark_row_by_name():
    row = Record({"id": 7, "nested": {"x": 1}})
    assert (row.id, row["id"], row.nested) == (7, 7, {"x": 1})
    assert row.asDict() == {"id": 7, "nested": {"x": 1}} and type(row.asDict()) is dict
    assert row.asDict(recursive=True) == {"id": 7, "nested": {"x": 1}}
    with pytest.raises(AttributeError, match="missing"):
        row.missing
    assert pickle.loads(pickle.dumps(row)) == row
