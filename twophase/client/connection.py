"""A blocking connection to one broker: request framing, correlation ids, ApiVersions negotiation.

Requests are kio message objects of whatever version :meth:`Connection.version` picked (the highest
both sides speak within the client's range). One request is in flight per connection at a time;
callers that must not wait behind a long-polling Fetch (heartbeats) use their own connection.

Example::

    conn = Connection("127.0.0.1", 9092)
    v = conn.version(ApiKey.METADATA, 12)
    response = conn.request(message(ApiKey.METADATA, v, topics=None, allow_auto_topic_creation=False))
    conn.close()
"""

from __future__ import annotations

import datetime
import socket
import struct
import threading
from typing import Any

from kio.index import load_request_schema, load_response_schema
from kio.schema.api_versions.v0.request import ApiVersionsRequest as ApiVersionsRequestV0
from kio.schema.api_versions.v3.request import ApiVersionsRequest as ApiVersionsRequestV3
from kio.schema.errors import ErrorCode
from kio.serial import entity_reader

from twophase.wire.codec import build, encode_request, nested
from twophase.wire.errors import KafkaError

from .errors import KafkaConnectionError, check

_SIZE = struct.Struct(">i")
MAX_RESPONSE_BYTES = 1 << 30
MS = datetime.timedelta(milliseconds=1)


def message(api_key: int, version: int, **fields: Any) -> Any:
    """A request of ``api_key`` in ``version``; fields that version lacks are dropped."""
    return build(load_request_schema(api_key, version), **fields)


def part(api_key: int, version: int, class_name: str, /, **fields: Any) -> Any:
    """A nested entity (``class_name``) of the request of ``api_key`` in ``version``."""
    return build(nested(load_request_schema(api_key, version), class_name), **fields)


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
    """One TCP connection to a broker; thread-safe (requests are serialized)."""

    def __init__(self, host: str, port: int, *, client_id: str = "twophase", timeout_s: float = 30.0) -> None:
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
            self.versions = self._negotiate()
        except BaseException:
            self.close()
            raise

    def __repr__(self) -> str:
        return f"Connection({self.host}:{self.port})"

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

    def request(self, request: Any, timeout_s: float | None = None) -> Any:
        """Send ``request`` and wait for its response (decoded). Connection failures close this
        connection and raise KafkaConnectionError."""
        with self._lock:
            if self.closed:
                raise KafkaConnectionError(f"{self} is closed")
            self._correlation_id += 1
            correlation_id = self._correlation_id
            try:
                self._sock.settimeout(timeout_s or self.timeout_s)
                self._sock.sendall(encode_request(correlation_id, request, self.client_id))
                frame = read_frame(self._sock)
            except (OSError, ConnectionError) as exc:
                self.close()
                raise KafkaConnectionError(f"{self}: {type(exc).__name__}: {exc}") from None
        try:
            return decode_response(frame, request, correlation_id)
        except ConnectionError as exc:
            self.close()
            raise KafkaConnectionError(f"{self}: {exc}") from None

    def close(self) -> None:
        """Close now, also from another thread: a request blocked in recv fails at once."""
        self.closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # never connected fully, or already shut down
        self._sock.close()
