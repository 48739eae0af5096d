"""The `twophase` CLI as a user runs it: a real process against a real ZooKeeper."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from sinks.files import FileSink
from tests.harness import QUERY, Pipeline, ids_out
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
    assert "committed watermark: -1" in result.stdout
    assert "r1.0.0  partition 0 attempt 0  winner  pending" in result.stdout


def test_recover_commits_completed_epochs_and_aborts_the_rest(pipe, zk_server, zk_root, tmp_path):
    for p in range(2):
        pipe.task("r1", 0, p, range(p * 10, p * 10 + 10))
    pipe.task("r1", 1, 0, range(20, 30))  # Spark never completed epoch 1: it will re-run it
    checkpoint = fake_checkpoint(tmp_path / "ck", completed=[0])
    args = ("recover", "--zk", zk_server.hosts, "--root", zk_root, "--app", "app", "--checkpoint", checkpoint)

    dry = twophase(*args, "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert "[dry-run] epoch 0: would commit 2 pre-commit(s) of run r1" in dry.stdout
    assert "[dry-run] epoch 1: would abort r1.0.0" in dry.stdout
    assert ids_out(pipe) == []

    done = twophase(*args)
    assert done.returncode == 0, done.stderr
    assert "epoch 0: committed 2 pre-commit(s) of run r1" in done.stdout
    assert "epoch 1: aborted r1.0.0" in done.stdout
    assert count_rows(range(20), ids_out(pipe)).exact
    assert pipe.watermark() == 0 and pipe.registry.load(1) == []


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
