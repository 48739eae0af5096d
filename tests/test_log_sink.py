"""LogSink against the real built-in broker, without Spark.

An independent confluent-kafka consumer (examples.log_sink_query.read_topic)
reads the topic: read_committed must see exactly the committed records,
read_uncommitted everything written, aborted records included.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import cloudpickle
import pytest

from examples.log_sink_query import read_topic
from sinks.log import LogHandle, LogSink, transactional_id
from tests.broker.conftest import broker, broker_factory, topic  # noqa: F401  (fixtures)
from tests.harness import Pipeline, stage
from twophase.client import Admin
from twophase.sink import AbortFailed, CommitFailed, TxnContext
from twophase.wire.records import iter_batches

REPO = Path(__file__).resolve().parents[1]


def ctx(run="r1", epoch=0, partition=0, attempt=0) -> TxnContext:
    return TxnContext("app", "q-1", run, epoch, partition, attempt)


@pytest.fixture
def sink(broker, topic) -> LogSink:
    broker.create_topic(topic, 3)
    return LogSink(broker.bootstrap, topic, key="id")


def rows(ids, batch=0):
    return [{"id": i, "batch": batch} for i in ids]


def committed_ids(sink: LogSink) -> list[int]:
    return sorted(json.loads(m.value())["id"] for m in read_topic(sink.bootstrap, sink.topic))


def all_ids(sink: LogSink) -> list[int]:
    return sorted(json.loads(m.value())["id"]
                  for m in read_topic(sink.bootstrap, sink.topic, isolation="read_uncommitted"))


def prepare(sink: LogSink, context: TxnContext, ids) -> LogHandle:
    return sink.pre_commit(stage(sink, context, rows(ids, context.epoch)))


def test_prepared_records_are_durable_and_invisible_until_commit(sink):
    handle = prepare(sink, ctx(), range(10))
    assert handle.records == 10 and handle.prepared is not None
    assert all_ids(sink) == list(range(10))   # written to the log
    assert committed_ids(sink) == []          # but not visible to read_committed
    sink.commit(handle)
    assert committed_ids(sink) == list(range(10))


def test_prepared_transaction_survives_a_broker_restart(broker_factory, topic, tmp_path):
    first = broker_factory(data_dir=tmp_path / "data")
    first.create_topic(topic, 3)
    sink = LogSink(first.bootstrap, topic, key="id")
    handle = prepare(sink, ctx(), range(8))
    port = first.port
    first.stop()
    broker_factory(data_dir=tmp_path / "data", port=port)   # the handle names this address
    assert committed_ids(sink) == []
    sink.commit(handle)
    assert committed_ids(sink) == list(range(8))


def test_abort_hides_records_and_unblocks_later_transactions(sink):
    aborted = prepare(sink, ctx(attempt=0), range(5))
    kept = prepare(sink, ctx(attempt=1), range(5, 9))
    sink.abort(aborted)
    sink.abort(aborted)  # idempotent
    sink.commit(kept)
    assert committed_ids(sink) == list(range(5, 9))
    assert all_ids(sink) == list(range(9))


def test_commit_twice_is_once(sink):
    handle = prepare(sink, ctx(), range(4))
    sink.commit(handle)
    sink.commit(handle)
    assert committed_ids(sink) == list(range(4))


def test_abort_after_commit_is_refused_loudly_and_keeps_records(sink):
    handle = prepare(sink, ctx(), range(3))
    sink.commit(handle)
    with pytest.raises(AbortFailed, match="committed already"):
        sink.abort(handle)
    assert committed_ids(sink) == list(range(3))


def test_abort_before_pre_commit(sink):
    txn = stage(sink, ctx(), rows(range(3)))
    sink.abort_transaction(txn)
    sink.abort_transaction(txn)
    sink.commit(prepare(sink, ctx(attempt=1), [7]))
    assert committed_ids(sink) == [7]


def test_empty_attempt_opens_no_transaction(sink):
    handle = sink.pre_commit(stage(sink, ctx(), []))
    assert handle.prepared is None and handle.records == 0
    sink.commit(handle)
    sink.abort(handle)
    assert all_ids(sink) == []


def test_handle_is_plain_and_survives_pickling(sink):
    handle = prepare(sink, ctx(), [1])
    copy = pickle.loads(pickle.dumps(handle))
    assert copy == handle and len(pickle.dumps(handle)) < 1024
    cloudpickle.loads(cloudpickle.dumps(sink)).commit(copy)
    assert committed_ids(sink) == [1]


def in_subprocess(script: str, *objects) -> str:
    """Run ``script`` in a fresh interpreter with ``args`` = the cloudpickled objects; return its stdout."""
    prelude = ("import sys, cloudpickle\n"
               "args = [cloudpickle.loads(bytes.fromhex(a)) for a in sys.argv[1:]]\n")
    out = subprocess.run([sys.executable, "-c", prelude + script, *(cloudpickle.dumps(o).hex() for o in objects)],
                         cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_commit_from_another_process_than_the_writer(sink):
    """The writer is a separate process that exits right after pre_commit; this process commits."""
    out = in_subprocess("import dataclasses, json\n"
                        "from tests.harness import stage\n"
                        "sink, context = args\n"
                        "txn = stage(sink, context, [{'id': i} for i in range(20)])\n"
                        "print(json.dumps(dataclasses.asdict(sink.pre_commit(txn))))\n",
                        sink, ctx(run="writer"))
    handle = LogHandle(**json.loads(out.strip().splitlines()[-1]))
    assert committed_ids(sink) == []
    sink.commit(handle)
    assert committed_ids(sink) == list(range(20))


def test_commit_in_another_process_than_the_writer(sink):
    """And the other way round: the coordinator's process is a fresh interpreter."""
    handle = prepare(sink, ctx(), range(6))
    in_subprocess("sink, handle = args\nsink.commit(handle)\n", sink, handle)
    assert committed_ids(sink) == list(range(6))


