"""A private, throw-away PostgreSQL server for tests, the demo and examples.

Runs the PostgreSQL server binaries (Debian: ``apt-get install postgresql``) on
127.0.0.1 and a free port, with a fresh ``initdb`` cluster in a temp dir and no
systemd, service or shared state. When this process is root (which initdb and
postgres refuse to be) the server runs as the ``postgres`` system user::

    import psycopg
    from twophase.pgserver import PostgresServer

    with PostgresServer() as server:                  # free port, temp cluster
        dsn = server.create_database("orders")       # a libpq conninfo string
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("CREATE TABLE t (x int)")
            conn.execute("BEGIN")
            conn.execute("INSERT INTO t VALUES (1)")
            conn.execute("PREPARE TRANSACTION 'epoch-1'")
        server.kill()                                 # SIGKILL, e.g. for chaos tests
        server.start()                                # crash recovery; 'epoch-1' is still prepared

The binaries are the newest ``/usr/lib/postgresql/*/bin``; set ``TWOPHASE_PG_BIN``
to use another install.
"""

from __future__ import annotations

import atexit
import glob
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

import psycopg
from psycopg import sql
from psycopg.conninfo import make_conninfo

from twophase.zkserver import free_port

__all__ = ["PostgresServer", "PostgresServerError", "default_bin_dir"]

_OS_USER = "postgres"  # Debian's postgresql package creates this system user
_SUPERUSER = "postgres"
_MAX_NAME_BYTES = 63  # NAMEDATALEN - 1: PostgreSQL silently truncates longer names
_LIVE: set[PostgresServer] = set()  # started and not yet stop()ped


class PostgresServerError(RuntimeError):
    """The server could not be set up or started (or died while starting)."""


def default_bin_dir() -> Path:
    """``TWOPHASE_PG_BIN`` if set, else the newest ``/usr/lib/postgresql/<version>/bin`` with an initdb."""
    override = os.environ.get("TWOPHASE_PG_BIN")
    if override:
        where = Path(override)
        if not all((where / tool).is_file() for tool in ("initdb", "postgres")):
            raise PostgresServerError(f"TWOPHASE_PG_BIN={override!r} has no initdb and postgres binaries")
        return where
    found = glob.glob("/usr/lib/postgresql/*/bin/initdb")
    if not found:
        raise PostgresServerError(
            "no PostgreSQL server binaries (/usr/lib/postgresql/*/bin/initdb); "
            "run scripts/bootstrap.sh (installs Debian's postgresql) or set TWOPHASE_PG_BIN")

    def version(initdb: str) -> tuple[int, ...]:
        name = Path(initdb).parent.parent.name  # "15", "9.6"
        return tuple(int(p) for p in name.split(".") if p.isdigit())

    return Path(max(found, key=version)).parent


