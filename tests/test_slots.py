"""Slots (coordinator/slots.py) against a real ZooKeeper, with the real FileSink, without Spark:
claimed with the intent, unique among unsettled attempts, released by the coordinator once the
holder is finished and slot_release_lag epochs below the watermark. FileSink names its files by
attempt (``uses_slots`` False), so these tests give it slots, as a sink naming resources by slot has."""

from __future__ import annotations

import threading

import pytest

from coordinator.app import CommitPolicy
from coordinator.slots import read_slots
from coordinator.status import read_status
from coordinator.zk import RecordError
from sinks.files import FileSink
from tests.harness import QUERY, SIGNER, Pipeline, SlotFileSink, ids_out, stage
from twophase.cli import print_status
from twophase.sink import TxnContext
from twophase.verify import count_rows


@pytest.fixture
def pipe(zk, zk_root, tmp_path):
    return Pipeline(zk, zk_root, SlotFileSink(str(tmp_path / "out")))


def ctx(epoch=0, partition=0, attempt=0, run="r1") -> TxnContext:
    return TxnContext("app", QUERY, run, epoch, partition, attempt)


def held(pipe, partition=0) -> dict[int, str]:
    """Slot number -> holder attempt name, for one partition."""
    return {s.number: s.attempt for s in read_slots(pipe.zk, pipe.qp) if s.partition == partition}


def commit_epoch(pipe, app, epoch, partitions=1, run="r1", attempt=0):
    for p in range(partitions):
        pipe.task(run, epoch, p, range(epoch * 100 + p * 10, epoch * 100 + p * 10 + 10), attempt)
    pipe.barrier(epoch, run)
    assert app.reconcile().ok
    assert pipe.watermark() == epoch


def test_an_attempt_claims_the_lowest_free_slot_of_its_partition(pipe):
    assert [pipe.registry.intend(ctx(attempt=a)).slot for a in range(3)] == [0, 1, 2]
    assert pipe.registry.intend(ctx(partition=1)).slot == 0  # each partition has a pool of its own
    assert pipe.registry.intend(ctx(epoch=1)).slot == 3      # every slot of the epoch before is still held
    assert held(pipe) == {0: "r1.0.0.0", 1: "r1.0.0.1", 2: "r1.0.0.2", 3: "r1.1.0.0"}


