"""`twophase replay`: its refusals, against a real ZooKeeper, and the checkpoint rewind it rests on.

The whole way back (a classic-mode Kafka transaction aborted by the broker's timeout, replayed, and
every row read once) is tests/test_log_sink_classic.py::test_a_failed_epoch_is_replayed_exactly_once.
"""

from __future__ import annotations

import json
import os

import pytest

from coordinator.layout import AppPaths
from coordinator.replay import ReplayRefused, plan_replay
from coordinator.status import read_status
from sinks.files import FileSink
from tests.harness import QUERY, SIGNER, Pipeline
from tests.test_cli import twophase
from twophase.checkpoint import missing_state, rewind
from twophase.sink import AbortFailed


@pytest.fixture
def pipe(zk, zk_root, tmp_path):
    return Pipeline(zk, zk_root, FileSink(str(tmp_path / "out")))


def checkpoint_with(path, batches, state=None):
    for d in ("offsets", "commits"):
        (path / d).mkdir(parents=True)
    (path / "metadata").write_text(json.dumps({"id": QUERY}) + "\n")
    for n in batches:
        for d in ("offsets", "commits"):
            (path / d / str(n)).write_text("v1\n{}\n")
            (path / d / f".{n}.crc").write_text("crc")
    for store, versions in (state or {}).items():
        (path / "state" / store).mkdir(parents=True)
        for v in versions:
            (path / "state" / store / f"{v}.delta").write_text("")
    return str(path)


def fail_epoch_1(pipe, partitions=(0,), lost=(0,)):
    """Epoch 0 committed; epoch 1 pre-committed on ``partitions``, the pending files of ``lost`` deleted,
    then phase two: CommitFailed marks epoch 1 FAILED (partitions before the first lost one commit)."""
    assert pipe.task("r1", 0, 0, range(5))
    pipe.barrier(0, "r1")
    pipe.coordinator().reconcile()
    for p in partitions:
        assert pipe.task("r1", 1, p, range(10 * (p + 1), 10 * (p + 1) + 5))
    for a in pipe.registry.load(1):
        if a.partition in lost:
            os.remove(a.handle.pending)
    pipe.barrier(1, "r1")
    pipe.coordinator(max_commit_threads=1).reconcile()
    assert pipe.record(1).state.value == "failed"


def plan(pipe, checkpoint, epoch=1):
    return plan_replay(read_status(pipe.zk, AppPaths(pipe.paths.root, "app"), SIGNER), QUERY, epoch, checkpoint)


def test_a_failed_epoch_with_its_state_and_offsets_is_planned(pipe, tmp_path):
    fail_epoch_1(pipe)
    checkpoint = checkpoint_with(tmp_path / "ckpt", range(2), state={"0/0": [1, 2], "0/1": [1, 2]})
    assert plan(pipe, checkpoint).epoch == 1


def test_refused_while_a_run_is_alive(pipe, tmp_path):
    fail_epoch_1(pipe)
    pipe.zk.create(f"{pipe.qp.run('r1')}/alive", ephemeral=True)
    with pytest.raises(ReplayRefused, match="r1 of the query is alive"):
        plan(pipe, checkpoint_with(tmp_path / "ckpt", range(2)))


def test_refused_when_part_of_the_epoch_was_committed(pipe, tmp_path):
    fail_epoch_1(pipe, partitions=(0, 1), lost=(1,))
    with pytest.raises(ReplayRefused, match=r"partly committed \(r1.1.0.0\).*twice"):
        plan(pipe, checkpoint_with(tmp_path / "ckpt", range(2)))


def test_refused_when_the_state_it_starts_from_is_gone(pipe, tmp_path):
    fail_epoch_1(pipe)
    checkpoint = checkpoint_with(tmp_path / "ckpt", range(2), state={"0/0": [2, 3], "0/1": [1, 2, 3]})
    with pytest.raises(ReplayRefused, match=r"state version 1 .*\(0/0\)"):
        plan(pipe, checkpoint)


def test_refused_without_the_epochs_offsets_or_for_an_epoch_that_did_not_fail(pipe, tmp_path):
    fail_epoch_1(pipe)
    with pytest.raises(ReplayRefused, match="no offsets/1"):
        plan(pipe, checkpoint_with(tmp_path / "ckpt", [0]))
    with pytest.raises(ReplayRefused, match="epoch 0 is committed: only a FAILED epoch"):
        plan(pipe, checkpoint_with(tmp_path / "ckpt2", range(2)), epoch=0)


def test_rewind_removes_later_commits_and_offsets_with_their_checksums(tmp_path):
    checkpoint = checkpoint_with(tmp_path / "ckpt", range(4))
    assert sorted(rewind(checkpoint, 2)) == ["commits/2", "commits/3", "offsets/3"]
    assert sorted(os.listdir(tmp_path / "ckpt" / "commits")) == [".0.crc", ".1.crc", "0", "1"]
    assert sorted(os.listdir(tmp_path / "ckpt" / "offsets")) == [".0.crc", ".1.crc", ".2.crc", "0", "1", "2"]
    assert rewind(checkpoint, 2) == []


