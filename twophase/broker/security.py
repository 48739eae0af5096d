"""The listener's security: its TLS context, and SASL authentication of each connection (KIP-152).

A SASL listener gives every connection a :class:`SaslSession`. Until it is authenticated the
server accepts only ApiVersions, SaslHandshake and SaslAuthenticate on it, and closes the
connection on anything else, as Kafka does. SaslHandshake (v1) picks the mechanism;
SaslAuthenticate carries its tokens: PLAIN's one (checked against the stored SCRAM credential, see
:mod:`twophase.broker.users`), SCRAM's two (RFC 5802, by the ``scramp`` library). A failed login
is answered SASL_AUTHENTICATION_FAILED, logged at INFO with the peer and the user (never a
password), and the connection is closed after the answer.

Example::

    authenticator = Authenticator(UsersFile("users.json"), ("PLAIN", "SCRAM-SHA-256"))
    session = authenticator.session("127.0.0.1:50312")
    session.handshake("SCRAM-SHA-256")            # (error code, enabled mechanisms)
    code, message, token = session.authenticate(client_first)
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import logging
import secrets
import ssl

from kio.schema.errors import ErrorCode
from scramp import ScramException, ScramMechanism

from twophase.wire.api_keys import ApiKey
from twophase.wire.security import parse_plain

from .users import MIN_ITERATIONS, ScramCredential, UsersFile, make_credential, verify_password

log = logging.getLogger("twophase.broker")

# What a connection may send before it is authenticated.
BEFORE_AUTHENTICATION = frozenset({ApiKey.API_VERSIONS, ApiKey.SASL_HANDSHAKE, ApiKey.SASL_AUTHENTICATE})


def server_ssl_context(certificate: str, key: str | None, key_password: str | None = None) -> ssl.SSLContext:
    """The listener's TLS context (TLS 1.2 or later; no client certificates asked for). ValueError
    naming the files if they do not load."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(certificate, key, key_password)
    except (OSError, ssl.SSLError) as exc:
        reason = getattr(exc, "strerror", None) or getattr(exc, "reason", None) or exc
        raise ValueError(f"ssl_certificate {certificate!r} / ssl_key {key!r}: cannot load: {reason}") from None
    return context


class Authenticator:
    """The SASL settings of a listener: the users and the enabled mechanisms; makes each connection's
    :class:`SaslSession`."""

    def __init__(self, users: UsersFile, mechanisms: tuple[str, ...]) -> None:
        self.users = users
        self.mechanisms = mechanisms
        self._unknown_secret = secrets.token_bytes(32)

    def unknown_user(self, user: str, mechanism: str) -> ScramCredential:
        """A credential no password matches for a user that does not exist: the same salt every time
        (derived from the name), so that two tries do not tell an unknown user from a known one."""
        salt = hmac.new(self._unknown_secret, f"{mechanism}\0{user}".encode(), hashlib.sha256).digest()[:16]
        return make_credential(secrets.token_urlsafe(32), mechanism, MIN_ITERATIONS, salt)

    def session(self, peer: str) -> SaslSession:
        """A new connection's authentication state."""
        return SaslSession(self, peer)


class _State(enum.Enum):
    HANDSHAKE = "awaiting SaslHandshake"
    AUTHENTICATE = "awaiting SaslAuthenticate"
    SCRAM_FINAL = "awaiting the SCRAM client-final message"
    AUTHENTICATED = "authenticated"
    FAILED = "failed"


