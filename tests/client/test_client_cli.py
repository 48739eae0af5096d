"""`twophase txns list|describe|abort` against a real broker, run as the installed command does."""

from __future__ import annotations

import subprocess
import sys

import pytest

from twophase.cli import main
from twophase.client import Producer


def txns(broker_or_bootstrap, *args: str, timeout_s: float = 5) -> subprocess.CompletedProcess:
    bootstrap = getattr(broker_or_bootstrap, "bootstrap", broker_or_bootstrap)
    return subprocess.run([sys.executable, "-m", "twophase.cli", "txns", "--bootstrap-server", bootstrap,
                           "--timeout", str(timeout_s), *args], capture_output=True, text=True, timeout=60)


def test_list_describe_and_abort_a_hanging_transaction(broker, topic):
    hanging = Producer(broker.bootstrap, transactional_id="hanging", enable_2pc=True)
    hanging.init_transactions()
    hanging.begin_transaction()
    hanging.send(topic, value=b"x", partition=0)
    hanging.prepare_transaction()
    with Producer(broker.bootstrap, transactional_id="done") as done:
        done.init_transactions()
        done.begin_transaction()
        done.send(topic, value=b"y", partition=0)
        done.commit_transaction()

    listed = txns(broker, "list")
    assert listed.returncode == 0, listed.stderr
    header, *rows = listed.stdout.splitlines()
    assert header.split()[:3] == ["TRANSACTIONAL", "ID", "STATE"]
    by_id = {r.split()[0]: r.split() for r in rows}
    assert by_id["hanging"][1] == "Ongoing" and by_id["hanging"][6] == f"{topic}-0"
    assert by_id["hanging"][4].endswith("s") and by_id["hanging"][4] != "-"  # age of the open transaction
    assert by_id["done"][1] == "CompleteCommit" and by_id["done"][4] == "-"

    ongoing = txns(broker, "list", "--state", "Ongoing")
    assert [r.split()[0] for r in ongoing.stdout.splitlines()[1:]] == ["hanging"]

    described = txns(broker, "describe", "hanging", "done")
    assert described.returncode == 0 and len(described.stdout.splitlines()) == 3

    aborted = txns(broker, "abort", "hanging")
    assert aborted.returncode == 0, aborted.stderr
    assert "was Ongoing" in aborted.stdout and "now Empty" in aborted.stdout
    assert txns(broker, "list", "--state", "Ongoing").stdout.splitlines()[1:] == []
    hanging.close()


def test_errors_exit_non_zero_with_a_message(broker):
    missing = txns(broker, "describe", "no-such-id")
    assert missing.returncode == 1 and "TRANSACTIONAL_ID_NOT_FOUND" in missing.stderr
    bad_state = txns(broker, "list", "--state", "Sleeping")
    assert bad_state.returncode == 1 and "Sleeping" in bad_state.stderr
    unreachable = txns("127.0.0.1:1", "list", timeout_s=0.5)
    assert unreachable.returncode == 1 and "no broker reachable" in unreachable.stderr


def test_usage_and_help(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["txns", "--bootstrap-server", "x:1"])  # no subcommand
    assert exited.value.code == 2
    for args in (["--help"], ["--bootstrap-server", "x:1", "list", "--help"],
                 ["--bootstrap-server", "x:1", "abort", "--help"]):
        with pytest.raises(SystemExit) as exited:
            main(["txns", *args])
        assert exited.value.code == 0 and "usage: twophase txns" in capsys.readouterr().out
