"""Option values that would make a command spin, hang, talk to nobody or act on the wrong thing.

Safe outcome: the command refuses at once with exit code 2 and a message naming the option, before
it connects anywhere or touches a data directory; the library refuses the same values (ValueError),
so Python callers cannot get around the check.
"""

from __future__ import annotations

import pytest

from coordinator.app import CommitPolicy
from coordinator.daemon import CoordinatorDaemon
from tests.harness import SIGNER
from twophase import cli
from twophase.broker import Broker

ZK = ["--zk", "127.0.0.1:1"]  # never reached: the refusal comes first


@pytest.mark.parametrize("argv, option", [
    *[(["coordinator", *ZK, "--poll-interval", v], "--poll-interval") for v in ("0", "-5", "nan", "inf", "x")],
    *[(["coordinator", *ZK, "--session-timeout", v], "--session-timeout") for v in ("0", "-1", "nan")],
    *[(["recover", *ZK, "--app", "a", "--attempts", v], "--attempts") for v in ("0", "-1")],
    *[([cmd, *ZK, "--app", v], "--app") for cmd in ("status", "recover") for v in ("", " ", "a/b", "..", "a\nb")],
    (["broker", "--data-dir", "unused", "--max-request-bytes", "10"], "--max-request-bytes"),
    (["broker", "--data-dir", "unused", "--host", ""], "--host"),
    *[(["txns", "--bootstrap-server", "127.0.0.1:1", "--timeout", v, "list"], "--timeout") for v in ("0", "-1", "nan")],
    (["broker", "--data-dir", "unused", "--advertised-host", ""], "--advertised-host"),
])
def test_a_bad_option_exits_2_naming_it(tmp_path, monkeypatch, capsys, argv, option):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    assert f"argument {option}" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # no data directory made


@pytest.mark.parametrize("make", [
    pytest.param(lambda tmp: CommitPolicy(poll_interval=0), id="poll-interval-0"),
    pytest.param(lambda tmp: CommitPolicy(poll_interval=float("nan")), id="poll-interval-nan"),
    pytest.param(lambda tmp: CommitPolicy(attempts=0), id="attempts-0"),
    pytest.param(lambda tmp: CoordinatorDaemon("127.0.0.1:1", "/r", SIGNER, session_timeout=-1), id="session-timeout"),
    pytest.param(lambda tmp: Broker(str(tmp / "d"), host=""), id="host-empty"),
    pytest.param(lambda tmp: Broker(str(tmp / "d"), max_request_bytes=10), id="max-request-bytes-10"),
])
def test_the_library_refuses_the_same_values(tmp_path, make):
    with pytest.raises(ValueError):
        make(tmp_path)
    assert list(tmp_path.iterdir()) == []
