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

import atexit
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

__all__ = ["ZooKeeperServer", "ZooKeeperServerError", "default_classpath"]

# zookeeper.jar's manifest Class-Path pulls in netty, slf4j-api, jute etc.;
# slf4j-simple is added only so the server log is not empty (NOP logger).
_DEBIAN_CLASSPATH = (
    "/etc/zookeeper/conf",
    "/usr/share/java/zookeeper.jar",
    "/usr/share/java/slf4j-simple.jar",
)
_MAIN_CLASS = "org.apache.zookeeper.server.ZooKeeperServerMain"
_LIVE: set[ZooKeeperServer] = set()  # started and not yet stop()ped


class ZooKeeperServerError(RuntimeError):
    """The server could not be started (or died while starting)."""


def default_classpath() -> str:
    """``TWOPHASE_ZK_CLASSPATH`` if set, else Debian's jars that exist."""
    override = os.environ.get("TWOPHASE_ZK_CLASSPATH")
    if override:
        return override
    return os.pathsep.join(p for p in _DEBIAN_CLASSPATH if os.path.exists(p))


def free_port(host: str = "127.0.0.1") -> int:
    """A port that is free on host right now (for servers that must know theirs up front)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ZooKeeperServer:
    """A standalone ZooKeeper server process bound to ``host:port``.

    ``data_dir=None`` keeps data in a temp dir that ``stop()`` removes;
    ``restart()`` and ``kill()`` + ``start()`` keep the data. The temp dir also
    holds ``zoo.cfg`` and ``zookeeper.log`` (the server's stdout/stderr).
    """

    def __init__(self, data_dir: str | None = None, port: int = 0,
                 host: str = "127.0.0.1", tick_ms: int = 500) -> None:
        self.host = host
        self.port = port
        self.tick_ms = tick_ms
        self._auto_port = port == 0
        self._given_data_dir = data_dir
        self._work_dir: Path | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_file = None

    # -- properties ---------------------------------------------------------
    @property
    def hosts(self) -> str:
        """Connection string for kazoo, e.g. ``"127.0.0.1:2181"``."""
        return f"{self.host}:{self.port}"

    @property
    def running(self) -> bool:
        """Whether the server process is alive."""
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        """The server's process id while it runs, else None."""
        return self._proc.pid if self.running else None

    @property
    def data_dir(self) -> Path:
        """Where the server keeps its data: the given directory, else ``data`` in the work dir."""
        return Path(self._given_data_dir) if self._given_data_dir else self._workdir() / "data"

    @property
    def log_path(self) -> Path:
        """The server's stdout/stderr log file, in the work dir (a temp dir, made on first use)."""
        return self._workdir() / "zookeeper.log"

    # -- lifecycle ----------------------------------------------------------
    def start(self, timeout: float = 30.0) -> ZooKeeperServer:
        """Start the JVM and wait until it serves requests. No-op if running."""
        if self.running:
            return self
        if self.port == 0:
            self.port = free_port(self.host)
        # An auto-picked port can be grabbed by someone else before the JVM
        # binds it; pick another one then (only before it ever served).
        for attempt in range(3):
            try:
                self._spawn()
                self._wait_ready(timeout)
                break
            except ZooKeeperServerError as e:
                self._terminate(signal.SIGKILL)
                if not (self._auto_port and attempt < 2 and "Address already in use" in str(e)):
                    raise
                self.port = free_port(self.host)
        _LIVE.add(self)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM (SIGKILL after ``timeout``), then remove the temp dir."""
        self._terminate(signal.SIGTERM, timeout)
        _LIVE.discard(self)
        if self._work_dir is not None:
            shutil.rmtree(self._work_dir, ignore_errors=True)
            self._work_dir = None
            if self._auto_port:
                self.port = 0

    def kill(self) -> None:
        """SIGKILL the server, as a crash would; data and port are kept."""
        self._terminate(signal.SIGKILL)

    def restart(self, timeout: float = 30.0) -> ZooKeeperServer:
        """Graceful stop and start on the same port with the same data."""
        self._terminate(signal.SIGTERM)
        return self.start(timeout)

    def command(self, word: str, timeout: float = 2.0) -> str:
        """Send a four-letter word (``ruok``, ``srvr``, ``mntr``...) and return the reply."""
        with socket.create_connection((self.host, self.port), timeout=timeout) as s:
            s.sendall(word.encode())
            chunks = []
            while chunk := s.recv(4096):
                chunks.append(chunk)
        return b"".join(chunks).decode(errors="replace")

    def log_tail(self, lines: int = 40) -> str:
        """The last ``lines`` lines of the server's log, or ``<no log>`` if it cannot be read."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "<no log>"

    def __enter__(self) -> ZooKeeperServer:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None,
                 exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"ZooKeeperServer(hosts={self.hosts!r}, pid={self.pid})"

    # -- internals ----------------------------------------------------------
    def _workdir(self) -> Path:
        if self._work_dir is None:
            self._work_dir = Path(tempfile.mkdtemp(prefix="twophase-zk-"))
        return self._work_dir

    def _spawn(self) -> None:
        java = shutil.which("java") or os.path.join(os.environ.get("JAVA_HOME", "/usr"), "bin", "java")
        classpath = default_classpath()
        if not os.path.exists(java) or "zookeeper" not in classpath:
            raise ZooKeeperServerError(
                f"need java and ZooKeeper's jars (java={java!r}, classpath={classpath!r}); "
                "run scripts/bootstrap.sh or set TWOPHASE_ZK_CLASSPATH")
        self.data_dir.mkdir(parents=True, exist_ok=True)
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
        self._log_file = open(self.log_path, "ab")
        self._proc = subprocess.Popen(
            [java, "-Xmx256m", "-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1",
             "-Djava.net.preferIPv4Stack=true", "-cp", classpath, _MAIN_CLASS, str(cfg)],
            stdin=subprocess.DEVNULL, stdout=self._log_file, stderr=subprocess.STDOUT,
            cwd=self._workdir(),
            # Own session: a Ctrl-C meant for the driver must not kill ZooKeeper first.
            start_new_session=True,
        )

    def _wait_ready(self, timeout: float) -> None:
        # 'ruok' answers imok before the database is loaded; 'srvr' shows a
        # Mode only once the server really serves.
        deadline = time.monotonic() + timeout
        while True:
            assert self._proc is not None
            if self._proc.poll() is not None:
                raise ZooKeeperServerError(
                    f"ZooKeeper on {self.hosts} exited with {self._proc.returncode} while starting; "
                    f"log {self.log_path}:\n{self.log_tail()}")
            try:
                if "Mode:" in self.command("srvr", timeout=1.0):
                    return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise ZooKeeperServerError(
                    f"ZooKeeper on {self.hosts} not serving after {timeout}s; "
                    f"log {self.log_path}:\n{self.log_tail()}")
            time.sleep(0.05)

    def _terminate(self, sig: int, timeout: float = 10.0) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(sig)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None


@atexit.register
def _kill_leftovers() -> None:
    # start_new_session means nobody else kills these JVMs when Python exits.
    for server in list(_LIVE):
        server.stop(timeout=2.0)
