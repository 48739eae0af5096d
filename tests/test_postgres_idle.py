"""IdleConnections (sinks/postgres_idle.py) and PostgresSink's phase two on it, against a real PostgreSQL.
What the server holds is read from ``pg_stat_activity`` on a connection of the test's own."""

from __future__ import annotations

import pickle

import psycopg
import pytest

from sinks.postgres import PostgresSink
from sinks.postgres_idle import IdleConnections
from coordinator.app import publish_app
from tests.harness import SIGNER, Pipeline
from tests.test_postgres_sink import ctx, execute, ids, prepare
from tests.waiting import wait_for, wait_until
from twophase.pgserver import PostgresServer

APP_NAME = "twophase phase two"


def connect(dsn):
    return psycopg.connect(dsn, autocommit=True, application_name=APP_NAME)


def backends(dsn):
    """The server processes serving phase two in ``dsn``'s database, as the server lists them."""
    return sorted(r[0] for r in execute(dsn, "SELECT pid FROM pg_stat_activity WHERE application_name = %s "
                                             "AND datname = current_database()", (APP_NAME,)))


@pytest.fixture
def idle():
    idle = IdleConnections(connect, keep=2)
    yield idle
    idle.close()


def test_a_connection_given_back_idle_is_taken_again(idle, pg_dsn):
    with idle.connection(pg_dsn) as conn:
        first = conn.info.backend_pid
    with idle.connection(pg_dsn) as conn:
        assert conn.info.backend_pid == first
    assert backends(pg_dsn) == [first]


def test_at_most_keep_connections_stay_open(idle, pg_dsn):
    with idle.connection(pg_dsn) as a, idle.connection(pg_dsn) as b, idle.connection(pg_dsn) as c:
        pids = {a.info.backend_pid, b.info.backend_pid, c.info.backend_pid}
        assert len(pids) == 3
    assert a.closed and not b.closed and not c.closed  # given back last, with two kept already
    wait_until(lambda: len(backends(pg_dsn)) == 2, what="the third connection's server process to end")


def test_a_connection_that_raised_or_holds_a_transaction_is_closed_not_kept(idle, pg_dsn):
    with pytest.raises(psycopg.errors.DivisionByZero), idle.connection(pg_dsn) as conn:
        conn.execute("SELECT 1/0")
    assert conn.closed
    with idle.connection(pg_dsn) as conn:
        conn.execute("BEGIN")
    assert conn.closed
    wait_until(lambda: backends(pg_dsn) == [], what="both server processes to end")


def test_close_closes_the_idle_and_later_returns(idle, pg_dsn):
    with idle.connection(pg_dsn) as returned_later:
        with idle.connection(pg_dsn) as kept:
            pass
        idle.close()
        assert kept.closed and not returned_later.closed
    assert returned_later.closed
    with idle.connection(pg_dsn) as conn:  # still works after close, and closes after itself
        conn.execute("SELECT 1")
    assert conn.closed


def test_it_pickles_empty(idle, pg_dsn):
    with idle.connection(pg_dsn) as kept:
        pass
    copy = pickle.loads(pickle.dumps(idle))
    try:
        with copy.connection(pg_dsn) as conn:
            assert conn.info.backend_pid != kept.info.backend_pid
    finally:
        copy.close()


def test_phase_two_commits_on_one_connection_and_close_releases_it(pg_dsn):
    execute(pg_dsn, "CREATE TABLE t (id bigint)")
    sink = PostgresSink(pg_dsn, "t")
    sink.check_target(None)
    handles = [prepare(sink, ctx(epoch=e), [{"id": e}]) for e in range(3)]
    seen = []
    for handle in handles:
        sink.commit(handle)
        seen.append(backends(pg_dsn))
    assert ids(pg_dsn) == [0, 1, 2]
    assert len(seen[0]) == 1 and seen == [seen[0]] * 3
    sink.close()
    wait_until(lambda: backends(pg_dsn) == [], what="phase two's connection to be closed")


def test_a_connection_the_server_dropped_since_its_last_call_is_replaced():
    with PostgresServer() as server:
        dsn = server.create_database("d")
        execute(dsn, "CREATE TABLE t (id bigint)")
        sink = PostgresSink(dsn, "t")
        sink.check_target(None)
        try:
            first, second = (prepare(sink, ctx(epoch=e), [{"id": e}]) for e in range(2))
            sink.commit(first)
            server.kill()
            server.start()  # the prepared transaction survives; the kept connection does not
            sink.commit(second)
        finally:
            sink.close()
        assert ids(dsn) == [0, 1]


def test_the_coordinator_closes_its_sink_when_closed_or_given_a_newer_one(zk, zk_root, pg_dsn):
    execute(pg_dsn, "CREATE TABLE t (id bigint)")
    sink = PostgresSink(pg_dsn, "t")
    sink.check_target(None)
    with Pipeline(zk, zk_root, sink) as pipe:
        pipe.task("r1", 0, 0, [0])
        pipe.barrier(0, "r1")
        app = pipe.coordinator()
        assert app.reconcile().ok and ids(pg_dsn) == [0]
        held = wait_for(lambda: backends(pg_dsn), what="phase two's connection")
        publish_app(zk, pipe.paths, SIGNER, sink, "embedded")  # a new driver stores its sink
        pipe.task("r1", 1, 0, [1])
        pipe.barrier(1, "r1")
        assert app.reconcile().ok and ids(pg_dsn) == [0, 1]
        wait_until(lambda: held[0] not in backends(pg_dsn), what="the replaced sink's connection to be closed")
        assert len(backends(pg_dsn)) == 1
    wait_until(lambda: backends(pg_dsn) == [], what="the closed coordinator's connection to be closed")


def test_a_task_aborting_its_losing_pre_commit_keeps_no_connection(zk, zk_root, pg_dsn):
    execute(pg_dsn, "CREATE TABLE t (id bigint)")
    sink = PostgresSink(pg_dsn, "t")
    sink.check_target(None)
    with Pipeline(zk, zk_root, sink) as pipe:
        first, second = pipe.begin("r1", 0, 0, attempt=0), pipe.begin("r1", 0, 0, attempt=1)
        assert pipe.finish(first, [0]) and not pipe.finish(second, [0])  # the second aborts its own
    wait_until(lambda: backends(pg_dsn) == [], what="the loser's abort connection to be closed")
    assert execute(pg_dsn, "SELECT count(*) FROM pg_prepared_xacts WHERE database = current_database()") == [(1,)]
