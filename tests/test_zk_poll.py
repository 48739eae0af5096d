"""coordinator.zk_poll.PollingHandler: select(2)'s contract in one poll(2), for any descriptor number."""

from __future__ import annotations

import os
import resource
import socket

import pytest

from coordinator.zk import connect
from coordinator.zk_poll import PollingHandler
from twophase.zkserver import ZooKeeperServer


@pytest.fixture
def pair():
    a, b = socket.socketpair()
    yield a, b
    a.close()
    b.close()


def test_select_reports_what_is_ready_and_times_out_with_nothing(pair):
    a, b = pair
    handler = PollingHandler()
    assert handler.select([a], [], [], 0) == ([], [], [])
    assert handler.select([a], [b], [], 0) == ([], [b], [])
    b.send(b"x")
    assert handler.select([a, b], [], [], 1.0) == ([a], [], [])
    assert handler.select([a], [a], [], None) == ([a], [a], [])  # both asked of one descriptor


def test_select_hands_poll_its_timeout_in_milliseconds(monkeypatch, pair):
    asked = []

    class Poller:
        def register(self, fd, events):
            pass

        def poll(self, timeout):
            asked.append(timeout)
            return []

    monkeypatch.setattr("coordinator.zk_poll.select.poll", Poller)
    a, _ = pair
    for timeout in (0.25, 0, None):
        assert PollingHandler().select([a], [], [], timeout) == ([], [], [])
    assert asked == [250.0, 0, None]


def test_select_reports_a_closed_peer_as_readable_and_refuses_a_closed_socket(pair):
    a, b = pair
    handler = PollingHandler()
    b.close()
    assert handler.select([a], [], [], 1.0)[0] == [a]  # recv then reads the end, as after select(2)
    a.close()
    with pytest.raises((TypeError, ValueError)):
        handler.select([a], [], [], 0)
    with pytest.raises(ValueError):
        handler.select([], [], [], -1)


def test_select_takes_descriptors_above_1024(pair):
    """A Spark driver may hold more than 1024 descriptors, which select(2) cannot wait on."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1100:
        pytest.skip(f"the descriptor limit is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1100), hard))
    a, b = pair
    high = os.dup2(a.fileno(), 1090)  # the same socket, numbered above select(2)'s limit
    try:
        assert PollingHandler().select([high], [], [], 0) == ([], [], [])
        b.send(b"x")
        assert PollingHandler().select([high], [], [], 1.0) == ([high], [], [])
    finally:
        os.close(high)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_clients_made_by_connect_poll_and_serve_requests_pipelined(zk_server: ZooKeeperServer):
    client = connect(zk_server.hosts)
    try:
        assert isinstance(client.handler, PollingHandler)
        client.ensure_path("/zk-poll")
        pending = [client.create_async(f"/zk-poll/n{i}", str(i).encode()) for i in range(200)]
        assert [p.get(timeout=30) for p in pending] == [f"/zk-poll/n{i}" for i in range(200)]
        assert sorted(client.get_children("/zk-poll")) == sorted(f"n{i}" for i in range(200))
    finally:
        client.delete("/zk-poll", recursive=True)
        client.stop()
        client.close()
