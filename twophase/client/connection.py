"""A blocking connection to one broker: TLS, request framing, correlation ids, ApiVersions negotiation,
SASL authentication.

Requests are kio message objects of whatever version :meth:`Connection.version` picked (the highest
both sides speak within the client's range). Callers take turns on a connection: one call's requests
(several pipelined, with :meth:`Connection.request_many`) are in flight at a time; callers that must not
wait behind a long-polling Fetch (heartbeats) use their own connection.

Example::

    conn = Connection("127.0.0.1", 9092)          # or security=load_security("file:client.properties")
    v = conn.version(ApiKey.METADATA, 12)
    response = conn.request(message(ApiKey.METADATA, v, topics=None, allow_auto_topic_creation=False))
    conn.close()
"""

from __future__ import annotations

import datetime
import socket
import ssl
import struct
import threading
from collections.abc import Callable, Iterable
from typing import Any

from kio.index import load_response_schema
from kio.schema.api_versions.v0.request import ApiVersionsRequest as ApiVersionsRequestV0
from kio.schema.api_versions.v3.request import ApiVersionsRequest as ApiVersionsRequestV3
from kio.schema.errors import ErrorCode
from kio.serial import entity_reader

from twophase.wire.codec import encode_request
from twophase.wire.errors import KafkaError

from .errors import KafkaConnectionError, SslAuthenticationError, check
from .sasl import authenticate
from .security import PLAINTEXT, SecuritySettings

_SIZE = struct.Struct(">i")
MAX_RESPONSE_BYTES = 1 << 30
MS = datetime.timedelta(milliseconds=1)
_NAME_MISMATCH = (62, 64)  # OpenSSL's X509_V_ERR_HOSTNAME_MISMATCH, X509_V_ERR_IP_ADDRESS_MISMATCH


def read_exactly(sock: socket.socket, n: int) -> memoryview:
    """``n`` bytes from ``sock``, received straight into one buffer (a read-only view, as kio wants)."""
    buf = bytearray(n)
    view = memoryview(buf)
    pos = 0
    while pos < n:
        got = sock.recv_into(view[pos:], min(n - pos, 1 << 20))
        if not got:
            raise ConnectionError("closed by the broker")
        pos += got
    return view.toreadonly()


def read_frame(sock: socket.socket) -> memoryview:
    """One response frame from ``sock``, without its size prefix."""
    (size,) = _SIZE.unpack(read_exactly(sock, 4))
    if not 0 < size <= MAX_RESPONSE_BYTES:  # e.g. not a Kafka broker at this address
        raise ConnectionError(f"response size {size} is not plausible")
    return read_exactly(sock, size)


def decode_response(frame: bytes | memoryview, request: Any, correlation_id: int) -> Any:
    """The decoded response to ``request`` in ``frame`` (without its size prefix).

    Raises ConnectionError if it does not decode or answers another correlation id.
    """
    response_type = load_response_schema(request.__api_key__, request.__version__)
    try:
        header, size = entity_reader(response_type.__header_schema__)(frame, 0)
        body, _ = entity_reader(response_type)(frame, size)
    except Exception as exc:  # kio raises assorted errors on undecodable bytes
        raise ConnectionError(f"undecodable {response_type.__name__}: {exc}") from None
    if header.correlation_id != correlation_id:
        raise ConnectionError(f"correlation id {header.correlation_id}, expected {correlation_id}")
    return body


