"""SASL authentication of a new connection: SaslHandshake v1, then SaslAuthenticate frames (KIP-152).

PLAIN sends one token; SCRAM-SHA-256 and SCRAM-SHA-512 (RFC 5802, by the ``scramp`` library) two,
and check the broker's proof in its last answer. Failures raise
:class:`~twophase.client.errors.SaslAuthenticationError` naming the user and the mechanism, never
the password.

Example::

    conn = Connection(host, port, security=settings)    # calls authenticate(conn, settings) itself
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kio.schema.errors import ErrorCode
from scramp import ScramClient, ScramException

from twophase.wire.api_keys import ApiKey
from twophase.wire.security import plain_message

from .errors import SaslAuthenticationError
from .messages import message
from .security import SecuritySettings

if TYPE_CHECKING:
    from .connection import Connection


def authenticate(conn: Connection, settings: SecuritySettings) -> None:
    """Authenticate ``conn`` as ``settings.sasl_username`` with ``settings.sasl_mechanism``."""
    mechanism, user = settings.sasl_mechanism, settings.sasl_username
    who = f"user {user!r} with mechanism {mechanism} at {conn.host}:{conn.port}"
    handshake_version = conn.version(ApiKey.SASL_HANDSHAKE, 1, client_min=1)
    response = conn.request(message(ApiKey.SASL_HANDSHAKE, handshake_version, mechanism=mechanism))
    if response.error_code == ErrorCode.unsupported_sasl_mechanism:
        raise SaslAuthenticationError(f"authentication failed for {who}: the broker enables "
                                      f"{', '.join(response.mechanisms) or 'no mechanism'}, not {mechanism}",
                                      ErrorCode.unsupported_sasl_mechanism)
    if response.error_code:
        raise SaslAuthenticationError(f"authentication failed for {who}: SaslHandshake answered "
                                      f"{ErrorCode(response.error_code).name.upper()}", response.error_code)
    version = conn.version(ApiKey.SASL_AUTHENTICATE, 2)

    def exchange(token: bytes) -> bytes:
        answer = conn.request(message(ApiKey.SASL_AUTHENTICATE, version, auth_bytes=token))
        if answer.error_code:
            reason = answer.error_message or ErrorCode(answer.error_code).name.upper()
            conn.close()  # the broker closes it too
            raise SaslAuthenticationError(f"authentication failed for {who}: {reason}", answer.error_code)
        return bytes(answer.auth_bytes)

    if mechanism == "PLAIN":
        exchange(plain_message(user, settings.sasl_password))
        return
    scram = ScramClient([mechanism], user, settings.sasl_password)
    try:
        scram.set_server_first(exchange(scram.get_client_first().encode()).decode())
        scram.set_server_final(exchange(scram.get_client_final().encode()).decode())
    except (ScramException, UnicodeDecodeError) as exc:  # a broker whose proof does not verify, or garbage
        conn.close()
        raise SaslAuthenticationError(f"authentication failed for {who}: the broker's SCRAM answer is not "
                                      f"acceptable: {exc}") from None
