"""The private ZooKeeper server used by the other tests and the demo."""

from __future__ import annotations

import time

import pytest
from kazoo.client import KazooClient

from twophase.zkserver import ZooKeeperServer, ZooKeeperServerError


def _client(server: ZooKeeperServer) -> KazooClient:
    client = KazooClient(hosts=server.hosts, timeout=5.0)
    client.start(timeout=10)
    return client


def _close(client: KazooClient) -> None:
    client.stop()
    client.close()


def test_shared_server_create_get(zk, zk_root, zk_server):
    assert zk_server.hosts.startswith("127.0.0.1:")
    zk.create(f"{zk_root}/a", b"hello", makepath=True)
    data, stat = zk.get(f"{zk_root}/a")
    assert data == b"hello" and stat.version == 0
    assert "Mode: standalone" in zk_server.command("srvr")


def test_restart_preserves_data_and_port():
    with ZooKeeperServer() as server:
        port = server.port
        client = _client(server)
        client.create("/keep", b"v1")
        _close(client)

        server.restart()
        assert server.port == port
        client = _client(server)
        assert client.get("/keep")[0] == b"v1"
        _close(client)


def test_kill_then_start_again():
    with ZooKeeperServer() as server:
        client = _client(server)
        client.create("/survivor", b"x")
        client.create("/eph", b"", ephemeral=True)
        _close(client)

        pid = server.pid
        server.kill()
        assert not server.running and server.pid is None
        server.start()
        assert server.pid != pid
        client = _client(server)
        assert client.get("/survivor")[0] == b"x"  # committed writes survive SIGKILL
        _close(client)


def test_two_servers_get_different_ports():
    with ZooKeeperServer() as a, ZooKeeperServer() as b:
        assert a.port != b.port
        ca, cb = _client(a), _client(b)
        ca.create("/only-a")
        assert cb.exists("/only-a") is None
        _close(ca)
        _close(cb)


def test_stop_removes_temp_dir():
    server = ZooKeeperServer().start()
    work = server.log_path.parent
    assert work.exists()
    server.stop()
    assert not work.exists() and not server.running


def test_explicit_data_dir_kept(tmp_path):
    with ZooKeeperServer(data_dir=str(tmp_path / "zk")) as server:
        client = _client(server)
        client.create("/x", b"1")
        _close(client)
    with ZooKeeperServer(data_dir=str(tmp_path / "zk")) as server:
        client = _client(server)
        assert client.get("/x")[0] == b"1"
        _close(client)


def test_short_session_expiry(zk_server):
    """minSessionTimeout is small, so expiry tests can run in about a second."""
    client = KazooClient(hosts=zk_server.hosts, timeout=1.0)
    client.start(timeout=10)
    assert client._session_timeout <= 2000  # negotiated by the server
    _close(client)


def test_start_failure_reports_log(monkeypatch):
    monkeypatch.setenv("TWOPHASE_ZK_CLASSPATH", "/nonexistent/zookeeper.jar")
    server = ZooKeeperServer()
    t0 = time.monotonic()
    with pytest.raises(ZooKeeperServerError, match="exited"):
        server.start(timeout=20)
    assert time.monotonic() - t0 < 15
    server.stop()
