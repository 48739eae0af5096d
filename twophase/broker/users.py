"""The broker's users file: SCRAM credentials per user, salted as Kafka stores them, never a password.

For each user and each of SCRAM-SHA-256 and SCRAM-SHA-512: a random salt, the iteration count
(at least 4096), StoredKey and ServerKey (RFC 5802; made by the ``scramp`` library), base64 in JSON::

    {"users": {"alice": {"SCRAM-SHA-256": {"salt": "...", "iterations": 4096,
                                           "stored_key": "...", "server_key": "..."},
                         "SCRAM-SHA-512": {...}}}}

PLAIN logins are checked against the same credentials (:func:`verify_password`). The broker reads
the file again when it changes, so a user added or removed counts from the next login on, without
a restart.

Example::

    add_user("users.json", "alice", "secret")           # or: twophase broker-users add --users-file ...
    users = UsersFile("users.json")
    users.credential("alice", "SCRAM-SHA-256")          # ScramCredential(salt=..., iterations=4096, ...)
    verify_password(users.credential("alice", "SCRAM-SHA-256"), "secret")   # True
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import hmac
import json
import logging
import os

from scramp import ScramMechanism

from twophase.durable import atomic_write
from twophase.wire.security import SCRAM_MECHANISMS

log = logging.getLogger("twophase.broker")

MIN_ITERATIONS = 4096  # Kafka's and RFC 7677's minimum
MIN_SALT_BYTES = 12  # what scramp accepts
MAX_ITERATIONS = 1_000_000  # PLAIN logins derive a key on the event loop: bound what one login costs


@dataclasses.dataclass(frozen=True)
class ScramCredential:
    """One user's credential for one SCRAM mechanism (what Kafka stores; no password)."""

    salt: bytes
    iterations: int
    stored_key: bytes
    server_key: bytes
    mechanism: str = "SCRAM-SHA-256"

    def auth_info(self) -> tuple[bytes, bytes, bytes, int]:
        """What scramp's server asks for: (salt, stored key, server key, iterations)."""
        return self.salt, self.stored_key, self.server_key, self.iterations

    def to_json(self) -> dict:
        return {"salt": _b64(self.salt), "iterations": self.iterations,
                "stored_key": _b64(self.stored_key), "server_key": _b64(self.server_key)}

    @classmethod
    def from_json(cls, value, mechanism: str) -> ScramCredential:
        """ValueError for anything but what :meth:`to_json` writes."""
        if not isinstance(value, dict) or set(value) != {"salt", "iterations", "stored_key", "server_key"}:
            raise ValueError("a credential has salt, iterations, stored_key and server_key")
        iterations = value["iterations"]
        if isinstance(iterations, bool) or not isinstance(iterations, int) or not (
                MIN_ITERATIONS <= iterations <= MAX_ITERATIONS):
            raise ValueError(f"iterations must be between {MIN_ITERATIONS} and {MAX_ITERATIONS}, not {iterations!r}")
        try:
            salt, stored_key, server_key = (base64.b64decode(value[k], validate=True)
                                            for k in ("salt", "stored_key", "server_key"))
        except (binascii.Error, TypeError) as exc:
            raise ValueError(f"a credential's salt and keys are base64: {exc}") from None
        if len(salt) < MIN_SALT_BYTES:
            raise ValueError(f"a salt has at least {MIN_SALT_BYTES} bytes")
        return cls(salt, iterations, stored_key, server_key, mechanism)


def make_credential(password: str, mechanism: str, iterations: int = MIN_ITERATIONS,
                    salt: bytes | None = None) -> ScramCredential:
    """A new credential for ``password`` (a random salt unless given)."""
    if not MIN_ITERATIONS <= iterations <= MAX_ITERATIONS:
        raise ValueError(f"iterations must be between {MIN_ITERATIONS} and {MAX_ITERATIONS}, not {iterations}")
    salt, stored_key, server_key, iterations = ScramMechanism(mechanism).make_auth_info(password, iterations, salt)
    return ScramCredential(salt, iterations, stored_key, server_key, mechanism)