def test_transaction_aborted_by_an_operator_fails_the_commit_loudly(sink):
    handle = prepare(sink, ctx(), range(5))
    admin = Admin(sink.bootstrap)
    try:
        admin.abort_transaction(handle.transactional_id)
    finally:
        admin.close()
    with pytest.raises(CommitFailed, match="lost"):
        sink.commit(handle)
    sink.abort(handle)  # already gone: tolerated
    assert committed_ids(sink) == []


def test_abort_unregistered_cleans_up_a_dead_attempt(sink):
    """An attempt killed mid-write leaves an open 2PC transaction that never times out."""
    in_subprocess("import os\n"
                  "from tests.harness import stage\n"
                  "sink, context = args\n"
                  "txn = stage(sink, context, [{'id': i} for i in range(100, 105)])\n"
                  "txn.producer.flush()\n"
                  "os._exit(0)  # dies mid-transaction: no close, no abort\n",
                  sink, ctx(run="dead"))
    later = prepare(sink, ctx(run="r2"), range(4))
    sink.commit(later)
    assert committed_ids(sink) == []  # the open transaction holds back the last stable offset
    sink.abort_unregistered(ctx(run="dead"))
    sink.abort_unregistered(ctx(run="dead"))  # idempotent
    sink.abort_unregistered(ctx(run="never-began"))
    assert committed_ids(sink) == list(range(4))
    assert all_ids(sink) == list(range(4)) + list(range(100, 105))


def test_attempts_have_distinct_transactional_ids_and_do_not_fence_each_other(sink):
    first = stage(sink, ctx(attempt=0), rows([1]))
    second = stage(sink, ctx(attempt=1), rows([2]))   # both open at once
    assert first.transactional_id != second.transactional_id
    sink.commit(sink.pre_commit(first))
    sink.commit(sink.pre_commit(second))
    assert committed_ids(sink) == [1, 2]


def test_key_value_headers_and_provenance(broker, topic):
    broker.create_topic(topic, 1)
    sink = LogSink(broker.bootstrap, topic, key=lambda r: f"k{r['id']}", value="payload",
                   headers=lambda r: [("parity", "odd" if r["id"] % 2 else "even")], provenance=True)
    context = ctx(run="r9", epoch=3, partition=2, attempt=1)
    sink.commit(sink.pre_commit(stage(sink, context, [{"id": 1, "payload": "a"}, {"id": 2, "payload": {"x": 1}}])))
    records = read_topic(broker.bootstrap, topic)
    assert [(m.key(), m.value()) for m in records] == [(b"k1", b"a"), (b"k2", b'{"x":1}')]
    headers = dict(records[0].headers())
    assert headers["parity"] == b"odd"
    assert {k: headers[f"twophase.{k}"] for k in ("app", "run_id", "epoch", "partition", "attempt")} == {
        "app": b"app", "run_id": b"r9", "epoch": b"3", "partition": b"2", "attempt": b"1"}


