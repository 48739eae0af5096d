"""One task attempt's ZooKeeper work (twophase/task.py over coordinator/precommits.py) against a real
ZooKeeper, with the real FileSink, without Spark: what open() and close() ask of ZooKeeper, and that
the cheaper path keeps every rule (halt first, winner skips, the epoch's nodes made once)."""

from __future__ import annotations

import os
import threading
from collections import Counter

import pytest

from coordinator import precommits
from coordinator.precommits import IntentGone, PrecommitRegistry
from coordinator.zk import connect
from sinks.files import FileSink
from tests.harness import QUERY, SIGNER, Pipeline, SlotFileSink, ids_out
from tests.waiting import wait_until
from twophase.sink import TxnContext
from twophase.task import PhaseTwoHalted, TaskAttempt
from twophase.verify import count_rows


@pytest.fixture
def pipe(zk, zk_root, tmp_path):
    return Pipeline(zk, zk_root, FileSink(str(tmp_path / "out")))


@pytest.fixture
def counted(zk_server):
    """A client of its own (an executor's) that counts the requests it sends, by type."""
    client = connect(zk_server.hosts)
    sent: Counter[str] = Counter()
    send = client._call

    def counting(request, async_object):
        sent[type(request).__name__] += 1
        return send(request, async_object)

    client._call = counting
    yield client, sent
    client.stop()
    client.close()


def ctx(epoch=0, partition=0, attempt=0, run="r1") -> TxnContext:
    return TxnContext("app", QUERY, run, epoch, partition, attempt)


@pytest.mark.parametrize("slots", [True, False], ids=["slots", "no-slots"])
def test_open_is_one_multi_op_and_close_one_multi_op(zk, zk_root, tmp_path, counted, monkeypatch, slots):
    monkeypatch.setattr(precommits, "TRUSTED_FOR", 600.0)  # however loaded the host, the attempt is young
    pipe = Pipeline(zk, zk_root, (SlotFileSink if slots else FileSink)(str(tmp_path / "out")))
    client, sent = counted
    assert pipe.task("r1", 0, 0, [0]) is True  # the query's first: makes epochs/ and slots/ the slow way
    registry = PrecommitRegistry(client, pipe.qp, SIGNER)
    registry.ensure_run("r1")
    # (epoch, partition, multi-ops for a sink without slots): the first attempt of an epoch makes it in its
    # multi-op; without slots nothing is read first, and partition 0 guesses it is first, the others not.
    for epoch, partition, tries in ((0, 1, 1), (1, 0, 1), (1, 1, 1), (2, 1, 2), (2, 0, 2)):
        attempt = TaskAttempt(pipe.sink, registry, ctx(epoch, partition))
        sent.clear()
        assert attempt.open()
        # One multi-op checks the halt and the winner and records the intent; then, not waited for, the watch
        # on the intent (IntentWatch). A sink that uses slots first reads the held ones and the epoch's node,
        # in one round trip.
        assert sent == (Counter(GetChildren=1, Exists=2, Transaction=1) if slots
                        else Counter(Exists=1, Transaction=tries))
        assert (attempt.ctx.slot is not None) is slots
        attempt.write({"id": epoch * 10 + partition})
        sent.clear()
        attempt.close(None)
        assert attempt.won
        assert sent == Counter(Transaction=1)  # the registration multi-op: the watch says the intent is held
    assert sorted(pipe.zk.get_children(pipe.qp.epoch(2))) == ["attempts", "intents", "winners"]
    pipe.barrier(2, "r1")
    pipe.coordinator().reconcile()
    assert count_rows([0, 1, 10, 11, 20, 21], ids_out(pipe)).exact


def test_a_halt_is_reported_before_a_winner_and_records_no_intent(pipe):
    assert pipe.task("r1", 0, 0, range(10)) is True
    pipe.zk.create(pipe.qp.halted("r1"), b"the coordinator failed for good")
    with pytest.raises(PhaseTwoHalted, match="the coordinator failed for good"):
        TaskAttempt(pipe.sink, pipe.registry, ctx(attempt=1)).open()
    pipe.zk.delete(pipe.qp.halted("r1"))
    admission = pipe.registry.admit(ctx(attempt=1), slot=pipe.sink.uses_slots)
    assert (admission.halted, admission.winner, admission.ctx) == (None, "r1.0.0.0", None)
    assert pipe.zk.get_children(pipe.qp.intents(0)) == ["r1.0.0.0"]  # the winner's, none for the skipper


@pytest.mark.parametrize("slots", [True, False], ids=["slots", "no-slots"])
def test_an_open_repeated_after_its_multi_op_went_through_finds_its_own_intent(zk, zk_root, tmp_path, slots):
    """client.retry repeats the admission when a connection loss hid whether its multi-op went through."""
    pipe = Pipeline(zk, zk_root, (SlotFileSink if slots else FileSink)(str(tmp_path / "out")))
    first = pipe.registry.admit(ctx(), slot=pipe.sink.uses_slots)
    again = pipe.registry.admit(ctx(), slot=pipe.sink.uses_slots)
    assert again.ctx == first.ctx and (first.ctx.slot == 0) is slots
    assert pipe.zk.get_children(pipe.qp.intents(0)) == ["r1.0.0.0"]
    if slots:
        assert pipe.zk.get_children(pipe.qp.partition_slots(0)) == ["0"]


