"""The ``twophase broker`` command: runs until SIGTERM/SIGINT, shuts down cleanly, restarts on its data."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys

import pytest
from confluent_kafka import Producer

from twophase.broker.cli import add_broker_parser, run_broker

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def start(data_dir, *extra: str) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([sys.executable, "-m", "twophase.broker.cli", "--data-dir", str(data_dir),
                             "--port", "0", *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)
    line = proc.stdout.readline()
    assert "listening on" in line, proc.stderr.read() if proc.poll() is not None else line
    return proc, line.rsplit(" ", 1)[1].strip()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_runs_until_signalled_and_shuts_down_cleanly(tmp_path, sig):
    proc, bootstrap = start(tmp_path / "data", "--default-partitions", "2", "--fsync", "100")
    try:
        p = Producer({"bootstrap.servers": bootstrap})
        p.produce("cli-topic", value=b"hello")
        assert p.flush(30) == 0
    finally:
        proc.send_signal(sig)
        _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 0, stderr
    assert "shutting down" in stderr and "stopped" in stderr
    assert "Traceback" not in stderr
    # Clean shutdown released the data directory: a second run starts on it and sees the topic.
    proc, bootstrap = start(tmp_path / "data")
    try:
        from confluent_kafka.admin import AdminClient

        topics = AdminClient({"bootstrap.servers": bootstrap}).list_topics(timeout=10).topics
        assert len(topics["cli-topic"].partitions) == 2
    finally:
        proc.terminate()
        proc.communicate(timeout=30)
    assert proc.returncode == 0


def test_refuses_a_data_directory_in_use(tmp_path):
    proc, _ = start(tmp_path / "data")
    try:
        second = subprocess.run([sys.executable, "-m", "twophase.broker.cli", "--data-dir", str(tmp_path / "data"),
                                 "--port", "0"], capture_output=True, text=True, timeout=30,
                                env={**os.environ, "PYTHONPATH": REPO})
        assert second.returncode == 2
        assert "in use" in second.stderr
    finally:
        proc.terminate()
        proc.communicate(timeout=30)


def test_add_broker_parser_wires_a_subcommand():
    parser = argparse.ArgumentParser(prog="twophase")
    sub = parser.add_subparsers(dest="command", required=True)
    add_broker_parser(sub)
    args = parser.parse_args(["broker", "--data-dir", "/tmp/x", "--fsync", "250", "--default-partitions", "3",
                              "--no-auto-create-topics"])
    assert args.func is run_broker
    assert (args.data_dir, args.host, args.port, args.fsync, args.default_partitions, args.auto_create_topics) == \
        ("/tmp/x", "127.0.0.1", 9092, 250, 3, False)
    assert parser.parse_args(["broker", "--data-dir", "d"]).fsync == "always"
    with pytest.raises(SystemExit):
        parser.parse_args(["broker", "--data-dir", "d", "--fsync", "sometimes"])


@pytest.mark.parametrize(("flags", "message"), [
    (["--port", "70000"], "--port: must be between 0 and 65535"),
    (["--port", "-1"], "--port: must be between 0 and 65535"),
    (["--group-initial-rebalance-delay-ms", "-5"], "must be at least 0"),
    (["--default-partitions", "0"], "must be at least 1"),
    (["--fsync", "sometimes"], "--fsync takes 'always' or a number"),
])
def test_bad_arguments_are_refused_before_anything_is_created(tmp_path, capsys, flags, message):
    parser = argparse.ArgumentParser(prog="twophase")
    add_broker_parser(parser.add_subparsers(dest="command", required=True))
    with pytest.raises(SystemExit) as exited:
        parser.parse_args(["broker", "--data-dir", str(tmp_path / "data"), *flags])
    assert exited.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "data").exists()


def test_an_empty_data_directory_is_refused(capsys):
    parser = argparse.ArgumentParser(prog="twophase")
    add_broker_parser(parser.add_subparsers(dest="command", required=True))
    with pytest.raises(SystemExit):
        parser.parse_args(["broker", "--data-dir", " "])
    assert "--data-dir: must name a directory" in capsys.readouterr().err  # not the current directory