class Connection:
    """One TCP (or TLS) connection to a broker; thread-safe (requests are serialized). With a
    ``security`` protocol of SASL it is authenticated before the constructor returns."""

    def __init__(self, host: str, port: int, *, client_id: str = "twophase", timeout_s: float = 30.0,
                 security: SecuritySettings = PLAINTEXT) -> None:
        self.host, self.port = host, port
        self.client_id = client_id
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._correlation_id = 0
        try:
            self._sock = socket.create_connection((host, port), timeout=timeout_s)
        except OSError as exc:
            raise KafkaConnectionError(f"cannot connect to {host}:{port}: {exc}") from None
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.closed = False
        try:
            if security.tls:
                self._sock = self._wrap(self._sock, security)
            self.versions = self._negotiate()
            if security.sasl:
                authenticate(self, security)
        except BaseException:
            self.close()
            raise

    def __repr__(self) -> str:
        return f"Connection({self.host}:{self.port})"

    def _wrap(self, sock: socket.socket, security: SecuritySettings) -> ssl.SSLSocket:
        """``sock`` after a TLS handshake that verified the broker's certificate (and host name)."""
        context = security.ssl_context()
        try:
            return context.wrap_socket(sock, server_hostname=self.host)
        except ssl.SSLCertVerificationError as exc:
            trusted = (f"the CA certificates in {security.ssl_ca_location}" if security.ssl_ca_location
                       else "the system's CA certificates (ssl.ca.location is not set)")
            what = ("its certificate does not name this host (ssl.endpoint.identification.algorithm=https)"
                    if exc.verify_code in _NAME_MISMATCH else "its certificate was not trusted")
            raise SslAuthenticationError(f"TLS to {self.host}:{self.port}: {what}, checked against {trusted}: "
                                         f"{exc.verify_message}") from None
        except (OSError, ssl.SSLError) as exc:  # not a TLS listener, reset mid-handshake
            raise KafkaConnectionError(f"TLS handshake with {self.host}:{self.port} failed (is it a TLS "
                                       f"listener?): {exc}") from None

    def _negotiate(self) -> dict[int, tuple[int, int]]:
        response = self.request(ApiVersionsRequestV3(client_software_name="twophase", client_software_version="1"))
        if response.error_code == ErrorCode.unsupported_version:
            response = self.request(ApiVersionsRequestV0())
        check(response.error_code, f"ApiVersions to {self}")
        return {int(a.api_key): (int(a.min_version), int(a.max_version)) for a in response.api_keys}

    def version(self, api_key: int, client_max: int, client_min: int = 0) -> int:
        """The highest version of ``api_key`` in [client_min, client_max] that the broker speaks."""
        lo, hi = self.versions.get(api_key, (0, -1))
        chosen = min(hi, client_max)
        if chosen < max(lo, client_min):
            raise KafkaError(f"{self} speaks API {api_key} versions {lo}..{hi}, the client needs "
                             f"{client_min}..{client_max}", ErrorCode.unsupported_version)
        return chosen

    def request(self, request: Any, timeout_s: float | None = None,
                while_waiting: Callable[[], None] | None = None) -> Any:
        """Send ``request`` and wait for its response (decoded): :meth:`request_many` of one."""
        return self.request_many([request], timeout_s, while_waiting)[0]

    def request_many(self, requests: Iterable[Any], timeout_s: float | None = None,
                     while_waiting: Callable[[], None] | None = None) -> list[Any]:
        """Send ``requests`` back to back, then read their responses (decoded, in order): a broker
        answers a connection's requests in the order it received them, so their round trips overlap.
        ``requests`` may be a generator: each is sent before the next is made. Connection failures
        close this connection and raise KafkaConnectionError (responses already read are lost with
        it). ``while_waiting`` runs once every request is sent, before the first response is read:
        work that overlaps the round trips. If it, or making a request after the first, raises, the
        connection closes (responses are unread) and the error propagates."""
        with self._lock:
            if self.closed:
                raise KafkaConnectionError(f"{self} is closed")
            sent: list[tuple[int, Any]] = []
            try:
                for request in requests:
                    self._correlation_id += 1
                    try:
                        self._sock.settimeout(timeout_s or self.timeout_s)
                        self._sock.sendall(encode_request(self._correlation_id, request, self.client_id))
                    except (OSError, ConnectionError) as exc:
                        raise self._lost(exc) from None
                    sent.append((self._correlation_id, request))
                if while_waiting is not None:
                    while_waiting()
            except BaseException:
                if sent:
                    self.close()  # responses are unread: no later request may take them for its own
                raise
            try:
                frames = [read_frame(self._sock) for _ in sent]
            except (OSError, ConnectionError) as exc:
                raise self._lost(exc) from None
        try:
            return [decode_response(frame, request, correlation_id)
                    for frame, (correlation_id, request) in zip(frames, sent, strict=True)]
        except ConnectionError as exc:
            self.close()
            raise KafkaConnectionError(f"{self}: {exc}") from None

    def _lost(self, exc: BaseException) -> KafkaConnectionError:
        self.close()
        return KafkaConnectionError(f"{self}: {type(exc).__name__}: {exc}")

    def close(self) -> None:
        """Close now, also from another thread: a request blocked in recv fails at once."""
        self.closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # never connected fully, or already shut down
        self._sock.close()