def test_missing_state_names_the_stores_without_the_version(tmp_path):
    checkpoint = checkpoint_with(tmp_path / "ckpt", [], state={"0/0": [4, 5], "0/1": [5], "1/0": [3, 4, 5]})
    assert missing_state(checkpoint, 4) == ["0/1"]
    assert missing_state(checkpoint, 0) == []
    assert missing_state(checkpoint_with(tmp_path / "stateless", []), 7) == []


def test_rewind_removes_state_versions_above_the_batch(tmp_path):
    checkpoint = checkpoint_with(tmp_path / "ckpt", range(4), state={"0/0": [1, 2, 3, 4], "0/1": [2, 3, 4]})
    (tmp_path / "ckpt" / "state" / "0" / "0" / "3.snapshot").write_text("")
    (tmp_path / "ckpt" / "state" / "0" / "0" / ".3.snapshot.crc").write_text("")
    removed = rewind(checkpoint, 2)
    assert {r for r in removed if r.startswith("state")} == {
        "state/0/0/3.delta", "state/0/0/4.delta", "state/0/0/3.snapshot", "state/0/1/3.delta", "state/0/1/4.delta"}
    assert sorted(os.listdir(tmp_path / "ckpt" / "state" / "0" / "0")) == ["1.delta", "2.delta"]


def test_an_interrupted_replay_holds_phase_two_and_resumes(pipe, zk_server, zk_root, tmp_path):
    """The mark stands between the aborts and the rewind: phase two of the query waits, and a second
    `twophase replay` resumes (here the first stopped after marking)."""
    fail_epoch_1(pipe)
    assert pipe.task("r1", 2, 0, range(100, 105))
    checkpoint = checkpoint_with(tmp_path / "ckpt", range(3))
    pipe.zk.create(pipe.qp.replay, json.dumps({"epoch": 1}).encode())     # an earlier run died here
    report = pipe.coordinator().reconcile()
    assert not report.ok and "replay` of epoch 1 is unfinished" in report.records[-1].error
    assert plan(pipe, checkpoint, epoch=1).epoch == 1
    with pytest.raises(ReplayRefused, match="replay of epoch 1 is unfinished"):
        plan_replay(read_status(pipe.zk, AppPaths(pipe.paths.root, "app"), SIGNER), QUERY, 2, checkpoint, 1)
    done = twophase("replay", "--zk", zk_server.hosts, "--root", zk_root, "--app", "app", "--checkpoint",
                    checkpoint, "--epoch", "1")
    assert done.returncode == 0, done.stdout + done.stderr
    assert not pipe.zk.exists(pipe.qp.replay) and not pipe.zk.exists(pipe.qp.epoch(2))
    assert sorted(os.listdir(tmp_path / "ckpt" / "commits")) == [".0.crc", "0"]


class RefusingFileSink(FileSink):
    """A file sink whose abort refuses a committed handle, as the contract asks (FileSink's does not)."""

    def abort(self, handle):
        if os.path.exists(handle.final):
            raise AbortFailed(f"{handle.final} is committed")
        super().abort(handle)


def test_an_abort_finding_the_epoch_committed_ends_the_replay_with_nothing_rewound(zk, zk_server, zk_root,
                                                                                  tmp_path):
    """A winner committed whose record survived (the coordinator died before deleting it) looks
    pending to the plan; its abort finds it committed (AbortFailed): the replay stops, unmarked,
    with the checkpoint and the later epochs untouched."""
    pipe = Pipeline(zk, zk_root, RefusingFileSink(str(tmp_path / "out")))
    fail_epoch_1(pipe)
    [attempt] = pipe.registry.load(1)
    os.makedirs(os.path.dirname(attempt.handle.final), exist_ok=True)
    with open(attempt.handle.final, "w") as f:   # as if committed: FileSink's abort then raises AbortFailed
        f.write("{}\n")
    assert pipe.task("r1", 2, 0, range(100, 105))
    checkpoint = checkpoint_with(tmp_path / "ckpt", range(3))
    done = twophase("replay", "--zk", zk_server.hosts, "--root", zk_root, "--app", "app", "--checkpoint",
                    checkpoint, "--epoch", "1")
    assert done.returncode == 1 and "partly committed" in done.stderr, done.stdout + done.stderr
    assert not pipe.zk.exists(pipe.qp.replay) and pipe.zk.exists(pipe.qp.epoch(2))
    assert sorted(os.listdir(tmp_path / "ckpt" / "commits")) == [".0.crc", ".1.crc", ".2.crc", "0", "1", "2"]