class PostgresServer:
    """A PostgreSQL server process (postmaster) bound to ``host:port``, superuser ``postgres``.

    Its cluster lives in a temp dir (``data``, the unix socket and ``postgres.log``, the
    server's output) that ``stop()`` removes; ``restart()`` and ``kill()`` + ``start()`` keep
    it. ``max_prepared_transactions`` is what PREPARE TRANSACTION needs (0 disables it).
    ``fsync=False`` is faster but loses data if the machine (not just the server) crashes.
    Host connections need no password unless ``password`` is given: then they need it
    (SCRAM), and ``dsn`` carries it.
    """

    def __init__(self, port: int = 0, host: str = "127.0.0.1", max_prepared_transactions: int = 64,
                 fsync: bool = True, password: str | None = None) -> None:
        if max_prepared_transactions < 0:
            raise ValueError(f"max_prepared_transactions must be >= 0, got {max_prepared_transactions}")
        if password == "":
            raise ValueError("password must be None (no password) or non-empty")
        self.host = host
        self.port = port
        self.max_prepared_transactions = max_prepared_transactions
        self.fsync = fsync
        self._password = password
        self._auto_port = port == 0
        self._work_dir: Path | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_file = None
        self._log_start = 0  # where the current postmaster's output starts in the log

    # -- properties ---------------------------------------------------------
    @property
    def dsn(self) -> str:
        """libpq conninfo for the ``postgres`` database, e.g. ``host=127.0.0.1 port=5432 dbname=postgres user=postgres``."""
        return make_conninfo(host=self.host, port=self.port, dbname="postgres", user=_SUPERUSER,
                             password=self._password)

    @property
    def running(self) -> bool:
        """Whether the postmaster is alive."""
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        """The postmaster's process id while it runs, else None."""
        return self._proc.pid if self.running else None

    @property
    def data_dir(self) -> Path:
        """The cluster's data directory (PGDATA), in the work dir (a temp dir, made on first use)."""
        return self._workdir() / "data"

    @property
    def log_path(self) -> Path:
        """The output of initdb and the server, in the work dir."""
        return self._workdir() / "postgres.log"

    # -- lifecycle ----------------------------------------------------------
    def start(self, timeout: float = 60.0) -> PostgresServer:
        """initdb on first use, start the postmaster and wait until it accepts connections
        (after crash recovery, if it was killed). No-op if running."""
        if self.running:
            return self
        deadline = time.monotonic() + timeout
        bin_dir = default_bin_dir()
        if self.port == 0:
            self.port = free_port(self.host)
        if not (self.data_dir / "PG_VERSION").exists():
            self._initdb(bin_dir, timeout)
        new_ports = 0
        while True:
            try:
                self._spawn(bin_dir)
                self._wait_ready(deadline)
                break
            except PostgresServerError as e:
                self._terminate(signal.SIGKILL)
                # A killed server's backends may still be exiting (they hold its shared memory).
                if "is still in use" in str(e) and time.monotonic() < deadline:
                    time.sleep(0.05)
                    continue
                # An auto-picked port can be taken by someone else before the postmaster binds it.
                if self._auto_port and new_ports < 2 and "Address already in use" in str(e):
                    new_ports += 1
                    self.port = free_port(self.host)
                    continue
                raise
        _LIVE.add(self)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Fast shutdown (clients are disconnected; SIGKILL after ``timeout``), then remove the temp dir."""
        self._terminate(signal.SIGINT, timeout)
        _LIVE.discard(self)
        if self._work_dir is not None:
            shutil.rmtree(self._work_dir, ignore_errors=True)
            self._work_dir = None
            if self._auto_port:
                self.port = 0

    def kill(self) -> None:
        """SIGKILL the postmaster and all its backends at once, as a crash would; the cluster
        (with its prepared transactions) and the port are kept for ``start()``."""
        self._terminate(signal.SIGKILL)

    def restart(self, timeout: float = 60.0) -> PostgresServer:
        """Fast shutdown and start on the same port with the same cluster."""
        self._terminate(signal.SIGINT, timeout)
        return self.start(timeout)

    def create_database(self, name: str) -> str:
        """Create database ``name`` and return the conninfo string (``dsn``) for it."""
        if not name or len(name.encode()) > _MAX_NAME_BYTES:
            raise ValueError(f"database name must be 1 to {_MAX_NAME_BYTES} bytes, got {name!r}")
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        return make_conninfo(self.dsn, dbname=name)

    def drop_database(self, name: str) -> None:
        """Roll back the database's prepared transactions (they would block the drop), then drop
        it, disconnecting its clients."""
        with psycopg.connect(make_conninfo(self.dsn, dbname=name), autocommit=True) as conn:
            # ROLLBACK PREPARED works only from the database the transaction was prepared in.
            gids = conn.execute("SELECT gid FROM pg_prepared_xacts WHERE database = current_database()").fetchall()
            for (gid,) in gids:
                conn.execute(sql.SQL("ROLLBACK PREPARED {}").format(sql.Literal(gid)))
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE {} WITH (FORCE)").format(sql.Identifier(name)))

    def log_tail(self, lines: int = 40) -> str:
        """The last ``lines`` lines of the log, or ``<no log>`` if it cannot be read."""
        return self._tail(0, lines)

    def __enter__(self) -> PostgresServer:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None,
                 exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()

    def __repr__(self) -> str:  # no dsn: it may carry the password
        return f"PostgresServer(host={self.host!r}, port={self.port}, pid={self.pid})"

    # -- internals ----------------------------------------------------------
    def _run_as(self) -> dict:
        """Popen arguments that drop root to the ``postgres`` user (initdb and postgres refuse root)."""
        if os.geteuid() != 0:
            return {}
        user = _os_user()
        return {"user": user.pw_uid, "group": user.pw_gid, "extra_groups": []}

    def _workdir(self) -> Path:
        if self._work_dir is None:
            work = Path(tempfile.mkdtemp(prefix="twophase-pg-"))
            if os.geteuid() == 0:
                user = _os_user()
                os.chown(work, user.pw_uid, user.pw_gid)
            self._work_dir = work
        return self._work_dir

    def _open_log(self) -> None:
        if self._log_file is None:
            self._log_file = open(self.log_path, "ab")
        self._log_start = self._log_file.tell()

    def _tail(self, start: int, lines: int = 40) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(start)
                text = f.read().decode(errors="replace")
        except OSError:
            return "<no log>"
        return "\n".join(text.splitlines()[-lines:])

    def _initdb(self, bin_dir: Path, timeout: float) -> None:
        auth = ["--auth-local=trust", "--auth-host=trust"]
        pwfile = self._workdir() / "pwfile"
        if self._password is not None:
            pwfile.write_text(self._password + "\n")
            pwfile.chmod(0o600)
            if os.geteuid() == 0:
                user = _os_user()
                os.chown(pwfile, user.pw_uid, user.pw_gid)
            auth = ["--auth-local=trust", "--auth-host=scram-sha-256", f"--pwfile={pwfile}"]
        self._open_log()
        try:
            # --no-sync: a throw-away cluster need not survive the machine crashing during initdb.
            done = subprocess.run(
                [str(bin_dir / "initdb"), "-D", str(self.data_dir), "-U", _SUPERUSER, "-E", "UTF8",
                 "--no-locale", "--no-sync", *auth],
                stdin=subprocess.DEVNULL, stdout=self._log_file, stderr=subprocess.STDOUT,
                cwd=self._workdir(), timeout=timeout, **self._run_as())
        except subprocess.TimeoutExpired as e:
            raise PostgresServerError(f"initdb took over {timeout}s; log {self.log_path}:\n"
                                      f"{self._tail(self._log_start)}") from e
        finally:
            pwfile.unlink(missing_ok=True)
            self._close_log()
        if done.returncode != 0:
            raise PostgresServerError(f"initdb exited with {done.returncode}; log {self.log_path}:\n"
                                      f"{self._tail(self._log_start)}")

    def _spawn(self, bin_dir: Path) -> None:
        settings = {
            "listen_addresses": self.host,
            "port": self.port,
            "unix_socket_directories": self._workdir(),  # not /var/run/postgresql: private to us
            "max_prepared_transactions": self.max_prepared_transactions,
            "fsync": "on" if self.fsync else "off",
            "shared_buffers": "16MB",
        }
        self._open_log()
        self._proc = subprocess.Popen(
            [str(bin_dir / "postgres"), "-D", str(self.data_dir),
             *(arg for key, value in settings.items() for arg in ("-c", f"{key}={value}"))],
            stdin=subprocess.DEVNULL, stdout=self._log_file, stderr=subprocess.STDOUT,
            cwd=self._workdir(),
            # Own session: a Ctrl-C meant for the driver must not reach the server first.
            start_new_session=True, **self._run_as(),
        )

    def _wait_ready(self, deadline: float) -> None:
        # A connection succeeds only once crash recovery is over ("the database system is starting up").
        while True:
            assert self._proc is not None
            if self._proc.poll() is not None:
                raise PostgresServerError(
                    f"postgres on {self.host}:{self.port} exited with {self._proc.returncode} while starting; "
                    f"log {self.log_path}:\n{self._tail(self._log_start)}")
            try:
                psycopg.connect(self.dsn, connect_timeout=2).close()
                return
            except psycopg.OperationalError:
                pass
            if time.monotonic() > deadline:
                raise PostgresServerError(
                    f"postgres on {self.host}:{self.port} not accepting connections in time; "
                    f"log {self.log_path}:\n{self._tail(self._log_start)}")
            time.sleep(0.05)

    def _terminate(self, sig: int, timeout: float = 30.0) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            if sig == signal.SIGKILL:
                _kill_server(proc)
            else:
                proc.send_signal(sig)
                try:
                    proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    _kill_server(proc)
        self._close_log()

    def _close_log(self) -> None:
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None


def _os_user() -> pwd.struct_passwd:
    try:
        return pwd.getpwnam(_OS_USER)
    except KeyError:
        raise PostgresServerError(
            f"running as root needs the {_OS_USER!r} system user for the server (initdb and postgres "
            "refuse root); Debian's postgresql package creates it (scripts/bootstrap.sh)") from None


def _kill_server(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL the postmaster and its children. Each child is a session leader of its own
    (postgres calls setsid), so no process-group signal reaches them; the postmaster is frozen
    first so that it forks no new child while they are collected."""
    os.kill(proc.pid, signal.SIGSTOP)
    for _ in range(1000):  # SIGSTOP lands asynchronously, e.g. after a fork in progress
        if _proc_stat(proc.pid)[0] in (b"T", b"Z", b""):
            break
        time.sleep(0.001)
    for child in _children(proc.pid):
        try:
            os.kill(child, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.kill()
    proc.wait()


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid``, from /proc."""
    return [int(entry) for entry in os.listdir("/proc")
            if entry.isdigit() and _proc_stat(int(entry))[1] == pid]


def _proc_stat(pid: int) -> tuple[bytes, int]:
    """(state, parent pid) of a process from /proc/<pid>/stat; (b"", 0) if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return b"", 0
    # The command name (second field) may hold spaces and ')': the rest follows its last ')'.
    state, ppid = stat.rsplit(b")", 1)[1].split()[:2]
    return state, int(ppid)


@atexit.register
def _kill_leftovers() -> None:
    # start_new_session means nobody else stops these servers when Python exits.
    for server in list(_LIVE):
        server.stop(timeout=5.0)
