"""The contract's optional hooks, driven by the real coordinator and CLI on a real ZooKeeper:
``retire_epoch`` when an epoch's record is dropped, ``prepared_transactions`` in ``twophase status``."""

from __future__ import annotations

import json
import os

from coordinator.report import EpochCommitted, Operation, OperationFailed
from coordinator.status import read_status
from sinks.files import FileSink
from tests.harness import SIGNER, Pipeline, ids_out
from tests.test_cli import twophase
from twophase.sink import PreparedTransaction
from twophase.verify import count_rows


class RetireRecordingSink(FileSink):
    """Appends each retired epoch to a file beside its output (the coordinator holds its own copy)."""

    retire_works = True

    def retire_epoch(self, app, query_id, epoch):
        if not self.retire_works:
            raise ConnectionError("injected retire failure")
        with open(os.path.join(self.path, "retired"), "a") as f:
            f.write(f"{app} {query_id} {epoch}\n")


def retired(pipe):
    try:
        with open(os.path.join(pipe.sink.path, "retired")) as f:
            return [line.split() for line in f]
    except FileNotFoundError:
        return []


def six_committed_epochs(pipe):
    for epoch in range(6):
        pipe.task("r1", epoch, 0, range(epoch * 10, epoch * 10 + 10))
    pipe.barrier(5, "r1")


def test_the_sink_retires_each_epoch_whose_record_is_dropped(zk, zk_root, tmp_path):
    pipe = Pipeline(zk, zk_root, RetireRecordingSink(str(tmp_path / "out")))
    six_committed_epochs(pipe)
    app = pipe.coordinator(retain_epochs=2)
    app.reconcile()
    app.reconcile()
    assert [int(n) for n in sorted(zk.get_children(pipe.qp.epochs))] == [4, 5]
    assert retired(pipe) == [["app", pipe.qp.query_id, str(n)] for n in range(4)]
    assert count_rows(range(60), ids_out(pipe)).exact


def test_a_failing_retire_keeps_the_record_and_is_retried(zk, zk_root, tmp_path):
    pipe = Pipeline(zk, zk_root, RetireRecordingSink(str(tmp_path / "out")))
    six_committed_epochs(pipe)
    app = pipe.coordinator(retain_epochs=2, attempts=1)
    app.sink().retire_works = False
    committed = app.reconcile()
    assert [r.epoch for r in committed.records if isinstance(r, EpochCommitted)] == list(range(6))
    report = app.reconcile()  # the pass after the commits collects
    failed = [r for r in report.records if isinstance(r, OperationFailed)]
    assert [(r.epoch, r.operation) for r in failed] == [(0, Operation.RETIRE)] and not report.ok
    assert len(zk.get_children(pipe.qp.epochs)) == 6 and retired(pipe) == []
    for _ in range(4):  # every full pass tries again: a failed cleanup is not a settled query to back off from
        report = app.reconcile()
        assert [r.epoch for r in report.records if isinstance(r, OperationFailed)] == [0]
    app.sink().retire_works = True
    app.reconcile()
    assert [int(n) for n in sorted(zk.get_children(pipe.qp.epochs))] == [4, 5]
    assert [int(r[2]) for r in retired(pipe)] == [0, 1, 2, 3]


class PreparedListingSink(FileSink):
    """Reports prepared transactions as a database would; ``down`` makes the target unreachable."""

    down = False

    def prepared_transactions(self, older_than):
        if self.down:
            raise ConnectionError("injected: target down")
        held = [PreparedTransaction("tp1:app:r1.0.0.0", 900.0, "r1.0.0.0", "db orders"),
                PreparedTransaction("someone-else", 4000.0, None, "db orders"),
                PreparedTransaction("tp1:app:r1.1.0.0", 5.0, "r1.1.0.0", "db orders")]
        return [t for t in held if t.age > older_than]


def test_status_lists_the_targets_old_prepared_transactions_oldest_first(zk, zk_root, zk_server, tmp_path):
    Pipeline(zk, zk_root, PreparedListingSink(str(tmp_path / "out")))
    result = twophase("status", "--zk", zk_server.hosts, "--root", zk_root, "--app", "app",
                      "--prepared-older-than", "60")
    assert result.returncode == 0, result.stderr
    lines = [line.split() for line in result.stdout.splitlines() if "tp1:" in line or "someone-else" in line]
    assert [line[0] for line in lines] == ["someone-else", "tp1:app:r1.0.0.0"]
    assert "attempt r1.0.0.0" in result.stdout and "not this app's" in result.stdout
    result = twophase("status", "--zk", zk_server.hosts, "--root", zk_root, "--app", "app", "--json")
    prepared = json.loads(result.stdout)["prepared"]
    assert [t["id"] for t in prepared] == ["someone-else", "tp1:app:r1.0.0.0"]  # default threshold 300 s


def test_status_says_when_the_target_cannot_be_asked(zk, zk_root, tmp_path):
    sink = PreparedListingSink(str(tmp_path / "out"))
    sink.down = True
    pipe = Pipeline(zk, zk_root, sink)
    status = read_status(zk, pipe.paths, SIGNER, prepared_older_than=60)
    assert status.prepared == () and "target down" in status.prepared_error
    assert read_status(zk, pipe.paths, SIGNER).prepared_error is None  # not asked: not loaded


def test_status_can_be_told_not_to_ask_the_target(zk, zk_root, zk_server, tmp_path):
    sink = PreparedListingSink(str(tmp_path / "out"))
    sink.down = True
    Pipeline(zk, zk_root, sink)
    asked = twophase("status", "--zk", zk_server.hosts, "--root", zk_root, "--app", "app")
    assert asked.returncode == 0 and "PREPARED TRANSACTIONS UNKNOWN" in asked.stdout and "target down" in asked.stdout
    result = twophase("status", "--zk", zk_server.hosts, "--root", zk_root, "--app", "app", "--no-prepared")
    assert result.returncode == 0 and "PREPARED" not in result.stdout
