"""Hostile or damaged ZooKeeper records against ``twophase status`` / ``recover`` and the coordinator.

Attacks: malformed JSON in the watermark, the barrier, an epoch record, a run record; another app's validly signed
sink (or pre-commit) copied into this app; a bare malicious pickle in the sink node; a blob in the
old signature format. Safe outcome: a message naming the znode and what is wrong, exit code 2, no
traceback, nothing unpickled that does not verify, and ``recover`` changes nothing (the fence and
every record stay as they were) on an app whose records it cannot read.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import pickle

import pytest

from coordinator.app import AppCoordinator, publish_app
from coordinator.daemon import CoordinatorDaemon
from coordinator.layout import AppPaths
from coordinator.precommits import PrecommitRegistry
from coordinator.zk import dump
from sinks.files import FileSink
from tests.harness import QUERY, SIGNER, Pipeline
from twophase import cli
from twophase.signing import SignatureError
from twophase.sink import TxnContext


class _Exploit:
    """Unpickling it creates a file: proof that unverified bytes were loaded."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def tree(zk, path: str) -> dict[str, tuple[bytes, int]]:
    """Every znode under ``path`` with its data and version."""
    data, stat = zk.get(path)
    out = {path: (data, stat.version)}
    for child in zk.get_children(path):
        out.update(tree(zk, f"{path}/{child}"))
    return out


@pytest.fixture
def pipe(zk, zk_root, tmp_path):
    """An app with a completed epoch 0 (a registered winner and Spark's barrier): recover would commit it."""
    pipe = Pipeline(zk, zk_root, FileSink(str(tmp_path / "out")))
    pipe.task("r1", 0, 0, range(3))
    pipe.barrier(0, "r1")
    return pipe


def run(capsys, zk_server, zk_root, *args: str) -> tuple[int, str, str]:
    code = cli.main([args[0], "--zk", zk_server.hosts, "--root", zk_root, "--app", "app", *args[1:]])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("node, content, complaint", [
    pytest.param("watermark", b'{"x": 1}', '"epoch" must be an integer', id="watermark-without-epoch"),
    pytest.param("watermark", b"not json", "not JSON", id="watermark-not-json"),
    pytest.param("barrier", b"[]", "expected a JSON object", id="barrier-a-list"),
    pytest.param("barrier", b'{"epoch": "7"}', '"epoch" must be an integer', id="barrier-epoch-a-string"),
    pytest.param("epoch", b"{}", "state None", id="epoch-record-empty-object"),
    pytest.param("epoch", b"123", "expected a JSON object", id="epoch-record-a-number"),
    pytest.param("epoch", b'{"state": "committing", "winners": "r1.0.0.0"}', "winners", id="epoch-winners"),
    pytest.param("epoch-name", b"", "not an epoch number", id="epoch-name"),
])
@pytest.mark.parametrize("command", ["status", "recover", "recover --dry-run"])
def test_a_malformed_record_is_named_and_recover_changes_nothing(pipe, zk, zk_server, zk_root, capsys,
                                                                 node, content, complaint, command):
    path = {"watermark": pipe.qp.watermark, "barrier": pipe.qp.barrier, "epoch": pipe.qp.epoch(0),
            "epoch-name": f"{pipe.qp.epochs}/latest"}[node]
    zk.ensure_path(path)
    zk.set(path, content)
    before = tree(zk, pipe.paths.base)
    code, _, err = run(capsys, zk_server, zk_root, *command.split())
    assert code == 2
    assert path in err and complaint in err and "Traceback" not in err
    assert tree(zk, pipe.paths.base) == before  # the fence included: ownership did not change hands


@pytest.mark.parametrize("command", ["status", "recover", "recover --dry-run"])
def test_a_malformed_run_record_is_named_and_recover_changes_nothing(zk, zk_server, zk_root, tmp_path, capsys, command):
    """Epoch 0 here is proven only by run r1 having begun epoch 1, which needs r1's record: a damaged one is
    named, never taken as in order."""
    with Pipeline(zk, zk_root, FileSink(str(tmp_path / "out")), records_runs=False) as pipe:
        pipe.task("r1", 0, 0, range(3))
        pipe.task("r1", 1, 0, range(3, 6))
        zk.set(pipe.qp.run("r1"), b'{"started": 1.0, "driver": "d", "in_order": "yes"}')
        before = tree(zk, pipe.paths.base)
        code, _, err = run(capsys, zk_server, zk_root, *command.split())
        assert code == 2
        assert pipe.qp.run("r1") in err and '"in_order"' in err and "Traceback" not in err
        assert tree(zk, pipe.paths.base) == before


