"""The asyncio TCP server: Kafka request framing and the per-connection request loop.

Each request is a 4-byte big-endian size followed by that many bytes. The size is checked
before anything is buffered: a frame shorter than a request header or longer than
``max_request_bytes`` closes the connection. Requests of one connection are handled one at a
time, so responses go out in request order (Kafka does the same: it mutes a connection while
one of its requests is in flight). A parked Fetch therefore holds back later requests of its
own connection only.

What happens to bad input:

- garbage, truncated or over-long frames, bodies that do not match their schema, unknown API
  keys, unsupported versions (other than ApiVersions): the connection is closed and the reason
  logged at INFO; nothing else is affected;
- an ApiVersions request in a version we do not speak: the v0 UNSUPPORTED_VERSION answer;
- an exception inside a handler: logged with its traceback, the connection is closed.

Example::

    server = KafkaServer(dispatch, "127.0.0.1", 0)
    port = await server.start()
    ...
    await server.close()
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
from collections.abc import Awaitable, Callable

from .apis import api_versions
from .codec import DecodeFailed, decode_request, encode_response, peek_header
from .protocol import API_BY_KEY, Request

log = logging.getLogger("twophase.broker")

MIB = 1024 * 1024
DEFAULT_MAX_REQUEST_BYTES = 100 * MIB  # Kafka's socket.request.max.bytes
MIN_REQUEST_BYTES = 10  # api key, version, correlation id, client id length
_SIZE = struct.Struct(">i")


class CloseConnection(Exception):
    """The request cannot be answered; the connection is closed (the message says why)."""


class _Protocol(asyncio.StreamReaderProtocol):
    """asyncio's stream protocol plus ``gone``: a future done once the client closed or reset the
    connection, so a parked Fetch of a client that went away ends at once instead of at max_wait."""

    def __init__(self, reader, client_connected_cb, loop) -> None:
        super().__init__(reader, client_connected_cb, loop=loop)
        self.gone: asyncio.Future = loop.create_future()

    def _mark_gone(self) -> None:
        if not self.gone.done():
            self.gone.set_result(None)

    def eof_received(self):
        self._mark_gone()  # Kafka has no half-closed connections either
        return super().eof_received()

    def connection_lost(self, exc) -> None:
        self._mark_gone()
        super().connection_lost(exc)


class Dispatcher:
    """Turns one request frame into one response frame (or None) using the API registry."""

    def __init__(self, broker) -> None:
        self.broker = broker

    async def __call__(self, frame: bytes, peer: str, gone: asyncio.Future | None = None) -> bytes | None:
        try:
            api_key, version, correlation_id = peek_header(frame)
        except DecodeFailed as exc:
            raise CloseConnection(str(exc)) from None
        api = API_BY_KEY.get(api_key)
        if api is None:
            raise CloseConnection(f"unknown API key {api_key} (version {version})")
        if not api.supports(version):
            if api_key == 18:
                return encode_response(correlation_id, api_versions.unsupported_version_response())
            raise CloseConnection(f"{api.name} v{version} is not supported "
                                  f"(v{api.min_version}-v{api.max_version} are)")
        try:
            header, body = decode_request(frame, api.request_type(version))
        except DecodeFailed as exc:
            raise CloseConnection(f"malformed {api.name} v{version} request: {exc}") from None
        request = Request(api, version, correlation_id, header.client_id, body, peer, gone)
        response = await api.handler.handle(self.broker, request)
        return None if response is None else encode_response(correlation_id, response)


class KafkaServer:
    """Accepts connections and runs one request loop per connection."""

    def __init__(self, dispatch: Callable[..., Awaitable[bytes | None]], host: str = "127.0.0.1",
                 port: int = 0, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> None:
        if max_request_bytes < MIN_REQUEST_BYTES:
            raise ValueError(f"max_request_bytes must be at least {MIN_REQUEST_BYTES}")
        self.dispatch = dispatch
        self.host = host
        self.port = port
        self.max_request_bytes = max_request_bytes
        self._server: asyncio.base_events.Server | None = None
        self._connections: set[asyncio.Task] = set()

    @property
    def connection_count(self) -> int:
        return len(self._connections)

    async def start(self) -> int:
        """Bind and listen; returns the bound port (useful with port 0)."""
        loop = asyncio.get_running_loop()

        def protocol() -> _Protocol:
            return _Protocol(asyncio.StreamReader(limit=1 * MIB, loop=loop), self._serve, loop=loop)

        self._server = await loop.create_server(protocol, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def close(self) -> None:
        """Stop accepting, close every connection (parked requests are cancelled), wait for them."""
        if self._server is not None:
            self._server.close()
        tasks = list(self._connections)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        address = writer.get_extra_info("peername")
        peer = f"{address[0]}:{address[1]}" if isinstance(address, tuple) else str(address)
        log.debug("connection from %s", peer)
        gone = writer.transport.get_protocol().gone
        reason = "closed by client"
        try:
            reason = await self._request_loop(reader, writer, peer, gone)
        except asyncio.CancelledError:
            reason = "broker shutting down"
        except (ConnectionError, TimeoutError) as exc:
            reason = f"connection error: {exc}"
        except Exception:
            log.exception("request from %s failed; closing its connection", peer)
            reason = "internal error"
        finally:
            self._connections.discard(task)
            writer.close()
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await asyncio.wait_for(writer.wait_closed(), 1.0)
            log.debug("connection from %s closed: %s", peer, reason)

    async def _request_loop(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, peer: str,
                            gone: asyncio.Future) -> str:
        while True:
            try:
                prefix = await reader.readexactly(4)
            except asyncio.IncompleteReadError as exc:
                return "closed by client" if not exc.partial else "closed mid size prefix"
            (size,) = _SIZE.unpack(prefix)
            if not MIN_REQUEST_BYTES <= size <= self.max_request_bytes:
                log.info("closing connection from %s: request size %d outside [%d, %d]",
                         peer, size, MIN_REQUEST_BYTES, self.max_request_bytes)
                return f"bad request size {size}"
            try:
                frame = await reader.readexactly(size)
            except asyncio.IncompleteReadError as exc:
                log.info("closing connection from %s: truncated request (%d of %d bytes)",
                         peer, len(exc.partial), size)
                return "truncated request"
            try:
                response = await self.dispatch(frame, peer, gone)
            except CloseConnection as exc:
                log.info("closing connection from %s: %s", peer, exc)
                return str(exc)
            if response is not None:
                writer.write(response)
                await writer.drain()
