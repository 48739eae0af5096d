"""Shared pytest fixtures: a private ZooKeeper server, kazoo clients, one SparkSession."""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Iterator

import pytest
from kazoo.client import KazooClient

from twophase.zkserver import ZooKeeperServer


@pytest.fixture(scope="session")
def zk_server() -> Iterator[ZooKeeperServer]:
    server = ZooKeeperServer().start()
    yield server
    server.stop()


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
    yield session
    from twophase.spark.driver import DriverHook

    DriverHook.close_all()
    session.stop()


# Tests sign ZooKeeper payloads with a fixed secret instead of creating ~/.config/twophase/secret.
os.environ.setdefault("TWOPHASE_SECRET", "twophase-test-secret-0123456789")