def test_the_daemon_skips_an_app_whose_record_is_damaged_and_serves_the_others(pipe, zk, zk_root, caplog):
    zk.create(f"{zk_root}/apps/broken", b"[]")
    zk.set(pipe.paths.base, dump({"coordinator": "daemon"}))
    daemon = CoordinatorDaemon("unused", zk_root, SIGNER)
    assert daemon._daemon_apps(zk) == ["app"]
    assert "'broken' skipped" in caplog.text and "expected a JSON object" in caplog.text
    # Every round reads the apps again: the same trouble is not logged as an ERROR again ...
    assert daemon._daemon_apps(zk) == ["app"]
    assert [r.levelname for r in caplog.records if "'broken'" in r.getMessage()] == ["ERROR"]
    # ... until it is mended and breaks again.
    zk.set(f"{zk_root}/apps/broken", b"{}")
    assert daemon._daemon_apps(zk) == ["app"]
    zk.set(f"{zk_root}/apps/broken", b"123")
    daemon._daemon_apps(zk)
    assert [r.levelname for r in caplog.records if "'broken' skipped" in r.getMessage()] == ["ERROR", "ERROR"]


# -- signatures -----------------------------------------------------------------------------------

def publish_other_app(zk, zk_root, tmp_path) -> AppPaths:
    other = AppPaths(zk_root, "other")
    publish_app(zk, other, SIGNER, FileSink(str(tmp_path / "other-out")), "embedded")
    return other


@pytest.mark.parametrize("command", ["status", "recover", "recover --dry-run"])
def test_another_apps_signed_sink_is_refused_everywhere(pipe, zk, zk_server, zk_root, tmp_path, capsys, command):
    other = publish_other_app(zk, zk_root, tmp_path)
    zk.set(pipe.paths.sink, zk.get(other.sink)[0])  # validly signed, for another znode
    before = tree(zk, pipe.paths.base)
    code, out, err = run(capsys, zk_server, zk_root, *command.split())
    assert code == 2 and "Traceback" not in err
    assert "bad signature" in err and pipe.paths.sink in err
    if command == "status":
        assert "sink signature invalid" in err and "SINK SIGNATURE INVALID" in out
    assert tree(zk, pipe.paths.base) == before


def test_the_coordinator_refuses_a_foreign_sink_before_taking_ownership(pipe, zk, zk_root, tmp_path):
    other = publish_other_app(zk, zk_root, tmp_path)
    owner = pipe.coordinator(owner="the embedded coordinator")  # the current, legitimate owner
    zk.set(pipe.paths.sink, zk.get(other.sink)[0])
    before = tree(zk, pipe.paths.base)
    daemon_side = AppCoordinator(zk, zk_root, "app", SIGNER, "daemon")
    with pytest.raises(SignatureError, match="bad signature"):
        daemon_side.prepare()  # what the daemon and the driver's host call first
    assert tree(zk, pipe.paths.base) == before
    owner.fence.check()  # still the owner


def test_a_bare_pickle_in_the_sink_node_is_reported_and_never_loaded(pipe, zk, zk_server, zk_root, tmp_path,
                                                                     capsys):
    marker = str(tmp_path / "pwned")
    zk.set(pipe.paths.sink, pickle.dumps(_Exploit(marker)))
    code, out, err = run(capsys, zk_server, zk_root, "status")
    assert code == 2 and "sink signature invalid" in err and "not a signed twophase payload" in err
    before = tree(zk, pipe.paths.base)
    for command in (["recover", "--dry-run"], ["recover"]):
        code, _, err = run(capsys, zk_server, zk_root, *command)
        assert code == 2 and "not a signed twophase payload" in err and "Traceback" not in err
    assert tree(zk, pipe.paths.base) == before  # recover took no ownership
    assert not os.path.exists(marker)


def test_a_pre_commit_copied_from_another_app_is_refused(pipe, zk, zk_server, zk_root, tmp_path, capsys):
    other = publish_other_app(zk, zk_root, tmp_path).query(QUERY)
    registry = PrecommitRegistry(zk, other, SIGNER)
    registry.register(registry.intend(TxnContext("other", QUERY, "r1", 0, 0, 0)), {"file": "/elsewhere"})
    name = "r1.0.0.0"  # the same attempt name in both apps
    zk.set(f"{pipe.qp.attempts(0)}/{name}", zk.get(f"{other.attempts(0)}/{name}")[0])
    before = tree(zk, pipe.paths.base)
    code, _, err = run(capsys, zk_server, zk_root, "recover")
    assert code == 2 and "bad signature" in err and f"{pipe.qp.attempts(0)}/{name}" in err
    assert tree(zk, pipe.paths.base) == before


def test_a_sink_in_the_old_signature_format_asks_to_be_republished(pipe, zk, zk_server, zk_root, capsys):
    payload = pickle.dumps({"not": "loaded"})
    secret = os.environ["TWOPHASE_SECRET"].encode()
    zk.set(pipe.paths.sink, b"TP1" + hmac.new(secret, payload, hashlib.sha256).digest() + payload)
    code, _, err = run(capsys, zk_server, zk_root, "status")
    assert code == 2 and "older format" in err and "re-publish" in err
