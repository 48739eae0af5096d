"""The private PostgreSQL server used by the PostgreSQL sink's tests and the demo."""

from __future__ import annotations

import socket

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict

from twophase.pgserver import PostgresServer, PostgresServerError


def _connect(dsn: str) -> psycopg.Connection:
    return psycopg.connect(dsn, autocommit=True)


def _prepare(dsn: str, gid: str, value: int) -> None:
    """Insert ``value`` into t in a transaction left prepared as ``gid``."""
    with _connect(dsn) as conn:
        conn.execute("BEGIN")
        conn.execute("INSERT INTO t VALUES (%s)", (value,))
        conn.execute(f"PREPARE TRANSACTION '{gid}'")


def test_fresh_database_per_test(pg_dsn, pg_server):
    params = conninfo_to_dict(pg_dsn)
    assert params["host"] == "127.0.0.1" and int(params["port"]) == pg_server.port
    with _connect(pg_dsn) as conn:
        assert conn.execute("SELECT current_database()").fetchone()[0] == params["dbname"]
        assert conn.execute("SELECT count(*) FROM pg_tables WHERE schemaname = 'public'").fetchone()[0] == 0
        assert conn.execute("SHOW max_prepared_transactions").fetchone()[0] == "64"
        conn.execute("CREATE TABLE t (x int)")
        conn.execute("INSERT INTO t VALUES (1)")
        assert conn.execute("SELECT x FROM t").fetchall() == [(1,)]


def test_drop_database_rolls_back_its_prepared_transactions(pg_server):
    dsn = pg_server.create_database("t_drop_prepared")
    with _connect(dsn) as conn:
        conn.execute("CREATE TABLE t (x int)")
    _prepare(dsn, "left-behind", 1)
    pg_server.drop_database("t_drop_prepared")
    with _connect(pg_server.dsn) as conn:
        assert conn.execute("SELECT count(*) FROM pg_database WHERE datname = 't_drop_prepared'").fetchone()[0] == 0
        assert conn.execute("SELECT count(*) FROM pg_prepared_xacts").fetchone()[0] == 0


def test_database_name_too_long(pg_server):
    with pytest.raises(ValueError, match="database name"):
        pg_server.create_database("x" * 64)


def test_stop_removes_temp_dir_and_frees_port():
    server = PostgresServer().start()
    work, port = server.log_path.parent, server.port
    assert (server.data_dir / "PG_VERSION").exists()
    server.stop()
    assert not work.exists() and not server.running and server.pid is None
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # nothing listens there any more


def test_prepared_transaction_survives_kill():
    with PostgresServer() as server:
        dsn = server.create_database("chaos")
        with _connect(dsn) as conn:
            conn.execute("CREATE TABLE t (x int)")
        _prepare(dsn, "epoch-7", 42)
        held = _connect(dsn)
        port, pid = server.port, server.pid

        server.kill()
        assert not server.running and server.pid is None
        with pytest.raises(psycopg.OperationalError):  # its backend died with the postmaster
            held.execute("SELECT 1")
        held.close()

        server.start()  # waits for crash recovery
        assert server.port == port and server.pid != pid
        with _connect(dsn) as conn:
            assert conn.execute("SELECT gid FROM pg_prepared_xacts").fetchall() == [("epoch-7",)]
            assert conn.execute("SELECT x FROM t").fetchall() == []  # prepared, not committed
            conn.execute("COMMIT PREPARED 'epoch-7'")
            assert conn.execute("SELECT x FROM t").fetchall() == [(42,)]


def test_restart_keeps_data_and_disconnects_clients():
    with PostgresServer(fsync=False) as server:
        port = server.port
        held = _connect(server.dsn)
        held.execute("CREATE TABLE t (x int)")
        held.execute("INSERT INTO t VALUES (1)")
        server.restart()  # fast shutdown: does not wait for held to disconnect
        assert server.port == port
        with pytest.raises(psycopg.OperationalError):
            held.execute("SELECT 1")
        held.close()
        with _connect(server.dsn) as conn:
            assert conn.execute("SELECT x FROM t").fetchall() == [(1,)]
            assert conn.execute("SHOW fsync").fetchone()[0] == "off"


def test_prepared_transactions_disabled():
    with PostgresServer(max_prepared_transactions=0) as server:
        with _connect(server.dsn) as conn:
            assert conn.execute("SHOW max_prepared_transactions").fetchone()[0] == "0"
            conn.execute("CREATE TABLE t (x int)")
            conn.execute("BEGIN")
            conn.execute("INSERT INTO t VALUES (1)")
            with pytest.raises(psycopg.errors.ObjectNotInPrerequisiteState, match="prepared transactions are disabled"):
                conn.execute("PREPARE TRANSACTION 'g'")


def test_password_required_and_kept_out_of_repr():
    with PostgresServer(password="s3cret pass'word") as server:
        assert "s3cret" not in repr(server)
        with pytest.raises(psycopg.OperationalError, match="password"):
            psycopg.connect(f"host=127.0.0.1 port={server.port} dbname=postgres user=postgres").close()
        with _connect(server.create_database("secured")) as conn:  # the dsn carries the password
            assert conn.execute("SELECT current_user").fetchone()[0] == "postgres"


def test_missing_binaries(monkeypatch, tmp_path):
    monkeypatch.setenv("TWOPHASE_PG_BIN", str(tmp_path))
    server = PostgresServer()
    with pytest.raises(PostgresServerError, match="TWOPHASE_PG_BIN"):
        server.start()
    assert not server.running
    server.stop()


def test_bad_settings():
    with pytest.raises(ValueError, match="max_prepared_transactions"):
        PostgresServer(max_prepared_transactions=-1)
    with pytest.raises(ValueError, match="password"):
        PostgresServer(password="")