class SaslSession:
    """One connection's SASL exchange. ``failed`` tells the server to close the connection once the
    answer is written; ``permits`` which APIs it may serve now."""

    def __init__(self, authenticator: Authenticator, peer: str) -> None:
        self._authenticator = authenticator
        self.peer = peer
        self.mechanism: str | None = None
        self.user: str | None = None
        self._state = _State.HANDSHAKE
        self._scram = None

    @property
    def failed(self) -> bool:
        return self._state is _State.FAILED

    @property
    def authenticated(self) -> bool:
        return self._state is _State.AUTHENTICATED

    def permits(self, api_key: int) -> bool:
        """Whether a request of ``api_key`` may be served now."""
        return self.authenticated or api_key in BEFORE_AUTHENTICATION

    def handshake(self, mechanism: str) -> tuple[int, tuple[str, ...]]:
        """SaslHandshake: (error code, the enabled mechanisms). A mechanism not enabled, or a second
        handshake, fails the session."""
        enabled = self._authenticator.mechanisms
        if self._state is not _State.HANDSHAKE:
            return self._illegal(f"SaslHandshake while {self._state.value}"), enabled
        if mechanism not in enabled:
            log.info("SASL from %s: mechanism %r is not enabled (%s are); closing", self.peer, mechanism,
                     ", ".join(enabled))
            self._state = _State.FAILED
            return ErrorCode.unsupported_sasl_mechanism, enabled
        self.mechanism = mechanism
        self._state = _State.AUTHENTICATE
        return ErrorCode.none, enabled

    def authenticate(self, token: bytes) -> tuple[int, str | None, bytes]:
        """SaslAuthenticate: (error code, error message, the token to answer with)."""
        if self._state is _State.AUTHENTICATE and self.mechanism == "PLAIN":
            return self._plain(token)
        if self._state is _State.AUTHENTICATE:
            return self._scram_first(token)
        if self._state is _State.SCRAM_FINAL:
            return self._scram_final(token)
        return self._illegal(f"SaslAuthenticate while {self._state.value}"), None, b""

    def _plain(self, token: bytes) -> tuple[int, str | None, bytes]:
        try:
            self.user, password = parse_plain(token)
        except ValueError as exc:
            return self._fail(f"malformed PLAIN token: {exc}", "Authentication failed: malformed PLAIN token")
        users = self._authenticator.users
        credential = users.credential(self.user, "SCRAM-SHA-256") or users.credential(self.user, "SCRAM-SHA-512")
        if credential is None or not verify_password(credential, password):
            why = "no such user" if credential is None else "wrong password"
            return self._fail(why, "Authentication failed: Invalid username or password")
        return self._succeed(b"")

    def _scram_first(self, token: bytes) -> tuple[int, str | None, bytes]:
        mechanism = ScramMechanism(self.mechanism)
        self._scram = mechanism.make_server(self._credential)
        try:
            self._scram.set_client_first(bytes(token).decode())
            answer = self._scram.get_server_first().encode()
        except (ScramException, UnicodeDecodeError) as exc:
            return self._fail(f"bad client-first message: {exc}", self._invalid_credentials())
        self._state = _State.SCRAM_FINAL
        return ErrorCode.none, None, answer

    def _scram_final(self, token: bytes) -> tuple[int, str | None, bytes]:
        try:
            self._scram.set_client_final(bytes(token).decode())
            answer = self._scram.get_server_final().encode()
        except (ScramException, UnicodeDecodeError) as exc:
            known = self._authenticator.users.credential(self.user, self.mechanism) is not None
            return self._fail(f"{exc}" if known else "no such user", self._invalid_credentials())
        finally:
            self._scram = None
        return self._succeed(answer)

    def _credential(self, user: str) -> tuple[bytes, bytes, bytes, int]:
        """scramp's lookup of ``user``; an unknown user gets a credential no password matches, so the
        exchange fails at its end like a wrong password (the client learns nothing of who exists)."""
        self.user = user
        credential = self._authenticator.users.credential(user, self.mechanism)
        if credential is None:
            credential = self._authenticator.unknown_user(user, self.mechanism)
        return credential.auth_info()

    def _invalid_credentials(self) -> str:
        return f"Authentication failed during authentication due to invalid credentials with SASL mechanism {self.mechanism}"

    def _succeed(self, answer: bytes) -> tuple[int, str | None, bytes]:
        self._state = _State.AUTHENTICATED
        log.debug("SASL from %s: user %r authenticated with %s", self.peer, self.user, self.mechanism)
        return ErrorCode.none, None, answer

    def _fail(self, why: str, message: str) -> tuple[int, str, bytes]:
        log.info("SASL from %s: authentication of user %r with %s failed (%s); closing", self.peer, self.user,
                 self.mechanism, why)
        self._state = _State.FAILED
        return ErrorCode.sasl_authentication_failed, message, b""

    def _illegal(self, what: str) -> int:
        log.info("SASL from %s: %s; closing", self.peer, what)
        self._state = _State.FAILED
        return ErrorCode.illegal_sasl_state
