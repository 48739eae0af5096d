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

import glob
import os
import pwd
import signal
import subprocess
import time
from pathlib import Path

import psycopg
from psycopg import sql
from psycopg.conninfo import make_conninfo

from twophase.localserver import LocalServer, LocalServerError

__all__ = ["PostgresServer", "PostgresServerError", "default_bin_dir"]

_OS_USER = "postgres"  # Debian's postgresql package creates this system user
_SUPERUSER = "postgres"
_MAX_NAME_BYTES = 63  # NAMEDATALEN - 1: PostgreSQL silently truncates longer names


class PostgresServerError(LocalServerError):
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


class PostgresServer(LocalServer):
    """A PostgreSQL server process (postmaster) bound to ``host:port``, superuser ``postgres``.

    Its cluster lives in a temp dir (``data``, the unix socket and ``postgres.log``, the
    server's output) that ``stop()`` removes; ``restart()`` and ``kill()`` + ``start()`` keep
    it. ``max_prepared_transactions`` is what PREPARE TRANSACTION needs (0 disables it).
    ``fsync=False`` is faster but loses data if the machine (not just the server) crashes.
    Host connections need no password unless ``password`` is given: then they need it
    (SCRAM), and ``dsn`` carries it.
    """

    _NAME = "postgres"
    _ERROR = PostgresServerError
    _WORK_PREFIX = "twophase-pg-"
    _LOG_NAME = "postgres.log"  # initdb's output too
    _STOP_SIGNAL = signal.SIGINT  # fast shutdown: SIGTERM would wait for every client to disconnect

    def __init__(self, port: int = 0, host: str = "127.0.0.1", max_prepared_transactions: int = 64,
                 fsync: bool = True, password: str | None = None) -> None:
        if max_prepared_transactions < 0:
            raise ValueError(f"max_prepared_transactions must be >= 0, got {max_prepared_transactions}")
        if password == "":
            raise ValueError("password must be None (no password) or non-empty")
        super().__init__(port, host)
        self.max_prepared_transactions = max_prepared_transactions
        self.fsync = fsync
        self._password = password
        self._bin_dir = Path()  # found by each start()

    @property
    def dsn(self) -> str:
        """libpq conninfo for the ``postgres`` database, e.g. ``host=127.0.0.1 port=5432 dbname=postgres user=postgres``."""
        return make_conninfo(host=self.host, port=self.port, dbname="postgres", user=_SUPERUSER,
                             password=self._password)

    @property
    def data_dir(self) -> Path:
        """The cluster's data directory (PGDATA), in the work dir (a temp dir, made on first use)."""
        return self._workdir() / "data"

    def start(self, timeout: float = 60.0) -> PostgresServer:
        """initdb on first use, start the postmaster and wait until it accepts connections
        (after crash recovery, if it was killed). No-op if running."""
        return super().start(timeout)

    def stop(self, timeout: float = 30.0) -> None:
        """Fast shutdown (clients are disconnected; SIGKILL after ``timeout``), then remove the temp dir."""
        super().stop(timeout)

    def kill(self) -> None:
        """SIGKILL the postmaster and all its backends at once, as a crash would; the cluster
        (with its prepared transactions) and the port are kept for ``start()``."""
        super().kill()

    def restart(self, timeout: float = 60.0) -> PostgresServer:
        """Fast shutdown and start on the same port with the same cluster."""
        return super().restart(timeout)

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
        new = self._work_dir is None
        work = super()._workdir()
        if new and os.geteuid() == 0:
            user = _os_user()  # the dir must be the server's: it runs as this user
            os.chown(work, user.pw_uid, user.pw_gid)
        return work

    def _prepare(self, timeout: float) -> None:
        self._bin_dir = default_bin_dir()
        if not (self.data_dir / "PG_VERSION").exists():
            self._initdb(timeout)

    def _initdb(self, timeout: float) -> None:
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
                [str(self._bin_dir / "initdb"), "-D", str(self.data_dir), "-U", _SUPERUSER, "-E", "UTF8",
                 "--no-locale", "--no-sync", *auth],
                stdin=subprocess.DEVNULL, stdout=self._log_file, stderr=subprocess.STDOUT,
                cwd=self._workdir(), timeout=timeout, **self._run_as())
        except subprocess.TimeoutExpired as e:
            raise PostgresServerError(f"initdb took over {timeout}s; " + self._tail_since_spawn()) from e
        finally:
            pwfile.unlink(missing_ok=True)
            self._close_log()
        if done.returncode != 0:
            raise PostgresServerError(f"initdb exited with {done.returncode}; " + self._tail_since_spawn())

    def _spawn(self) -> None:
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
            [str(self._bin_dir / "postgres"), "-D", str(self.data_dir),
             *(arg for key, value in settings.items() for arg in ("-c", f"{key}={value}"))],
            stdin=subprocess.DEVNULL, stdout=self._log_file, stderr=subprocess.STDOUT,
            cwd=self._workdir(),
            # Own session: a Ctrl-C meant for the driver must not reach the server first.
            start_new_session=True, **self._run_as(),
        )

    def _serving(self) -> bool:
        # A connection succeeds only once crash recovery is over ("the database system is starting up").
        try:
            psycopg.connect(self.dsn, connect_timeout=2).close()
            return True
        except psycopg.OperationalError:
            return False

    def _retry(self, error: str) -> bool:
        # A killed server's backends may still be exiting: they hold its shared memory.
        return "is still in use" in error

    def _kill_process(self, proc: subprocess.Popen[bytes]) -> None:
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


def _os_user() -> pwd.struct_passwd:
    try:
        return pwd.getpwnam(_OS_USER)
    except KeyError:
        raise PostgresServerError(
            f"running as root needs the {_OS_USER!r} system user for the server (initdb and postgres "
            "refuse root); Debian's postgresql package creates it (scripts/bootstrap.sh)") from None


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
