"""IdleConnections (sinks/postgres_idle.py) and PostgresSink's phase two on it, against a real PostgreSQL.
What the server holds is read from ``pg_stat_activity`` on a connection of the test's own."""

from __future__ import annotations

import pickle

import psycopg
import pytest

from sinks import postgres_idle
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


def test_a_connection_idle_too_long_is_closed_not_checked(idle, pg_dsn, monkeypatch):
    with idle.connection(pg_dsn) as old:
        pass
    monkeypatch.setattr(postgres_idle, "MAX_IDLE_S", 0.0)  # its flow may be gone without a reset: no check
    with idle.connection(pg_dsn) as conn:
        assert conn is not old and old.closed


# pickle.dumps(PostgresSink("host=127.0.0.1 port=1 dbname=OLDDB user=postgres", "t"), protocol=0) at commit
# 239e340, before phase two kept connections: a sink as ZooKeeper may hold it from before the upgrade.
OLD_PICKLE = (
    b"ccopy_reg\n_reconstructor\np0\n(csinks.postgres\nPostgresSink\np1\nc__builtin__\nobject\np2\nNtp3\nRp4\n"
    b"(dp5\nVdsn\np6\nVuser=postgres dbname=OLDDB host=127.0.0.1 port=1\np7\nsVdatabase\np8\nVOLDDB\np9\n"
    b"sVtable\np10\n(Vt\np11\ntp12\nsVmarker_table\np13\n(Vtwophase_commits\np14\ntp15\nsVmode\np16\n"
    b"Vappend\np17\nsVcolumns\np18\nNsVkey\np19\nNsVlock_timeout\np20\nF60.0\nsV_tag\np21\nV91c36cc7\np22\nsb."
)


def test_a_sink_pickled_before_phase_two_kept_connections_commits_and_closes(pg_dsn):
    execute(pg_dsn, "CREATE TABLE t (id bigint)")
    sink = PostgresSink(pg_dsn, "t")
    sink.check_target(None)
    handle = prepare(sink, ctx(), [{"id": 1}])
    old = pickle.loads(OLD_PICKLE.replace(b"user=postgres dbname=OLDDB host=127.0.0.1 port=1", pg_dsn.encode()))
    try:
        old.commit(handle)
        old.commit(handle)
    finally:
        old.close()
    assert ids(pg_dsn) == [1]
    wait_until(lambda: backends(pg_dsn) == [], what="the old sink's connection to be closed")


def test_each_copy_of_a_sink_keeps_connections_of_its_own(pg_dsn):
    execute(pg_dsn, "CREATE TABLE t (id bigint)")
    sink = PostgresSink(pg_dsn, "t")
    sink.check_target(None)
    first, second = (prepare(sink, ctx(epoch=e), [{"id": e}]) for e in range(2))
    sink.commit(first)
    copy = pickle.loads(pickle.dumps(sink))
    try:
        copy.commit(second)
        assert len(backends(pg_dsn)) == 2  # the copy did not take the original's kept connection
    finally:
        copy.close()
        sink.close()
    assert ids(pg_dsn) == [0, 1]


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
