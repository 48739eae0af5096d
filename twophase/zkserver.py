"""A private, throw-away ZooKeeper server for tests and the demo.

Runs Debian's ZooKeeper (``apt-get install zookeeper``) as a standalone JVM on
127.0.0.1, with no root, systemd or shared state::

    from kazoo.client import KazooClient
    from twophase.zkserver import ZooKeeperServer

    with ZooKeeperServer() as server:          # free port, temp data dir
        zk = KazooClient(hosts=server.hosts)
        zk.start()
        zk.create("/hello", b"world")
        server.restart()                        # same port, data kept
        server.kill()                           # SIGKILL, e.g. for chaos tests
        server.start()                          # data still there

The classpath defaults to Debian's layout; set ``TWOPHASE_ZK_CLASSPATH`` to use
another ZooKeeper install.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
from pathlib import Path

from twophase.localserver import LocalServer, LocalServerError, free_port

__all__ = ["ZooKeeperServer", "ZooKeeperServerError", "default_classpath", "free_port"]

# zookeeper.jar's manifest Class-Path pulls in netty, slf4j-api, jute etc.;
# slf4j-simple is added only so the server log is not empty (NOP logger).
_DEBIAN_CLASSPATH = (
    "/etc/zookeeper/conf",
    "/usr/share/java/zookeeper.jar",
    "/usr/share/java/slf4j-simple.jar",
)
_MAIN_CLASS = "org.apache.zookeeper.server.ZooKeeperServerMain"


class ZooKeeperServerError(LocalServerError):
    """The server could not be started (or died while starting)."""


def default_classpath() -> str:
    """``TWOPHASE_ZK_CLASSPATH`` if set, else Debian's jars that exist."""
    override = os.environ.get("TWOPHASE_ZK_CLASSPATH")
    if override:
        return override
    return os.pathsep.join(p for p in _DEBIAN_CLASSPATH if os.path.exists(p))


class ZooKeeperServer(LocalServer):
    """A standalone ZooKeeper server process bound to ``host:port``.

    ``data_dir=None`` keeps data in a temp dir that ``stop()`` removes;
    ``restart()`` and ``kill()`` + ``start()`` keep the data. The temp dir also
    holds ``zoo.cfg`` and ``zookeeper.log`` (the server's stdout/stderr).
    """

    _NAME = "ZooKeeper"
    _ERROR = ZooKeeperServerError
    _WORK_PREFIX = "twophase-zk-"
    _LOG_NAME = "zookeeper.log"

    def __init__(self, data_dir: str | None = None, port: int = 0,
                 host: str = "127.0.0.1", tick_ms: int = 500) -> None:
        super().__init__(port, host)
        self.tick_ms = tick_ms
        self._given_data_dir = data_dir
        self._java = self._classpath = ""  # found by each start()

    @property
    def hosts(self) -> str:
        """Connection string for kazoo, e.g. ``"127.0.0.1:2181"``."""
        return f"{self.host}:{self.port}"

    @property
    def data_dir(self) -> Path:
        """Where the server keeps its data: the given directory, else ``data`` in the work dir."""
        return Path(self._given_data_dir) if self._given_data_dir else self._workdir() / "data"

    def command(self, word: str, timeout: float = 2.0) -> str:
        """Send a four-letter word (``ruok``, ``srvr``, ``mntr``...) and return the reply."""
        with socket.create_connection((self.host, self.port), timeout=timeout) as s:
            s.sendall(word.encode())
            chunks = []
            while chunk := s.recv(4096):
                chunks.append(chunk)
        return b"".join(chunks).decode(errors="replace")

    def __repr__(self) -> str:
        return f"ZooKeeperServer(hosts={self.hosts!r}, pid={self.pid})"

    # -- internals ----------------------------------------------------------
    def _prepare(self, timeout: float) -> None:
        self._java = shutil.which("java") or os.path.join(os.environ.get("JAVA_HOME", "/usr"), "bin", "java")
        self._classpath = default_classpath()
        if not os.path.exists(self._java) or "zookeeper" not in self._classpath:
            raise ZooKeeperServerError(
                f"need java and ZooKeeper's jars (java={self._java!r}, classpath={self._classpath!r}); "
                "run scripts/bootstrap.sh or set TWOPHASE_ZK_CLASSPATH")
        self.data_dir.mkdir(parents=True, exist_ok=True)

    def _spawn(self) -> None:
        cfg = self._workdir() / "zoo.cfg"
        cfg.write_text(
            f"tickTime={self.tick_ms}\n"
            # Short sessions make expiry tests fast; clients asking for more still get it.
            f"minSessionTimeout={2 * self.tick_ms}\n"
            "maxSessionTimeout=60000\n"
            f"dataDir={self.data_dir}\n"
            f"clientPort={self.port}\n"
            f"clientPortAddress={self.host}\n"
            "admin.enableServer=false\n"
            "4lw.commands.whitelist=*\n"
            "maxClientCnxns=0\n"
        )
        self._open_log()
        self._proc = subprocess.Popen(
            [self._java, "-Xmx256m", "-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1",
             "-Djava.net.preferIPv4Stack=true", "-cp", self._classpath, _MAIN_CLASS, str(cfg)],
            stdin=subprocess.DEVNULL, stdout=self._log_file, stderr=subprocess.STDOUT,
            cwd=self._workdir(),
            # Own session: a Ctrl-C meant for the driver must not kill ZooKeeper first.
            start_new_session=True,
        )

    def _serving(self) -> bool:
        # 'ruok' answers imok before the database is loaded; 'srvr' shows a
        # Mode only once the server really serves.
        try:
            return "Mode:" in self.command("srvr", timeout=1.0)
        except OSError:
            return False