def test_an_open_after_its_runs_node_was_deleted_makes_it_again(pipe):
    """A process records each run once (Spark reuses Python workers); the multi-op's halt check needs the
    run's node, so one deleted since is made again, as a fresh process would make it."""
    pipe.registry.ensure_run("r1")
    pipe.zk.delete(pipe.qp.run("r1"), recursive=True)
    attempt = TaskAttempt(pipe.sink, pipe.registry, ctx())
    assert attempt.open()
    assert pipe.zk.exists(pipe.qp.run("r1")) and pipe.zk.get_children(pipe.qp.intents(0)) == ["r1.0.0.0"]
    attempt.write({"id": 1})
    attempt.close(None)
    assert attempt.won


def test_the_first_attempts_of_an_epoch_racing_to_make_it_all_record_their_intents(zk_server, pipe):
    """Each thread has a ZooKeeper client of its own, as tasks on different executors do; all of them
    find the epoch missing, one multi-op makes it, the others find it made and record their intents
    (FileSink claims no slots)."""
    start, results, clients = threading.Barrier(8), {}, []

    def task(partition):
        client = connect(zk_server.hosts)
        clients.append(client)
        attempt = TaskAttempt(pipe.sink, PrecommitRegistry(client, pipe.qp, SIGNER), ctx(partition=partition))
        start.wait()
        assert attempt.open()
        attempt.write({"id": partition})
        attempt.close(None)
        results[partition] = (attempt.won, attempt.ctx.slot)

    threads = [threading.Thread(target=task, args=(p,)) for p in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for client in clients:
        client.stop()
        client.close()
    assert results == {p: (True, None) for p in range(8)}
    pipe.barrier(0, "r1")
    pipe.coordinator().reconcile()
    assert count_rows(range(8), ids_out(pipe)).exact


def test_the_row_writer_writes_into_the_attempts_transaction(pipe):
    attempt = TaskAttempt(pipe.sink, pipe.registry, ctx())
    assert attempt.open()
    write = attempt.row_writer()
    for i in range(5):
        write({"id": i})
    attempt.close(None)
    pipe.barrier(0, "r1")
    pipe.coordinator().reconcile()
    assert count_rows(range(5), ids_out(pipe)).exact


def test_an_intent_the_coordinator_deletes_while_the_attempt_writes_is_seen_through_its_watch(pipe, counted,
                                                                                            monkeypatch):
    monkeypatch.setattr(precommits, "TRUSTED_FOR", 600.0)  # however loaded the host, the attempt is young
    client, sent = counted
    registry = PrecommitRegistry(client, pipe.qp, SIGNER)
    registry.ensure_run("r1")
    admission = registry.admit(ctx())
    sent.clear()
    assert admission.intent.held() and not sent  # the watch has not fired: no round trip
    pipe.zk.delete(registry.intent_path(admission.ctx))  # cleaned up: its epoch was settled without it
    wait_until(lambda: not admission.intent.held(), what="the intent's watch to fire")
    assert set(sent) == {"Exists"}  # once fired, held() asks ZooKeeper


def test_an_attempt_older_than_the_watch_is_trusted_for_asks_zookeeper(pipe, counted, monkeypatch):
    """A connection that died silently fires no watch until kazoo notices: past TRUSTED_FOR, when a zombie
    could be what asks, the attempt reads the intent instead."""
    monkeypatch.setattr(precommits, "TRUSTED_FOR", 0.0)
    client, sent = counted
    registry = PrecommitRegistry(client, pipe.qp, SIGNER)
    registry.ensure_run("r1")
    admission = registry.admit(ctx())
    sent.clear()
    assert admission.intent.held() and sent == Counter(Exists=1)


def test_an_attempt_without_slots_cleaned_up_before_it_registers_discards_its_own_pre_commit(pipe, tmp_path):
    """Its epoch was settled between its pre-commit and its registration. A sink without slots names the
    pre-commit by attempt (FileSink's pending file), so the attempt discards it: nothing else ever would."""
    registry = PrecommitRegistry(pipe.zk, pipe.qp, SIGNER)
    registry.ensure_run("r1")
    sink = FileSink(str(tmp_path / "late"))
    attempt = TaskAttempt(sink, registry, ctx())
    assert attempt.open()
    attempt.write({"id": 1})
    pre_commit = sink.pre_commit

    def settled_meanwhile(txn):
        handle = pre_commit(txn)
        pipe.zk.delete(registry.intent_path(attempt.ctx))  # the coordinator cleaned the attempt up
        return handle

    sink.pre_commit = settled_meanwhile
    with pytest.raises(IntentGone):
        attempt.close(None)
    assert os.listdir(tmp_path / "late" / "_pending") == []


class _FailingAbortAndClose(FileSink):
    def abort(self, handle):
        raise RuntimeError("the abort's own failure")

    def close(self):
        raise OSError("closing failed too")


def test_a_losers_abort_failure_is_not_hidden_by_a_failing_close(zk, zk_root, tmp_path, caplog):
    """A task releases its copy of the sink after aborting its own pre-commit: a release that fails is
    logged, and the abort's failure, the one that matters, is what the task raises."""
    pipe = Pipeline(zk, zk_root, _FailingAbortAndClose(str(tmp_path / "out")))
    first, second = pipe.begin("r1", 0, 0, attempt=0), pipe.begin("r1", 0, 0, attempt=1)
    assert pipe.finish(first, [1])
    with pytest.raises(RuntimeError, match="the abort's own failure"):
        pipe.finish(second, [1])
    assert "closing the _FailingAbortAndClose failed" in caplog.text
