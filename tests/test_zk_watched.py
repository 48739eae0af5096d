"""coordinator.zk.watched_data against a ZooKeeper server of the test's own, through its shared client."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

from coordinator import zk as zk_module
from coordinator.zk import shared_client, watched_data
from tests.waiting import wait_until
from twophase.zkserver import ZooKeeperServer


def test_watched_data_follows_changes_and_never_blocks_the_client_once_zookeeper_is_gone():
    """Its watch only drops what it kept (reading in kazoo's event thread, with the client's retry-forever
    policy, would hang the client's stop for ever once the server is gone: a CI run hung so at exit)."""
    server = ZooKeeperServer().start()
    hosts = server.hosts
    client = shared_client(hosts)
    try:
        assert watched_data(hosts, "/w") == b""
        client.create("/w", b"one")
        wait_until(lambda: watched_data(hosts, "/w") == b"one", what="the creation to be seen")
        client.set("/w", b"two")
        wait_until(lambda: watched_data(hosts, "/w") == b"two", what="the change to be seen")
        server.restart()  # the session survives a restart: the watch is set again on reconnect
        wait_until(lambda: client.connected, what="the client to reconnect")
        client.set("/w", b"three")
        wait_until(lambda: watched_data(hosts, "/w") == b"three", what="the change after the restart")
        client.set("/w", b"four")  # an event in flight as the server goes
        server.stop()
        stopping = threading.Thread(target=client.stop)
        stopping.start()
        stopping.join(30)
        assert not stopping.is_alive(), "stopping the client hangs"
    finally:
        server.stop()
        with zk_module._shared_lock:
            zk_module._shared.pop(hosts, None)
        client.stop()
        client.close()


_EXITING_DRIVER = """
import sys
from kazoo.recipe.watchers import DataWatch
from coordinator.zk import at_exit, connect

client = connect(sys.argv[1], session_timeout=4)
client.ensure_path("/exiting")
DataWatch(client, "/exiting", lambda data, stat: None)
at_exit(lambda: print("exit hook: client stopped already?", client._stopped.is_set(), flush=True))
print("ready", flush=True)
sys.stdin.readline()  # the server is gone now: kazoo's watch callback retries its read for ever
"""


def test_a_process_exits_while_zookeeper_is_away_and_its_exit_hooks_run_before_the_clients_stop():
    """kazoo's own exit hook joins a client's callback threads without stopping the client: a watch callback
    retrying its read (the retry-forever policy) blocked the interpreter's exit for ever once ZooKeeper was
    gone, as a bench driver did after its server stopped. connect() stops its clients at exit first."""
    server = ZooKeeperServer().start()
    proc = subprocess.Popen([sys.executable, "-c", _EXITING_DRIVER, server.hosts], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=Path(__file__).resolve().parents[1])
    try:
        assert proc.stdout.readline().strip() == "ready"
        server.stop()
        out, _ = proc.communicate("go\n", timeout=60)
    finally:
        server.stop()
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, out
    assert "exit hook: client stopped already? False" in out
