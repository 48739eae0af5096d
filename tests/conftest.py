"""Shared pytest fixtures: a private ZooKeeper server, kazoo clients, a private PostgreSQL server and
a fresh database per test, one SparkSession, and a check that every test gives back the descriptors
and threads it took (tests/leakcheck.py)."""

from __future__ import annotations

import os
import sys
import threading
import uuid
import warnings
from collections.abc import Iterator

import pytest
from kazoo.client import KazooClient

from tests import leakcheck
from twophase.pgserver import PostgresServer
from twophase.zkserver import ZooKeeperServer


@pytest.fixture(autouse=True)
def no_leaks(request) -> Iterator[None]:
    """Fail the test if it leaves descriptors (files, sockets, pipes...) or non-daemon threads behind.

    Autouse and function-scoped, so it is set up after any session fixture the test uses (pytest
    sets up higher scopes first: a ZooKeeper server or Spark session the test starts is in the
    "before" snapshot) and torn down after the test's own fixtures (a broker_factory's brokers are
    stopped by then). What session-lifetime objects open later is ignored through
    leakcheck.SESSION_OWNERS, registered below where those objects are made; see tests/leakcheck.py.
    """
    before_fds = leakcheck.open_descriptors()
    before_threads = set(threading.enumerate())
    yield
    if "spark" in request.fixturenames:
        _close_driver_hooks()
    fds, threads, collected = leakcheck.settle(before_fds, before_threads)
    if fds or threads:
        pytest.fail("the test left resources behind:\n" + leakcheck.describe(fds, threads), pytrace=False)
    if collected:
        warnings.warn(leakcheck.LeakWarning("only a garbage collection released what the test left: "
                                            + leakcheck.describe(collected, [])), stacklevel=1)


def _close_driver_hooks() -> None:
    """A Spark test's driver hooks (one per app and ZooKeeper root, with a ZooKeeper client and
    threads each) live until closed; every test has a root of its own, so nothing uses them after
    it: they are closed with the test, not at the end of the session."""
    driver = sys.modules.get("twophase.spark.driver")
    if driver is not None:
        driver.DriverHook.close_all()


def _kazoo_descriptors(client: KazooClient) -> list[int]:
    """The sockets a kazoo client holds (its connection and its wake-up socket pair)."""
    conn = client._connection
    socks = (getattr(conn, "_socket", None), getattr(conn, "_read_sock", None), getattr(conn, "_write_sock", None))
    return [fd for s in socks if s is not None and (fd := s.fileno()) >= 0]


def _process_zk_clients() -> list[KazooClient]:
    """ZooKeeper clients cached for the life of the process on purpose: coordinator.zk.shared_client's
    (one per ensemble, for Spark's reused Python workers)."""
    from coordinator import zk as zk_module

    return list(zk_module._shared.values())


leakcheck.SESSION_OWNERS.append(lambda: [fd for c in _process_zk_clients() for fd in _kazoo_descriptors(c)])
# Each live client may be inside select(), which holds an epoll descriptor for the call.
leakcheck.SESSION_EPOLLS.append(lambda: len(_process_zk_clients()))


def _log_file_owner(server: ZooKeeperServer | PostgresServer):
    """A session server's log file, which the first test using the server opens; reopened under a
    new number when a test restarts the server."""

    def log_file() -> list[int]:
        f = server._log_file
        return [] if f is None or f.closed else [f.fileno()]

    return log_file


@pytest.fixture(scope="session")
def zk_server() -> Iterator[ZooKeeperServer]:
    server = ZooKeeperServer().start()
    log_file = _log_file_owner(server)
    leakcheck.SESSION_OWNERS.append(log_file)
    yield server
    leakcheck.SESSION_OWNERS.remove(log_file)
    server.stop()


@pytest.fixture(scope="session")
def pg_server() -> Iterator[PostgresServer]:
    """One PostgreSQL server for the session (superuser postgres, trust auth on 127.0.0.1).
    Tests that kill, restart or reconfigure a server start their own."""
    server = PostgresServer().start()
    log_file = _log_file_owner(server)
    leakcheck.SESSION_OWNERS.append(log_file)
    yield server
    leakcheck.SESSION_OWNERS.remove(log_file)
    server.stop()


