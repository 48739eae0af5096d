"""Kafka's security protocols and SASL mechanisms, and the PLAIN message, for the client and the broker.

Example::

    protocol = security_protocol("sasl_ssl")          # "SASL_SSL" (case-insensitive)
    uses_tls(protocol), uses_sasl(protocol)           # True, True
    token = plain_message("alice", "secret")          # b"\\0alice\\0secret" (RFC 4616, no authzid)
    parse_plain(token)                                # ("alice", "secret")
"""

from __future__ import annotations

SECURITY_PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
SASL_MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512")
SCRAM_MECHANISMS = ("SCRAM-SHA-256", "SCRAM-SHA-512")


def security_protocol(value: str, setting: str = "security.protocol") -> str:
    """``value`` as one of SECURITY_PROTOCOLS (any case); ValueError naming ``setting`` otherwise."""
    upper = value.strip().upper() if isinstance(value, str) else value
    if upper not in SECURITY_PROTOCOLS:
        raise ValueError(f"{setting} must be one of {', '.join(SECURITY_PROTOCOLS)}, not {value!r}")
    return upper


def sasl_mechanism(value: str, setting: str = "sasl.mechanism") -> str:
    """``value`` as one of SASL_MECHANISMS (any case); ValueError naming ``setting`` otherwise
    (GSSAPI and OAUTHBEARER are not supported)."""
    upper = value.strip().upper() if isinstance(value, str) else value
    if upper not in SASL_MECHANISMS:
        raise ValueError(f"{setting} must be one of {', '.join(SASL_MECHANISMS)}, not {value!r}")
    return upper


def uses_tls(protocol: str) -> bool:
    """Whether connections of ``protocol`` are TLS (SSL, SASL_SSL)."""
    return protocol in ("SSL", "SASL_SSL")


def uses_sasl(protocol: str) -> bool:
    """Whether connections of ``protocol`` authenticate with SASL (SASL_PLAINTEXT, SASL_SSL)."""
    return protocol in ("SASL_PLAINTEXT", "SASL_SSL")


def plain_message(username: str, password: str) -> bytes:
    """The SASL PLAIN token (RFC 4616) Kafka clients send: empty authzid, NUL, user, NUL, password."""
    return b"\0" + username.encode() + b"\0" + password.encode()


def parse_plain(token: bytes) -> tuple[str, str]:
    """(username, password) of a PLAIN token; ValueError if it is malformed or names another authzid."""
    parts = bytes(token).split(b"\0")
    if len(parts) != 3:
        raise ValueError("a PLAIN token is authzid NUL username NUL password")
    authzid, username, password = (p.decode("utf-8") for p in parts)
    if not username or not password:
        raise ValueError("a PLAIN token needs a username and a password")
    if authzid and authzid != username:  # Kafka refuses to act for another user
        raise ValueError("a PLAIN authorization id other than the username is not supported")
    return username, password
