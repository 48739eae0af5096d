"""LogSink's pooled transactional ids (one per slot), through the harness against the real built-in
broker, in both commit modes: the ids on the broker stay bounded, every row is read once, zombies of
an earlier holder of a slot are fenced by the next holder's InitProducerId, and the one residual race
fails loudly."""

from __future__ import annotations

import contextlib
from dataclasses import replace

import pytest

from coordinator.precommits import IntentGone, IntentWatch
from coordinator.report import Operation, OperationFailed
from coordinator.state import EpochState
from sinks.log import LogSink, transactional_id
from tests.broker.conftest import broker_factory, topic  # noqa: F401  (fixtures)
from tests.harness import QUERY, Pipeline
from tests.test_log_sink import all_ids, committed_ids
from twophase.client import Admin, KafkaError, ProducerFenced
from twophase.sink import TxnContext
from twophase.task import TaskAttempt


@pytest.fixture(params=["prepared", "classic"])
def sink(request, broker_factory, topic) -> LogSink:
    """A LogSink in each commit mode: KIP-939 prepared transactions, or ordinary ones ended by EndTxn
    (a broker without two-phase commit, as Kafka is)."""
    broker = broker_factory(**({} if request.param == "prepared" else {"transaction_two_phase_commit": False}))
    broker.create_topic(topic, 3)
    return LogSink(broker.bootstrap, topic, key="id")


def broker_ids(sink: LogSink) -> list[str]:
    with Admin(sink.bootstrap) as admin:
        return [t.transactional_id for t in admin.list_transactions()]


def rows_of(epoch: int, partition: int) -> range:
    return range(epoch * 100 + partition * 10, epoch * 100 + partition * 10 + 3)


def run_epoch(pipe, app, epoch, partitions=1):
    for p in range(partitions):
        assert pipe.task("r1", epoch, p, rows_of(epoch, p))
    pipe.barrier(epoch, "r1")
    assert app.reconcile().ok and pipe.watermark() == epoch


def resume(pipe, zombie, ids):
    """A paused attempt carries on as its task would: more rows, then close(None) (pre-commit and register)."""
    try:
        pipe.finish(zombie, ids)
    finally:
        with contextlib.suppress(KafkaError):
            zombie.close(RuntimeError("the task failed"))  # what Spark does next; a no-op once close ran


def test_ids_stay_bounded_over_many_epochs_with_retries_and_every_row_is_read_once(zk, zk_root, sink):
    pipe = Pipeline(zk, zk_root, sink)
    app = pipe.coordinator()
    partitions, epochs, expected = 4, 52, []
    for epoch in range(epochs):
        for p in range(partitions):
            ids, attempt = rows_of(epoch, p), 0
            trouble = (epoch + p) % 4
            if trouble == 1:    # failed mid-write; Spark retries it
                failed = pipe.begin("r1", epoch, p)
                failed.write({"id": 9999})
                failed.close(RuntimeError("injected task failure"))
                attempt = 1
            elif trouble == 2:  # a speculative copy that loses and aborts itself
                speculative = pipe.begin("r1", epoch, p, attempt=1)
                assert pipe.task("r1", epoch, p, ids)
                assert pipe.finish(speculative, ids) is False
                expected += ids
                continue
            elif trouble == 3 and epoch % 3 == 0:  # killed mid-transaction: its transaction stays open
                dead = pipe.begin("r1", epoch, p)
                dead.write({"id": 9998})
                dead._txn.producer.flush()
                dead._txn.producer.close()
                attempt = 1
            assert pipe.task("r1", epoch, p, ids, attempt)
            expected += ids
        pipe.barrier(epoch, "r1")
        assert app.reconcile().ok and pipe.watermark() == epoch
    ids = broker_ids(sink)
    # Per partition at most: the previous epoch's holders (winner and a failed, losing or dead
    # attempt) until the watermark passes them, and this epoch's two.
    assert len(ids) <= partitions * 4, ids
    assert committed_ids(sink) == sorted(expected)                # read_committed: each row once
    assert {9998, 9999} <= set(all_ids(sink))                     # written, never visible


