"""The `twophase` CLI as a user runs it: a real process against a real ZooKeeper."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from sinks.files import FileSink
from coordinator.precommits import PrecommitRegistry
from tests.harness import QUERY, SIGNER, Pipeline, ids_out
from twophase import cli
from twophase.sink import TxnContext
from twophase.task import PhaseTwoHalted, TaskAttempt
from twophase.verify import count_rows

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def twophase(*args):
    return subprocess.run([sys.executable, "-m", "twophase.cli", *args], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=REPO), timeout=60)


@pytest.fixture
def pipe(zk, zk_root, tmp_path):
    return Pipeline(zk, zk_root, FileSink(str(tmp_path / "out")))


def fake_checkpoint(path, completed):
    """The two things recovery reads of a Spark checkpoint: the query id and commits/N."""
    os.makedirs(path / "commits")
    (path / "metadata").write_text(json.dumps({"id": QUERY}) + "\n")
    for n in completed:
        (path / "commits" / str(n)).write_text('v1\n{"nextBatchWatermarkMs":0}\n')
    return str(path)


@pytest.mark.parametrize("command", ["status", "recover", "coordinator"])
def test_help(command):
    result = twophase(command, "--help")
    assert result.returncode == 0 and "--zk" in result.stdout


def test_unknown_app_is_an_error(zk_server, zk_root):
    result = twophase("status", "--zk", zk_server.hosts, "--root", zk_root, "--app", "nope")
    assert result.returncode == 2 and "no app 'nope'" in result.stderr


def test_status_shows_pending_transactions_and_the_watermark(pipe, zk_server, zk_root):
    pipe.task("r1", 0, 0, range(10))
    result = twophase("status", "--zk", zk_server.hosts, "--root", zk_root, "--app", "app")
    assert result.returncode == 0, result.stderr
    assert "committed watermark: -1" in result.stdout and "r1.0.0.0" in result.stdout


def test_status_json_describes_queries_runs_epochs_and_attempts(pipe, zk_server, zk_root, zk):
    pipe.registry.ensure_run("r1")
    zk.create(f"{pipe.qp.run('r1')}/alive", ephemeral=True)
    pipe.task("r1", 0, 0, range(10))
    result = twophase("status", "--zk", zk_server.hosts, "--root", zk_root, "--app", "app", "--json")
    assert result.returncode == 0, result.stderr
    status = json.loads(result.stdout)
    assert (status["app"], status["coordinator"]) == ("app", "embedded")
    [query] = status["queries"]
    assert (query["query_id"], query["watermark"], query["barrier"]) == (QUERY, -1, -1)
    assert [(r["run_id"], r["alive"]) for r in query["runs"]] == [("r1", True)]
    [epoch] = query["epochs"]
    assert (epoch["epoch"], epoch["state"], epoch["committed"], epoch["failures"]) == (0, "open", False, [])
    [attempt] = epoch["attempts"]
    assert {k: attempt[k] for k in ("name", "run_id", "partition", "attempt", "won", "in_doubt")} == {
        "name": "r1.0.0.0", "run_id": "r1", "partition": 0, "attempt": 0, "won": True, "in_doubt": False}


def test_status_shows_a_halted_run_and_tasks_of_it_refuse_to_write(pipe, zk_server, zk_root, zk):
    pipe.task("r1", 0, 0, range(10))
    zk.create(pipe.qp.halted("r1"), b"the progress publisher failed for good: RuntimeError('boom')")
    with pytest.raises(PhaseTwoHalted, match="boom"):
        pipe.task("r1", 1, 0, range(10, 20))
    result = twophase("status", "--zk", zk_server.hosts, "--root", zk_root, "--app", "app")
    assert "HALTED: the progress publisher failed for good" in result.stdout, result.stderr
    result = twophase("status", "--zk", zk_server.hosts, "--root", zk_root, "--app", "app", "--json")
    [run] = json.loads(result.stdout)["queries"][0]["runs"]
    assert "boom" in run["halted"]


def test_recover_commits_completed_epochs_and_aborts_the_rest(pipe, zk_server, zk_root, tmp_path):
    for p in range(2):
        pipe.task("r1", 0, p, range(p * 10, p * 10 + 10))
    pipe.task("r1", 1, 0, range(20, 30))  # Spark never completed epoch 1: it will re-run it
    checkpoint = fake_checkpoint(tmp_path / "ck", completed=[0])
    args = ("recover", "--zk", zk_server.hosts, "--root", zk_root, "--app", "app", "--checkpoint", checkpoint)

    def records(dry_run):
        return [
            {"kind": "epoch_committed", "query_id": QUERY, "epoch": 0, "run": "r1",
             "attempts": ["r1.0.0.0", "r1.0.1.0"], "dry_run": dry_run},
            {"kind": "attempt_aborted", "query_id": QUERY, "epoch": 1, "attempt": "r1.1.0.0",
             "reason": "incomplete", "dry_run": dry_run},
            {"kind": "epoch_skipped", "query_id": QUERY, "epoch": 1, "reason": "incomplete"},
        ]

    dry = twophase(*args, "--dry-run", "--json")
    assert dry.returncode == 0, dry.stderr
    assert json.loads(dry.stdout) == {"app": "app", "dry_run": True, "ok": True, "records": records(True)}
    assert ids_out(pipe) == []

    done = twophase(*args, "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["records"] == records(False)
    assert count_rows(range(20), ids_out(pipe)).exact
    assert pipe.watermark() == 0 and pipe.registry.load(1) == []

    again = twophase(*args, "--json")  # only the epoch Spark will re-run is left, with nothing in it
    assert again.returncode == 0 and json.loads(again.stdout)["records"] == records(False)[2:]


def test_recover_exits_1_while_an_epoch_is_failed(pipe, zk_server, zk_root, tmp_path):
    pipe.task("r1", 0, 0, range(10))
    pipe.task("r1", 1, 0, range(10, 20))
    [attempt] = pipe.registry.load(0)
    os.remove(attempt.handle.pending)  # the pre-committed file is lost: its commit can never succeed
    args = ("--zk", zk_server.hosts, "--root", zk_root, "--app", "app")

    failed = twophase("recover", *args, "--json")
    assert failed.returncode == 1, failed.stderr
    [record] = json.loads(failed.stdout)["records"]
    assert {k: record[k] for k in ("kind", "epoch", "attempt", "operation", "tries", "permanent")} == {
        "kind": "operation_failed", "epoch": 0, "attempt": "r1.0.0.0", "operation": "commit", "tries": 1,
        "permanent": True}

    blocked = twophase("recover", *args, "--json")
    assert blocked.returncode == 1, blocked.stderr
    assert [(r["kind"], r["epoch"]) for r in json.loads(blocked.stdout)["records"]] == [("epoch_blocked", 0)]
    assert twophase("recover", *args).returncode == 1

    status = twophase("status", *args, "--json")
    assert status.returncode == 1, status.stderr
    [epoch0, epoch1] = json.loads(status.stdout)["queries"][0]["epochs"]
    assert epoch0["state"] == "failed" and epoch1["state"] == "open"
    assert [(f["attempt"], f["count"], f["permanent"]) for f in epoch0["failures"]] == [("r1.0.0.0", 1, True)]


def test_a_bug_in_a_command_raises_instead_of_passing_for_a_user_error(pipe, zk_server, zk_root, monkeypatch):
    def broken(*args):
        raise TypeError("a bug")

    monkeypatch.setattr(cli, "read_status", broken)
    with pytest.raises(TypeError, match="a bug"):
        cli.main(["status", "--zk", zk_server.hosts, "--root", zk_root, "--app", "app"])


def test_an_unreadable_secret_file_is_an_error(tmp_path):
    result = twophase("status", "--zk", "127.0.0.1:1", "--app", "app", "--secret-file", str(tmp_path / "none"))
    assert result.returncode == 2 and "secret" in result.stderr


def test_recover_refuses_while_a_run_is_alive(pipe, zk_server, zk_root, zk):
    pipe.task("r1", 0, 0, range(10))
    zk.create(f"{pipe.qp.run('r1')}/alive", makepath=True, ephemeral=True)
    result = twophase("recover", "--zk", zk_server.hosts, "--root", zk_root, "--app", "app")
    assert result.returncode == 2 and "still alive" in result.stderr


def test_recover_rejects_a_checkpoint_of_another_query(pipe, zk_server, zk_root, tmp_path):
    pipe.task("r1", 0, 0, range(10))
    checkpoint = tmp_path / "other"
    os.makedirs(checkpoint)
    (checkpoint / "metadata").write_text('{"id":"someone-else"}\n')
    result = twophase("recover", "--zk", zk_server.hosts, "--root", zk_root, "--app", "app",
                      "--checkpoint", str(checkpoint))
    assert result.returncode == 2 and "belongs to query someone-else" in result.stderr


def test_recover_leaves_an_epoch_it_cannot_tell_about_undecided_and_says_what_to_run(zk, zk_server, zk_root, tmp_path):
    """Epoch 1 was begun by a run no driver hook recorded in order, and the query's checkpoint is on another host:
    whether Spark completed epoch 0 is unknown here, so recovery neither commits nor aborts it."""
    pipe = Pipeline(zk, zk_root, FileSink(str(tmp_path / "out")), records_runs=False)
    pipe.task("r1", 0, 0, range(10))
    pipe.task("r1", 1, 0, range(10, 20))
    zk.set(pipe.qp.base, json.dumps({"checkpoint": str(tmp_path / "elsewhere")}).encode())
    args = ("--zk", zk_server.hosts, "--root", zk_root, "--app", "app")
    result = twophase("recover", *args)
    assert result.returncode == 1
    assert "epoch 0: waits (" in result.stdout and "checkpoint is not the query's own or unreadable here" in result.stdout
    assert "twophase recover --checkpoint DIR" in result.stdout
    [record] = json.loads(twophase("recover", *args, "--json").stdout)["records"]
    assert (record["kind"], record["epoch"], record["failed"]) == ("epoch_blocked", 0, False)
    assert [len(pipe.registry.load(n)) for n in (0, 1)] == [1, 1] and ids_out(pipe) == []
    done = twophase("recover", *args, "--checkpoint", fake_checkpoint(tmp_path / "ck", completed=[0]))
    assert done.returncode == 0, done.stdout + done.stderr
    assert count_rows(range(10), ids_out(pipe)).exact


def test_recover_aborts_a_last_epoch_nothing_proves_only_when_told(pipe, zk, zk_server, zk_root):
    """The driver may have died right after Spark wrote commits/0 on a checkpoint this host cannot read: recover
    waits for `--checkpoint`, or for `--abort-unproven QUERY` from an operator who knows that query never runs
    again. Another query of the app, only stopped, keeps its pre-commits."""
    pipe.task("r1", 0, 0, range(10))
    other = PrecommitRegistry(zk, pipe.paths.query("q-2"), SIGNER)
    task = TaskAttempt(pipe.sink, other, TxnContext("app", "q-2", "s1", 0, 0, 0))
    assert task.open() and pipe.finish(task, range(10, 20))
    args = ("--zk", zk_server.hosts, "--root", zk_root, "--app", "app")
    waits = twophase("recover", *args)
    assert waits.returncode == 1, waits.stdout + waits.stderr
    assert "epoch 0: waits (no barrier or later epoch proves it complete" in waits.stdout
    assert f"--abort-unproven {QUERY}" in waits.stdout and len(pipe.registry.load(0)) == 1
    # Logged once: recover's dry pass before the real one only reports.
    assert waits.stderr.count(f"app app query {QUERY}: no barrier or later epoch proves it complete") == 1
    unknown = twophase("recover", *args, "--abort-unproven", "q-404")
    assert unknown.returncode == 2 and "no such query" in unknown.stderr
    aborted = twophase("recover", *args, "--abort-unproven", QUERY)
    assert aborted.returncode == 1, aborted.stdout + aborted.stderr  # q-2 still waits
    assert f"query {QUERY} epoch 0: aborted r1.0.0.0 (nothing proved the epoch complete" in aborted.stdout
    assert pipe.registry.load(0) == [] and ids_out(pipe) == [] and len(other.load(0)) == 1