def verify_password(credential: ScramCredential, password: str) -> bool:
    """Whether ``password`` derives ``credential``'s StoredKey with its salt and iterations (compared in
    constant time): how a PLAIN login is checked without storing the password."""
    derived = make_credential(password, credential.mechanism, credential.iterations, credential.salt)
    return hmac.compare_digest(derived.stored_key, credential.stored_key)


def read_users(path: str) -> dict[str, dict[str, ScramCredential]]:
    """User -> mechanism -> credential from the file at ``path``; ValueError naming the file for a
    missing, unreadable or malformed one."""
    try:
        with open(path, "rb") as f:
            data = json.loads(f.read())
    except FileNotFoundError:
        raise ValueError(f"users file {path}: no such file (add users with: twophase broker-users add "
                         f"--users-file {path} NAME)") from None
    except OSError as exc:
        raise ValueError(f"users file {path}: {exc.strerror or exc}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"users file {path}: not JSON: {exc}") from None
    if not isinstance(data, dict) or not isinstance(data.get("users"), dict):
        raise ValueError(f'users file {path}: expected {{"users": {{NAME: {{MECHANISM: credential}}}}}}')
    users = {}
    for name, credentials in data["users"].items():
        if not name or not isinstance(credentials, dict) or not set(credentials) <= set(SCRAM_MECHANISMS):
            raise ValueError(f"users file {path}: user {name!r}: expected credentials for "
                             f"{' and '.join(SCRAM_MECHANISMS)}")
        try:
            users[name] = {m: ScramCredential.from_json(c, m) for m, c in credentials.items()}
        except ValueError as exc:
            raise ValueError(f"users file {path}: user {name!r}: {exc}") from None
    return users


def write_users(path: str, users: dict[str, dict[str, ScramCredential]]) -> None:
    """Replace the file at ``path`` atomically (readable by its owner only)."""
    data = {"users": {name: {m: c.to_json() for m, c in sorted(creds.items())} for name, creds in sorted(users.items())}}
    old_umask = os.umask(0o077)  # the temporary file is created 0600 too, never readable by others
    try:
        atomic_write(path, (json.dumps(data, indent=2) + "\n").encode())
    finally:
        os.umask(old_umask)


def add_user(path: str, name: str, password: str, iterations: int = MIN_ITERATIONS) -> bool:
    """Add ``name`` to the users file (created if missing) or give it a new password, with a
    credential per SCRAM mechanism; True if the user is new."""
    if not name or name != name.strip() or any(c in name for c in ",=\0"):
        raise ValueError(f"a user name must be non-empty, without surrounding spaces, ',', '=' or NUL: {name!r}")
    if not password:
        raise ValueError("the password must not be empty")
    users = read_users(path) if os.path.exists(path) else {}
    new = name not in users
    users[name] = {m: make_credential(password, m, iterations) for m in SCRAM_MECHANISMS}
    write_users(path, users)
    return new


def remove_user(path: str, name: str) -> None:
    """Remove ``name`` from the users file; ValueError if it is not there."""
    users = read_users(path)
    if users.pop(name, None) is None:
        raise ValueError(f"users file {path}: no user {name!r}")
    write_users(path, users)


class UsersFile:
    """The users file as the broker reads it: loaded at start (ValueError if it is bad), read again when
    it changes; a change that does not parse is logged and the users before it stay.

    Example::

        users = UsersFile("/etc/twophase/users.json")
        credential = users.credential("alice", "SCRAM-SHA-512")     # None: no such user
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._stamp = self._stat()
        self._users = read_users(path)

    def __len__(self) -> int:
        return len(self._users)

    def credential(self, name: str, mechanism: str) -> ScramCredential | None:
        """``name``'s credential for ``mechanism`` (the file read again first if it changed)."""
        self._refresh()
        return self._users.get(name, {}).get(mechanism)

    def _stat(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return st.st_mtime_ns, st.st_size, st.st_ino

    def _refresh(self) -> None:
        stamp = self._stat()
        if stamp == self._stamp:
            return
        self._stamp = stamp
        try:
            self._users = read_users(self.path)
        except ValueError as exc:
            log.warning("%s; the %d users read before stay in use", exc, len(self._users))
            return
        log.info("users file %s read again: %d users", self.path, len(self._users))


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()