def test_static_headers_and_serializer(broker, topic):
    broker.create_topic(topic, 1)
    sink = LogSink(broker.bootstrap, topic, value="n", serializer=lambda n: n.to_bytes(4, "big"),
                   headers={"source": "test"})
    sink.commit(sink.pre_commit(stage(sink, ctx(), [{"n": 258}])))
    [record] = read_topic(broker.bootstrap, topic)
    assert record.value() == b"\x00\x00\x01\x02" and record.headers() == [("source", b"test")]


def test_transactional_id_stays_within_limits():
    long = TxnContext("a" * 128, "q" * 36, "r" * 36, 2**31, 9999, 3)
    tid = transactional_id("twophase", long)
    assert len(tid) <= 249 and tid.endswith(f".{'r' * 36}.{2**31}.9999.3")
    assert tid != transactional_id("twophase", TxnContext("a" * 128, "p" * 36, "r" * 36, 2**31, 9999, 3))


@pytest.mark.parametrize("kwargs, error", [
    ({"bootstrap": "", "topic": "t"}, ValueError),
    ({"bootstrap": "h:1", "topic": ""}, ValueError),
    ({"bootstrap": "h:1", "topic": "t", "transactional_id_prefix": "a.b"}, ValueError),
    ({"bootstrap": "h:1", "topic": "t", "key": 3}, TypeError),
    ({"bootstrap": "h:1", "topic": "t", "producer": {"transactional_id": "x"}}, ValueError),
    ({"bootstrap": "h:1", "topic": "t", "producer": {"compression": "brotli"}}, ValueError),
    ({"bootstrap": "h:1", "topic": "t", "producer": {"compression.type": "zstd"}}, ValueError),
])
def test_bad_settings_are_refused(kwargs, error):
    """On the driver, when the sink is built: its producer opens only in a task."""
    with pytest.raises(error):
        LogSink(**kwargs)


def test_coordinator_commits_the_winner_and_aborts_the_loser(zk, zk_root, sink):
    """The whole second phase: signed handles in ZooKeeper, committed by the coordinator's process."""
    pipe = Pipeline(zk, zk_root, sink)
    speculative = pipe.begin("r1", 0, 0, attempt=1)  # opened before the winner registered
    assert pipe.task("r1", 0, 0, range(0, 5), attempt=0)
    assert pipe.finish(speculative, range(0, 5)) is False  # loses and aborts itself
    assert pipe.task("r1", 0, 1, range(5, 10))
    pipe.barrier(0, "r1")
    pipe.coordinator().reconcile()
    assert pipe.watermark() == 0
    assert committed_ids(sink) == list(range(10))
    assert all_ids(sink) == sorted(list(range(10)) + list(range(5)))


def test_zstd_compressed_transactions_commit_and_are_read_once(zk, zk_root, broker, topic):
    """Issue 12: producer={"compression": "zstd"} writes zstd batches; the coordinator commits the
    winners, a reader sees each committed row once and the loser's rows nowhere."""
    broker.create_topic(topic, 3)
    sink = LogSink(broker.bootstrap, topic, key="id", producer={"compression": "zstd", "linger_ms": 20})
    pipe = Pipeline(zk, zk_root, sink)
    speculative = pipe.begin("r1", 0, 0, attempt=1)
    assert pipe.task("r1", 0, 0, range(0, 200), attempt=0)
    assert pipe.finish(speculative, range(0, 200)) is False
    assert pipe.task("r1", 0, 1, range(200, 400))
    pipe.barrier(0, "r1")
    pipe.coordinator().reconcile()
    assert committed_ids(sink) == list(range(400))
    stored = [broker.call(lambda p=p: broker.partition_log(topic, p).read(0, 1 << 24)) for p in range(3)]
    codecs = {h.compression for data in stored for _, h in iter_batches(data) if not h.is_control}
    assert codecs == {4}  # zstd