@pytest.mark.parametrize("settled_by", ["cleanup", "lost_intent"])
def test_a_delayed_zombie_is_fenced_and_nothing_it_wrote_becomes_visible(zk, zk_root, sink, settled_by):
    """The zombie's producer is open (InitProducerId done, rows sent) when it pauses. Its epoch is
    settled without it, by the coordinator's abort_unregistered ("cleanup"), or with its intent
    deleted unseen as a GC racing its open would ("lost_intent": then only the next holder's
    InitProducerId aborts what it left and fences it). Its slot goes to an attempt of a later epoch,
    which commits; then the zombie resumes."""
    pipe = Pipeline(zk, zk_root, sink)
    app = pipe.coordinator()
    zombie = pipe.begin("r1", 0, 0)
    assert zombie.ctx.slot == 0
    for i in range(1000, 1005):
        zombie.write({"id": i})
    zombie._txn.producer.flush()
    if settled_by == "lost_intent":
        pipe.registry.drop_intent(zombie.ctx)
    assert pipe.task("r1", 0, 0, rows_of(0, 0), attempt=1)    # Spark's retry wins the partition
    pipe.barrier(0, "r1")
    assert app.reconcile().ok
    run_epoch(pipe, app, 1)                                   # the watermark passes epoch 0: slot 0 is free
    holder = pipe.begin("r1", 2, 0)
    assert holder.ctx.slot == 0
    assert transactional_id(sink.transactional_id_prefix, holder.ctx) == zombie._txn.transactional_id
    assert pipe.finish(holder, rows_of(2, 0))
    pipe.barrier(2, "r1")
    assert app.reconcile().ok
    with pytest.raises((ProducerFenced, IntentGone)):         # fenced sending, or at close: never registered
        resume(pipe, zombie, range(1005, 1010))
    assert committed_ids(sink) == sorted([*rows_of(0, 0), *rows_of(1, 0), *rows_of(2, 0)])  # each once
    assert set(range(1000, 1005)) <= set(all_ids(sink))       # the zombie's rows: written, aborted
    assert broker_ids(sink) == sorted(transactional_id(sink.transactional_id_prefix, replace(holder.ctx, slot=slot))
                                      for slot in (0, 1, 2))     # slot 1: the retry's, slot 2: epoch 1's


def test_the_residual_race_fails_the_next_holders_commit_loudly(zk, zk_root, sink):
    """A zombie paused after claiming its slot and before its InitProducerId (inside open: a sink with a
    slot opens its producer in begin_transaction) across the settling of its epoch and slot_release_lag
    more commits fences the slot's next holder: here the holder had prepared, so its commit fails
    (CommitFailed: the epoch is FAILED), never silently; the zombie itself registers nothing."""
    pipe = Pipeline(zk, zk_root, sink)
    app = pipe.coordinator()
    zombie = TaskAttempt(sink, pipe.registry, TxnContext("app", QUERY, "r1", 0, 0, 0))
    zombie.registry.ensure_run("r1")
    zombie.ctx = pipe.registry.intend(zombie.ctx)             # claimed slot 0; paused before begin_transaction
    assert pipe.task("r1", 0, 0, rows_of(0, 0), attempt=1)
    pipe.barrier(0, "r1")
    assert app.reconcile().ok                                 # its cleanup finds nothing open under slot 0
    run_epoch(pipe, app, 1)
    holder = pipe.begin("r1", 2, 0)
    assert holder.ctx.slot == zombie.ctx.slot == 0 and pipe.finish(holder, rows_of(2, 0))   # prepared, registered
    zombie._txn = sink.begin_transaction(zombie.ctx)          # resumes: its InitProducerId aborts the holder's
    zombie._intent = IntentWatch(pipe.registry, zombie.ctx)   # what open() takes from its admission
    with pytest.raises(IntentGone):
        resume(pipe, zombie, range(1000, 1005))
    pipe.barrier(2, "r1")
    report = app.reconcile()
    assert [(r.epoch, r.operation, r.permanent) for r in report.records if isinstance(r, OperationFailed)] == [
        (2, Operation.COMMIT, True)]
    assert pipe.record(2).state is EpochState.FAILED and pipe.watermark() == 1
    assert committed_ids(sink) == sorted([*rows_of(0, 0), *rows_of(1, 0)])


def test_a_slots_transactional_id_names_app_query_partition_and_slot():
    context = TxnContext("app", "q-1", "r1", 7, 3, 2, slot=1)
    assert transactional_id("twophase", context) == "twophase.app.q-1.3.1"
    assert transactional_id("twophase", replace(context, slot=None)) == "twophase.app.q-1.r1.7.3.2"  # no registry
    long = TxnContext("a" * 128, "q" * 36, "r" * 36, 2**31, 9999, 3, slot=12345)
    tid = transactional_id("twophase", long)
    assert len(tid) <= 249 and tid.endswith(".9999.12345") and "r" * 36 not in tid