def test_concurrent_claims_get_distinct_slots(zk_server, pipe):
    """Each thread has a ZooKeeper client of its own, as tasks on different executors do."""
    from coordinator.precommits import PrecommitRegistry
    from coordinator.zk import connect

    start, slots, clients = threading.Barrier(8), [], []

    def claim(attempt):
        client = connect(zk_server.hosts)
        clients.append(client)
        start.wait()
        slots.append(PrecommitRegistry(client, pipe.qp, SIGNER).intend(ctx(attempt=attempt)).slot)

    threads = [threading.Thread(target=claim, args=(a,)) for a in range(8)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        for client in clients:
            client.stop()
            client.close()
    assert sorted(slots) == list(range(8))
    assert sorted(held(pipe).values()) == [f"r1.0.0.{a}" for a in range(8)]


def test_a_retried_intend_finds_its_own_intent_and_slot(pipe):
    first = pipe.registry.intend(ctx(attempt=0))
    pipe.registry.intend(ctx(attempt=1))
    again = pipe.registry.intend(ctx(attempt=0))  # as client.retry repeats it after a connection loss
    assert first.slot == again.slot == 0 and again == first
    assert held(pipe) == {0: "r1.0.0.0", 1: "r1.0.0.1"}


def test_the_task_begins_its_transaction_with_the_slot(pipe):
    task = pipe.begin("r1", 0, 0)
    assert task.ctx.slot == 0 and task._txn.ctx.slot == 0
    pipe.finish(task, range(3))


def test_a_slot_is_released_once_its_holder_is_finished_and_the_lag_passed(pipe):
    app = pipe.coordinator()  # slot_release_lag=1
    commit_epoch(pipe, app, 0)
    assert held(pipe) == {0: "r1.0.0.0"}   # finished, but its epoch is not 1 below the watermark yet
    commit_epoch(pipe, app, 1)             # takes slot 1
    assert held(pipe) == {1: "r1.1.0.0"}   # slot 0 released
    commit_epoch(pipe, app, 2)             # takes slot 0 again
    assert held(pipe) == {0: "r1.2.0.0"}
    assert count_rows([i for e in range(3) for i in range(e * 100, e * 100 + 10)], ids_out(pipe)).exact


def test_no_lag_releases_a_slot_as_soon_as_its_epoch_commits(pipe):
    app = pipe.coordinator(slot_release_lag=0)
    for epoch in range(3):
        commit_epoch(pipe, app, epoch, partitions=2)
        assert read_slots(pipe.zk, pipe.qp) == []
    assert pipe.registry.intend(ctx(epoch=3)).slot == 0


def test_a_larger_lag_keeps_that_many_epochs_of_slots(pipe):
    app = pipe.coordinator(slot_release_lag=3)
    for epoch in range(8):
        commit_epoch(pipe, app, epoch)
    assert sorted(int(a.split(".")[1]) for a in held(pipe).values()) == [5, 6, 7]


class CleanupFailsSink(SlotFileSink):
    cleanup_works = False

    def __init__(self, path):
        super().__init__(path)
        self.cleaned = []  # the contexts abort_unregistered was called with

    def abort_unregistered(self, ctx):
        if not self.cleanup_works:
            raise ConnectionError("injected cleanup failure")
        self.cleaned.append(ctx)
        super().abort_unregistered(ctx)


def test_a_dead_attempts_slot_is_held_until_its_cleanup_drops_the_intent(zk, zk_root, tmp_path):
    pipe = Pipeline(zk, zk_root, CleanupFailsSink(str(tmp_path / "out")))
    dead = pipe.registry.intend(ctx(attempt=0))           # killed after pre_commit: no registration
    pipe.sink.pre_commit(stage(pipe.sink, dead, [{"id": 999}]))
    app = pipe.coordinator(attempts=1)
    pipe.task("r1", 0, 0, range(10), attempt=1)
    pipe.barrier(0, "r1")
    app.reconcile()
    for epoch in (1, 2, 3):
        pipe.task("r1", epoch, 0, range(epoch * 10, epoch * 10 + 10))
        pipe.barrier(epoch, "r1")
        app.reconcile()
    assert pipe.watermark() == 3 and held(pipe)[0] == "r1.0.0.0"  # its intent lives: the slot is still its
    app.sink().cleanup_works = True
    assert app.reconcile().ok
    assert [c.slot for c in app.sink().cleaned] == [0]    # the context rebuilt from the intent carries its slot
    assert 0 not in held(pipe)                             # dropped intent: released in the same pass
    assert count_rows(range(40), ids_out(pipe)).exact


def test_gc_releases_the_slot_of_an_intent_it_deletes(pipe):
    app = pipe.coordinator(retain_epochs=1)
    commit_epoch(pipe, app, 0)
    zombie = pipe.registry.intend(ctx(run="r0"))         # a zombie of a dead run, after the commit
    pipe.sink.pre_commit(stage(pipe.sink, zombie, [{"id": 999}]))
    commit_epoch(pipe, app, 1)
    assert "r0.0.0.0" in held(pipe).values()             # slot 1: its intent lives (the epoch is retained)
    commit_epoch(pipe, app, 2)                           # GC of epoch 0 cleans it up and deletes its intent
    assert not pipe.zk.exists(pipe.qp.epoch(0))
    assert "r0.0.0.0" not in held(pipe).values()
    assert count_rows([i for e in range(3) for i in range(e * 100, e * 100 + 10)], ids_out(pipe)).exact


def test_a_new_coordinator_releases_on_its_first_pass_and_carries_on(pipe):
    first = pipe.coordinator("first", slot_release_lag=5)
    for epoch in range(3):
        commit_epoch(pipe, first, epoch)
    assert len(held(pipe)) == 3
    second = pipe.coordinator("second")                  # lag 1; the watermark has not moved since
    assert second.reconcile().records == ()
    assert held(pipe) == {2: "r1.2.0.0"}
    commit_epoch(pipe, second, 3)
    assert held(pipe) == {0: "r1.3.0.0"}


def test_a_deposed_coordinator_releases_nothing(pipe):
    from coordinator.fence import Fenced

    old = pipe.coordinator("old")
    commit_epoch(pipe, old, 0)
    pipe.task("r1", 1, 0, range(100, 110))
    pipe.barrier(1, "r1")
    pipe.coordinator("new", slot_release_lag=100)
    with pytest.raises(Fenced):
        old.reconcile()
    assert len(held(pipe)) == 2


def test_a_sink_that_uses_no_slots_claims_none_and_commits(zk, zk_root, tmp_path):
    """FileSink names nothing by slot: its attempts get none, their intents are empty, no slot znode is
    made, and a dead attempt's cleanup gets its context without one."""
    sink = CleanupFailsSink(str(tmp_path / "out"))
    sink.uses_slots, sink.cleanup_works = False, True
    pipe = Pipeline(zk, zk_root, sink)
    app = pipe.coordinator()
    task = pipe.begin("r1", 0, 0)
    assert task.ctx.slot is None and task._txn.ctx.slot is None
    assert pipe.zk.get(pipe.registry.intent_path(task.ctx))[0] == b""
    pipe.finish(task, range(10))
    dead = pipe.begin("r1", 1, 0, attempt=0)                  # killed after pre_commit: never registered
    pipe.sink.pre_commit(dead._txn)
    pipe.task("r1", 1, 0, range(10, 20), attempt=1)
    for epoch in (0, 1):
        pipe.barrier(epoch, "r1")
        assert app.reconcile().ok
    assert pipe.watermark() == 1
    assert [(c.name, c.slot) for c in app.sink().cleaned] == [("r1.1.0.0", None)]
    assert read_slots(pipe.zk, pipe.qp) == [] and not pipe.zk.exists(pipe.qp.slots)
    assert count_rows(range(20), ids_out(pipe)).exact


def test_an_intent_of_an_older_version_has_no_slot(pipe):
    """Intents written before slots existed are empty: their context has no slot (a sink falls back to
    per-attempt names), and nothing is released for them."""
    pipe.zk.create(f"{pipe.qp.intents(0)}/r1.0.0.0", makepath=True)
    [legacy] = pipe.registry.unregistered(0, [])
    assert legacy == ctx() and legacy.slot is None


def test_a_malformed_slot_is_named(pipe):
    pipe.zk.create(f"{pipe.qp.partition_slots(0)}/0", b"[1]", makepath=True)
    with pytest.raises(RecordError, match="slots/0/0"):
        read_slots(pipe.zk, pipe.qp)


def test_status_shows_the_slots_held_per_partition(pipe, capsys):
    for partition, attempts in ((0, 2), (3, 1)):
        for a in range(attempts):
            pipe.registry.intend(ctx(partition=partition, attempt=a))
    status = read_status(pipe.zk, pipe.paths, SIGNER)
    assert status.queries[0].slots == ((0, 2), (3, 1))
    print_status(status)
    assert "slots held: partition 0: 2, partition 3: 1" in capsys.readouterr().out


@pytest.mark.parametrize("lag", [-1, 1.5, True])
def test_a_bad_release_lag_is_refused_naming_the_setting(lag):
    with pytest.raises(ValueError, match="slot_release_lag"):
        CommitPolicy(slot_release_lag=lag)


def test_the_coordinator_drops_an_intent_only_while_its_attempt_has_not_registered(pipe):
    """Cleanup lists unregistered intents, cleans up, then drops them: an attempt registering in between
    (its registration checks its intent) keeps its intent, so its slot, until its handle is finished."""
    late = pipe.registry.intend(TxnContext("app", QUERY, "r1", 0, 0, 0))
    gone = pipe.registry.intend(TxnContext("app", QUERY, "r1", 0, 1, 0))
    assert pipe.registry.drop_unregistered_intent(gone)            # no attempt registered in the epoch yet
    pipe.registry.register(late, {"handle": 1})
    assert not pipe.registry.drop_unregistered_intent(late)
    assert pipe.zk.get_children(pipe.qp.intents(0)) == [late.name]


def test_the_owner_reads_each_slot_once(pipe):
    """A held slot's znode never changes, so the slots passed as known are not read again."""
    first = pipe.registry.intend(ctx(attempt=0))
    known = {s.path(pipe.qp): s for s in read_slots(pipe.zk, pipe.qp)}
    pipe.zk.set(f"{pipe.qp.partition_slots(0)}/0", b"not read again")  # would be a RecordError if read
    pipe.registry.intend(ctx(attempt=1))
    assert [(s.number, s.attempt) for s in read_slots(pipe.zk, pipe.qp, known)] == [(0, first.name), (1, "r1.0.0.1")]