@pytest.fixture
def pg_dsn(pg_server: PostgresServer) -> Iterator[str]:
    """The conninfo string of a fresh database on the shared server, so tests never see each
    other's tables; dropped afterwards with its prepared transactions (they would use up the
    server's max_prepared_transactions)."""
    name = f"t_{uuid.uuid4().hex[:12]}"
    dsn = pg_server.create_database(name)
    yield dsn
    pg_server.drop_database(name)


@pytest.fixture
def zk_root() -> str:
    """A fresh root path per test, so tests sharing the server never collide."""
    return f"/t-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def zk(zk_server: ZooKeeperServer, zk_root: str) -> Iterator[KazooClient]:
    client = KazooClient(hosts=zk_server.hosts, timeout=10.0)
    client.start(timeout=15)
    yield client
    try:
        if client.connected:
            client.delete(zk_root, recursive=True)
    except Exception:
        pass  # a test may have restarted/killed the server; cleanup is best effort
    client.stop()
    client.close()


@pytest.fixture(scope="session")
def spark(zk_server):  # depends on zk_server so that ZooKeeper outlives the driver hooks
    # Workers must run this interpreter (the venv's), not python3 on PATH.
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    from pyspark.sql import SparkSession

    session = (
        SparkSession.builder.master("local[2,4]")  # 4 = task attempts, so retries happen
        .appName("twophase-tests")
        .config("spark.sql.shuffle.partitions", "4")
        .config("spark.ui.enabled", "false")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.driver.host", "127.0.0.1")
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("WARN")
    owner = _py4j_owner(session)
    leakcheck.SESSION_OWNERS.append(owner)
    leakcheck.SESSION_THREADS.append(_is_py4j_thread)
    yield session
    from twophase.spark.driver import DriverHook

    DriverHook.close_all()
    session.stop()
    leakcheck.SESSION_THREADS.remove(_is_py4j_thread)
    leakcheck.SESSION_OWNERS.remove(owner)


def _is_py4j_thread(thread: threading.Thread) -> bool:
    """py4j's callback server and its per-connection threads, non-daemon as PySpark configures them."""
    target = getattr(thread, "_target", None)
    owner = getattr(target, "__self__", None)
    return owner is not None and type(owner).__module__.startswith("py4j.")


def _py4j_owner(session):
    """The descriptors PySpark's driver side holds for a Spark session: the JVM's stdin pipe, and every TCP
    socket to or from the py4j gateway's port, its callback server's and the accumulator server's (py4j
    opens a connection per calling thread, the JVM one per callback and one to send accumulator updates,
    at any time during the session)."""
    context = session.sparkContext

    def ports() -> set[int]:
        gateway = context._gateway
        found = {gateway.java_parameters.port}
        callback = gateway.get_callback_server()  # started on demand (foreachBatch, listeners)
        if callback is not None:
            found.add(callback.get_listening_port())
        accumulators = getattr(context, "_accumulatorServer", None)
        if accumulators is not None:
            found.add(accumulators.server_address[1])
        return found

    def owned() -> list[int]:
        proc = getattr(context._gateway, "proc", None)  # None when the JVM was not launched by us
        stdin = proc.stdin if proc is not None else None
        fds = [] if stdin is None or stdin.closed else [stdin.fileno()]
        inodes = _tcp_inodes_on(ports())
        for fd, target in leakcheck.open_descriptors().items():
            if target.startswith("socket:[") and target[8:-1] in inodes:
                fds.append(fd)
        return fds

    return owned


def _tcp_inodes_on(ports: set[int]) -> set[str]:
    """Inodes of the TCP sockets whose local or remote port is in ``ports`` (from /proc/net/tcp*)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f)
                for line in f:
                    fields = line.split()
                    local, remote, inode = fields[1], fields[2], fields[9]
                    if int(local.rsplit(":", 1)[1], 16) in ports or int(remote.rsplit(":", 1)[1], 16) in ports:
                        inodes.add(inode)
        except OSError:
            pass
    return inodes


# Tests sign ZooKeeper payloads with a fixed secret instead of creating ~/.config/twophase/secret.
os.environ.setdefault("TWOPHASE_SECRET", "twophase-test-secret-0123456789")
