"""What the private, throw-away servers for tests and the demo share (ZooKeeper in
twophase/zkserver.py, PostgreSQL in twophase/pgserver.py): one server process on
``host:port``, its files in a temp dir, started, stopped and killed as a crash would.

A subclass names its files and error and implements ``_spawn`` and ``_serving``::

    class EchoServer(LocalServer):
        _NAME, _WORK_PREFIX, _LOG_NAME, _ERROR = "echo", "echo-", "echo.log", EchoServerError

        def _spawn(self) -> None:
            self._open_log()
            self._proc = subprocess.Popen([...], stdout=self._log_file, start_new_session=True)

        def _serving(self) -> bool:
            ...  # whether a request succeeds now
"""

from __future__ import annotations

import atexit
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import Self

__all__ = ["LocalServer", "LocalServerError", "free_port"]

_LIVE: set[LocalServer] = set()  # started and not yet stop()ped


class LocalServerError(RuntimeError):
    """The server could not be started (or died while starting)."""


def free_port(host: str = "127.0.0.1") -> int:
    """A port that is free on host right now (for servers that must know theirs up front)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class LocalServer:
    """A server process bound to ``host:port`` (``port=0``: a free one), with a temp work dir that
    ``stop()`` removes; ``restart()`` and ``kill()`` + ``start()`` keep it and the port."""

    _NAME = "server"  # for errors
    _ERROR: type[LocalServerError] = LocalServerError  # what start() raises
    _WORK_PREFIX = "twophase-"  # of the temp work dir
    _LOG_NAME = "server.log"  # the server's stdout/stderr, in the work dir
    _STOP_SIGNAL = signal.SIGTERM  # graceful shutdown

    def __init__(self, port: int = 0, host: str = "127.0.0.1") -> None:
        self.host = host
        self.port = port
        self._auto_port = port == 0
        self._work_dir: Path | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_file = None
        self._log_start = 0  # where the current process's output starts in the log

    @property
    def running(self) -> bool:
        """Whether the server process is alive."""
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        """The server's process id while it runs, else None."""
        return self._proc.pid if self.running else None

    @property
    def log_path(self) -> Path:
        """The server's stdout/stderr log file, in the work dir (a temp dir, made on first use)."""
        return self._workdir() / self._LOG_NAME

    def start(self, timeout: float = 30.0) -> Self:
        """Start the server and wait until it serves requests. No-op if running."""
        if self.running:
            return self
        deadline = time.monotonic() + timeout
        self._prepare(timeout)
        if self.port == 0:
            self.port = free_port(self.host)
        new_ports = 0
        while True:
            try:
                self._spawn()
                self._wait_ready(deadline)
                break
            except LocalServerError as e:
                self._terminate(signal.SIGKILL)
                if self._retry(str(e)) and time.monotonic() < deadline:
                    time.sleep(0.05)
                    continue
                # An auto-picked port can be taken by someone else before the server binds it.
                if self._auto_port and new_ports < 2 and "Address already in use" in str(e):
                    new_ports += 1
                    self.port = free_port(self.host)
                    continue
                raise
        _LIVE.add(self)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Graceful shutdown (SIGKILL after ``timeout``), then remove the temp dir."""
        self._terminate(self._STOP_SIGNAL, timeout)
        _LIVE.discard(self)
        if self._work_dir is not None:
            shutil.rmtree(self._work_dir, ignore_errors=True)
            self._work_dir = None
            if self._auto_port:
                self.port = 0

    def kill(self) -> None:
        """SIGKILL the server, as a crash would; its data and port are kept."""
        self._terminate(signal.SIGKILL)

    def restart(self, timeout: float = 30.0) -> Self:
        """Graceful shutdown and start on the same port with the same data."""
        self._terminate(self._STOP_SIGNAL, timeout)
        return self.start(timeout)

    def log_tail(self, lines: int = 40) -> str:
        """The last ``lines`` lines of the server's log, or ``<no log>`` if it cannot be read."""
        return self._tail(0, lines)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None,
                 exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()

    # -- for subclasses -----------------------------------------------------
    def _prepare(self, timeout: float) -> None:
        """Before the first spawn of each start(): check tools, create data."""

    def _spawn(self) -> None:
        """Start the server process as ``self._proc`` (after ``_open_log()``)."""
        raise NotImplementedError

    def _serving(self) -> bool:
        """Whether the server serves requests now (it may be up but still loading its data)."""
        raise NotImplementedError

    def _retry(self, error: str) -> bool:
        """Whether a failed start is worth retrying on the same port (until the deadline)."""
        return False

    def _kill_process(self, proc: subprocess.Popen[bytes]) -> None:
        """SIGKILL the server (and whatever must die with it) and reap it."""
        proc.kill()
        proc.wait()

    def _workdir(self) -> Path:
        if self._work_dir is None:
            self._work_dir = Path(tempfile.mkdtemp(prefix=self._WORK_PREFIX))
        return self._work_dir

    def _open_log(self) -> None:
        if self._log_file is None:
            self._log_file = open(self.log_path, "ab")
        self._log_start = self._log_file.tell()

    def _close_log(self) -> None:
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def _wait_ready(self, deadline: float) -> None:
        while True:
            assert self._proc is not None
            if self._proc.poll() is not None:
                raise self._ERROR(f"{self._NAME} on {self.host}:{self.port} exited with {self._proc.returncode} "
                                  "while starting; " + self._tail_since_spawn())
            if self._serving():
                return
            if time.monotonic() > deadline:
                raise self._ERROR(f"{self._NAME} on {self.host}:{self.port} not serving in time; "
                                  + self._tail_since_spawn())
            time.sleep(0.05)

    def _tail_since_spawn(self) -> str:
        """The log since the last ``_open_log()``, for errors: an older run's lines would mislead."""
        return f"log {self.log_path}:\n{self._tail(self._log_start)}"

    def _tail(self, start: int, lines: int = 40) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(start)
                text = f.read().decode(errors="replace")
        except OSError:
            return "<no log>"
        return "\n".join(text.splitlines()[-lines:])

    def _terminate(self, sig: int, timeout: float = 10.0) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            if sig == signal.SIGKILL:
                self._kill_process(proc)
            else:
                proc.send_signal(sig)
                try:
                    proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    self._kill_process(proc)
        self._close_log()


@atexit.register
def _kill_leftovers() -> None:
    # Servers run in sessions of their own (start_new_session): nobody else stops them when Python exits.
    for server in list(_LIVE):
        server.stop(timeout=5.0)
