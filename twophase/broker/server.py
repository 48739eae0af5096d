"""The asyncio TCP server: Kafka request framing and the per-connection request loop.

Each request is a 4-byte big-endian size followed by that many bytes. The size is checked
before anything is buffered: a frame shorter than a request header or longer than
``max_request_bytes`` closes the connection. Responses go out in request order. A connection's
requests are handled one at a time (Kafka mutes a connection while one of its requests is in
flight), except that consecutive Produce requests are handled together, so that a client's
in-flight batches share an fsync; they are appended in arrival order (but for one that first
auto-creates its topic: later ones to that topic are answered LEADER_NOT_AVAILABLE, and retried,
until it is created). A parked Fetch holds back later requests of its own connection only. A
request that closes the connection is decoded before it is handled, so nothing after it is handled
at all.

Resource limits (Kafka's names where Kafka has one): a connection with no request for
``connections.max.idle.ms`` is closed (a request still being handled keeps it open); request
bytes are read only as far as a byte budget shared by all connections
(``queued.max.request.bytes``) lets them: a large request reserves its bytes step by step as
they arrive, not up front, so a client that announces a large request and sends nothing holds
at most one step, and a burst of large requests slows clients down through TCP flow control
instead of growing the broker's memory without bound. ApiVersions and Metadata requests that
fit in the read-ahead are never queued for the budget, so a new client always gets started. A request
whose next step of bytes (up to ``RECEIVE_STEP_BYTES``, 1 MiB) has not arrived within
``request_receive_timeout_ms`` (a progress timeout: each step gets it anew, so a large request on a
slow link arrives; time spent waiting for the budget not counted), or a response the client does not
read for that long, closes the connection.

What happens to bad input:

- garbage, truncated or over-long frames, bodies that do not match their schema, unknown API
  keys, unsupported versions (other than ApiVersions): the connection is closed and the reason
  logged at INFO; nothing else is affected;
- an ApiVersions request in a version we do not speak: the v0 UNSUPPORTED_VERSION answer;
- an exception inside a handler: logged with its traceback, the connection is closed.

Security (twophase.broker.security): with an ``ssl_context`` the listener is TLS; with an
``authenticator`` it is SASL: each connection has a SASL session, a request other than ApiVersions,
SaslHandshake and SaslAuthenticate before it is authenticated closes the connection (logged at
INFO with the peer), and so does a failed authentication, once its answer is written.

Example::

    server = KafkaServer(dispatch, "127.0.0.1", 0)
    port = await server.start()
    ...
    await server.close()
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import mmap
import ssl
import struct
from collections.abc import Awaitable, Callable

from twophase.wire.api_keys import ApiKey
from twophase.wire.codec import DecodeFailed, decode_request, encode_response, peek_header

from .apis import api_versions
from .protocol import API_BY_KEY, Request
from .security import Authenticator

log = logging.getLogger("twophase.broker")

MIB = 1024 * 1024
DEFAULT_MAX_REQUEST_BYTES = 100 * MIB  # Kafka's socket.request.max.bytes
DEFAULT_MAX_QUEUED_REQUEST_BYTES = 2 * DEFAULT_MAX_REQUEST_BYTES
DEFAULT_IDLE_TIMEOUT_MS = 600_000  # Kafka's connections.max.idle.ms
DEFAULT_RECEIVE_TIMEOUT_MS = 30_000  # a request's bytes must all arrive within this
# Bytes a connection reads ahead of the request it is on; larger requests are received into a
# buffer of their own (counted in the request byte budget). Memory stays near the budget plus
# this per connection.
READ_AHEAD_BYTES = 64 * 1024
# A large request reserves budget for this many more bytes at a time, as they arrive.
RECEIVE_STEP_BYTES = 1024 * 1024
# A response is handed to the transport this many bytes at a time (its buffer holds no more).
WRITE_STEP_BYTES = 1024 * 1024
MIN_REQUEST_BYTES = 10  # api key, version, correlation id, client id length
# Produce requests a connection handles at once: a client's in-flight batches share an fsync.
PIPELINED_PRODUCE = 5
_PIPELINED_APIS = frozenset({ApiKey.PRODUCE})
# Small requests of these APIs never wait for the request byte budget: every client starts with them.
_NEVER_QUEUED = frozenset({ApiKey.API_VERSIONS, ApiKey.METADATA})
_SIZE = struct.Struct(">i")
_API_KEY = struct.Struct(">h")


class CloseConnection(Exception):
    """The request cannot be answered; the connection is closed (the message says why)."""


class _Connection(asyncio.BufferedProtocol):
    """One client connection. Bytes are received straight into their final buffer: a request
    larger than the read-ahead buffer gets a buffer of its own size that the socket fills
    directly (one copy, instead of the four a StreamReader makes: receive, buffer, slice,
    bytes), but only as far as the request loop allows (``fill``): the part of the request it
    reserved budget for. The buffer is made once the request's first step is reserved. A request of
    at most one step (``RECEIVE_STEP_BYTES``; reserved whole unless the budget is smaller) gets heap
    memory, which the allocator hands out again request after request (and may keep after a burst);
    a larger one gets an anonymous mapping, so the pages of bytes that have not arrived cost no
    memory (but a fresh mapping costs a page fault per 4 KiB written: about 1 ms per MiB here, as
    much as the rest of a Produce request's handling). The read-ahead buffer holds at most
    ``READ_AHEAD_BYTES``; when it is full, reading pauses until the request loop consumes it, so a
    connection waiting for request bytes buffers no more than that.

    ``gone`` is done once the client closed or reset the connection, so a parked Fetch of a
    client that went away ends at once instead of at max_wait.
    """

    def __init__(self, server: KafkaServer, loop: asyncio.AbstractEventLoop) -> None:
        self._server = server
        self._loop = loop
        self.transport: asyncio.Transport | None = None
        self.task: asyncio.Task | None = None
        self.peer = ""
        self.last_active = loop.time()  # when the last request was answered (or the connection made)
        self.busy = 0  # requests being handled or waiting for the request byte budget
        self.handling = 0  # requests dispatched and not yet answered
        self.answered = asyncio.Event()  # set while ``handling`` is 0
        self.answered.set()
        self.close_reason: str | None = None
        self.sasl = None  # the SASL session on a SASL listener (set with the transport)
        self.gone: asyncio.Future = loop.create_future()
        self.closed: asyncio.Future = loop.create_future()
        self._ahead = bytearray(READ_AHEAD_BYTES)
        self._view = memoryview(self._ahead)
        self._start = self._end = 0  # unread bytes: _ahead[_start:_end]
        self._frame: bytearray | mmap.mmap | None = None  # a large request being received in place
        self._filled = 0
        self._limit = 0  # bytes of the frame the socket may fill so far
        # When the step of the request being read must have arrived, while the client is the one
        # awaited (None otherwise).
        self.receive_deadline: float | None = None
        self._wanted = 0  # unread bytes the request loop waits for (read-ahead mode)
        self._waiter: asyncio.Future | None = None
        self._eof = False
        self._reading_paused = False
        self._drained: asyncio.Future | None = None  # set while the transport's write buffer is full

    # -- asyncio protocol callbacks --

    def connection_made(self, transport) -> None:
        self.transport = transport
        address = transport.get_extra_info("peername")
        self.peer = f"{address[0]}:{address[1]}" if isinstance(address, tuple) else str(address)
        if self._server.authenticator is not None:
            self.sasl = self._server.authenticator.session(self.peer)
        self._server._connections.add(self)
        self.task = self._loop.create_task(self._server._serve(self))

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._frame is not None:
            return memoryview(self._frame)[self._filled:self._limit]
        return self._view[self._end:]

    def buffer_updated(self, nbytes: int) -> None:
        if self._frame is not None:
            self._filled += nbytes
            if self._filled == len(self._frame):
                self._frame = None  # complete: whatever follows goes to the read-ahead
                self._wake()
            elif self._filled == self._limit:
                self._pause_reading()  # until the request loop reserved budget for more
                self._wake()
            return
        self._end += nbytes
        if self._wanted and self._end - self._start >= self._wanted:
            self._wake()
        if self._end == len(self._ahead):
            self._pause_reading()  # read-ahead full: the request loop has to catch up first

    def eof_received(self) -> bool:
        self._eof = True  # Kafka has no half-closed connections: the client is gone
        self._mark_gone()
        self._wake()
        # Answers to requests already read may still be written; over TLS the transport closes anyway
        # (and asyncio warns if asked to keep it open).
        return self.transport.get_extra_info("sslcontext") is None

    def connection_lost(self, exc: Exception | None) -> None:
        self._eof = True
        self._mark_gone()
        self._wake()
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)
        if not self.closed.done():
            self.closed.set_result(None)

    def pause_writing(self) -> None:
        self._drained = self._loop.create_future()

    def resume_writing(self) -> None:
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)
        self._drained = None

    # -- used by the request loop --

    def start_frame(self, n: int) -> bytearray | mmap.mmap:
        """Begin receiving a request of ``n`` bytes, more than the read-ahead holds, in place: the
        bytes read ahead move into its buffer; ``fill`` lets the socket add more."""
        available = self._end - self._start
        frame = self._frame = bytearray(n) if n <= RECEIVE_STEP_BYTES else mmap.mmap(-1, n)
        frame[:available] = self._view[self._start:self._end]
        self._filled = self._limit = available
        self._start = self._end = 0
        self._pause_reading()  # the socket may fill nothing of it before ``fill`` says how much
        return frame

    async def fill(self, frame: bytearray | mmap.mmap, limit: int) -> int:
        """Let the socket fill ``frame`` (from ``start_frame``) up to byte ``limit``; wait until it
        has, and return how many bytes it holds. Raises ``asyncio.IncompleteReadError`` if the client
        goes away first."""
        self._limit = limit
        if self._frame is frame and self._filled < limit:
            self._resume_reading()
            await self._wait(lambda: self._frame is not frame or self._filled >= limit)
        if self._filled < limit:
            self._frame = None
            raise asyncio.IncompleteReadError(b"", len(frame))  # the partial bytes are of no use
        return self._filled

    async def read(self, n: int) -> bytes:
        """Exactly ``n`` bytes, at most the read-ahead's size (larger requests: ``start_frame``).
        Raises ``asyncio.IncompleteReadError`` if the client goes away first."""
        available = self._end - self._start
        if available >= n:
            return self._take(n)
        if self._start + n > len(self._ahead):  # make room at the end of the read-ahead
            self._ahead[:available] = bytes(self._view[self._start:self._end])  # overlapping: copy first
            self._start, self._end = 0, available
        self._wanted = n
        self._resume_reading()
        try:
            await self._wait(lambda: self._end - self._start >= n)
        finally:
            self._wanted = 0
        if self._end - self._start < n:
            raise asyncio.IncompleteReadError(bytes(self._view[self._start:self._end]), n)
        return self._take(n)

    async def write(self, data: bytes | memoryview) -> None:
        """Send ``data``; waits while the client is not reading fast enough. Handed to the transport
        a step at a time, so a large response is not copied whole into its buffer. Raises
        TimeoutError if the client reads nothing for the receive timeout."""
        view = memoryview(data)
        for start in range(0, len(view), WRITE_STEP_BYTES):
            self.transport.write(view[start:start + WRITE_STEP_BYTES])
            if self._drained is not None:
                try:
                    await asyncio.wait_for(asyncio.shield(self._drained), self._server.receive_timeout)
                except TimeoutError:
                    reason = f"client read nothing of its response for {self._server.receive_timeout * 1000:.0f} ms"
                    log.warning("closing connection from %s: %s", self.peer, reason)
                    raise TimeoutError(reason) from None
                if self.transport.is_closing():
                    raise ConnectionResetError("connection lost while writing")

    def _take(self, n: int) -> bytes:
        data = bytes(self._view[self._start:self._start + n])
        self._start += n
        if self._start == self._end:
            self._start = self._end = 0
            self._resume_reading()
        return data

    async def _wait(self, done: Callable[[], bool]) -> None:
        while not done() and not self._eof:
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _pause_reading(self) -> None:
        if not self._reading_paused and not self.transport.is_closing():
            self._reading_paused = True
            self.transport.pause_reading()

    def _resume_reading(self) -> None:
        if self._reading_paused:
            self._reading_paused = False
            if not self.transport.is_closing():
                self.transport.resume_reading()

    def _mark_gone(self) -> None:
        if not self.gone.done():
            self.gone.set_result(None)


class Dispatcher:
    """Turns one request frame into one response frame (or None) using the API registry:
    ``decode`` (synchronous, so the request loop knows at once whether to close), then ``handle``."""

    def __init__(self, broker) -> None:
        self.broker = broker

    def decode(self, frame: bytes | memoryview, peer: str, gone: asyncio.Future | None = None,
               sasl=None) -> Request | memoryview:
        """The request in ``frame``, or its response if it needs no handler; CloseConnection if it is not
        valid, or not allowed before the connection's SASL session (``sasl``) is authenticated."""
        try:
            api_key, version, correlation_id = peek_header(frame)
        except DecodeFailed as exc:
            raise CloseConnection(str(exc)) from None
        api = API_BY_KEY.get(api_key)
        if api is None:
            raise CloseConnection(f"unknown API key {api_key} (version {version})")
        if not api.supports(version):
            if api_key == ApiKey.API_VERSIONS:
                return encode_response(correlation_id, api_versions.unsupported_version_response())
            raise CloseConnection(f"{api.name} v{version} is not supported "
                                  f"(v{api.min_version}-v{api.max_version} are)")
        if sasl is not None and not sasl.permits(api_key):
            raise CloseConnection(f"{api.name} before SASL authentication (only ApiVersions, SaslHandshake and "
                                  "SaslAuthenticate are served until then)")
        try:
            header, body = decode_request(frame, api.request_type(version))
        except DecodeFailed as exc:
            raise CloseConnection(f"malformed {api.name} v{version} request: {exc}") from None
        return Request(api, version, correlation_id, header.client_id, body, peer, gone, sasl)

    async def handle(self, decoded: Request | memoryview) -> memoryview | None:
        """The response frame for what ``decode`` returned (None when no response is due)."""
        if not isinstance(decoded, Request):
            return decoded
        response = await decoded.api.handler.handle(self.broker, decoded)
        return None if response is None else encode_response(decoded.correlation_id, response)


class _Waiter(collections.namedtuple("_Waiter", "size fut holding order")):
    """A wait for ``size`` bytes by a taker that holds ``holding`` bytes already (its ``order``:
    lower is older)."""


class ByteBudget:
    """A pool of bytes shared by every connection (for requests, Kafka's queued.max.request.bytes).

    A connection takes a request's bytes from the pool before it reads them (a large request a
    step at a time, as they arrive) and gives them back once the request has been handled. While
    the pool is short, waiting connections read nothing more, so their clients are held back by
    TCP flow control; requests are granted in arrival order and none is dropped. A single take
    larger than the whole pool waits until the pool is full and then takes all of it.

    Takers that receive in steps could each hold part of the pool and all wait for more, with
    nobody left to give any back. When every byte held is held by a waiting taker, the oldest of
    them (lowest ``order``) gets its step anyway: the pool goes over by at most one request.

    Usage::

        budget = ByteBudget(200 << 20)
        held = await budget.acquire(size)         # or budget.try_acquire(size): None if short
        held += await budget.acquire(step, holding=held, order=started)
        budget.release(held)
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("the request byte budget must be at least 1 byte")
        self.capacity = capacity
        self.available = capacity
        self._waiters: collections.deque[_Waiter] = collections.deque()

    @property
    def waiting(self) -> int:
        """Requests waiting for bytes."""
        return sum(1 for w in self._waiters if not w.fut.done())

    def try_acquire(self, size: int) -> int | None:
        """Take ``size`` bytes (at most the capacity) if they are free and nobody waits; else None."""
        size = min(size, self.capacity)
        if self._waiters or size > self.available:
            return None
        self.available -= size
        return size

    async def acquire(self, size: int, *, holding: int = 0, order: int = 0) -> int:
        """Take ``size`` bytes (at most the capacity), waiting while they are not there; the amount taken.

        ``holding``: what the caller holds already for the same request (taken in earlier steps);
        ``order``: when that request started (lower is older). See the class docstring."""
        taken = self.try_acquire(size)
        if taken is not None:
            return taken
        size = min(size, self.capacity)
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(_Waiter(size, fut, holding, order))
        self._grant()  # this wait may be the one that leaves every holder waiting
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release(size)  # granted just before the cancellation arrived
            else:
                self._grant()  # a smaller request behind this one may fit now
            raise
        return size

    def take(self, size: int) -> None:
        """Take ``size`` bytes at once, even beyond what is available (what was read already, say a
        Fetch response's first batch, which goes out whole); give them back with release()."""
        self.available -= size

    def release(self, size: int) -> None:
        """Give back ``size`` bytes (what acquire() returned) and wake the waiters that now fit."""
        self.available += size
        self._grant()

    def _grant(self) -> None:
        while self._waiters:
            size, fut, _, _ = self._waiters[0]
            if fut.done():  # its connection was closed while waiting
                self._waiters.popleft()
            elif size <= self.available:
                self._waiters.popleft()
                self.available -= size
                fut.set_result(None)
            else:
                break
        live = [w for w in self._waiters if not w.fut.done()]
        held_by_waiters = sum(w.holding for w in live)
        if held_by_waiters and held_by_waiters >= self.capacity - self.available:
            # Nobody but the waiters holds anything, so nobody would give back: the oldest goes on.
            oldest = min((w for w in live if w.holding), key=lambda w: w.order)
            self._waiters.remove(oldest)
            self.available -= oldest.size
            oldest.fut.set_result(None)


class KafkaServer:
    """Accepts connections and runs one request loop per connection.

    Settings not passed here are taken from the broker configuration when ``dispatch`` is the
    broker's :class:`Dispatcher`, else Kafka's defaults apply:

    - ``idle_timeout_ms`` (connections.max.idle.ms, 10 min): a connection with no request for
      that long is closed; a request being handled (a parked Fetch, a JoinGroup waiting for the
      other members) keeps it busy, not idle;
    - ``max_queued_request_bytes`` (queued.max.request.bytes): see :class:`ByteBudget`;
    - ``receive_timeout_ms`` (30 s): the time each step of a request's bytes (1 MiB, or the whole
      of a smaller request) has to arrive once its size is read (waits for the byte budget not
      counted), and the longest a client may read nothing of a response it is sent; past it the
      connection is closed.
    """

    def __init__(self, dispatch: Dispatcher, host: str = "127.0.0.1",
                 port: int = 0, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, *,
                 idle_timeout_ms: int = DEFAULT_IDLE_TIMEOUT_MS,
                 max_queued_request_bytes: int = DEFAULT_MAX_QUEUED_REQUEST_BYTES,
                 receive_timeout_ms: int = DEFAULT_RECEIVE_TIMEOUT_MS, ssl_context: ssl.SSLContext | None = None,
                 authenticator: Authenticator | None = None) -> None:
        if max_request_bytes < MIN_REQUEST_BYTES:
            raise ValueError(f"max_request_bytes must be at least {MIN_REQUEST_BYTES}")
        if idle_timeout_ms <= 0:
            raise ValueError(f"idle_timeout_ms must be positive, not {idle_timeout_ms}")
        if receive_timeout_ms <= 0:
            raise ValueError(f"receive_timeout_ms must be positive, not {receive_timeout_ms}")
        self.dispatch = dispatch
        self.host = host
        self.port = port
        self.max_request_bytes = max_request_bytes
        self.idle_timeout = idle_timeout_ms / 1000
        self.receive_timeout = receive_timeout_ms / 1000
        self.budget = ByteBudget(max_queued_request_bytes)
        self.ssl_context = ssl_context
        self.authenticator = authenticator
        self._requests_started = 0  # orders the requests received in steps (ByteBudget)
        self._server: asyncio.base_events.Server | None = None
        self._connections: set[_Connection] = set()
        self._idle_sweeper: asyncio.Task | None = None

    @property
    def connection_count(self) -> int:
        """How many connections are open."""
        return len(self._connections)

    async def start(self) -> int:
        """Bind and listen; returns the bound port (useful with port 0)."""
        loop = asyncio.get_running_loop()

        # A TLS handshake that has not finished within the receive timeout is given up (a client that
        # connects and sends nothing holds no more than that).
        tls = {"ssl": self.ssl_context, "ssl_handshake_timeout": self.receive_timeout} if self.ssl_context else {}
        self._server = await loop.create_server(lambda: _Connection(self, loop), self.host, self.port, **tls)
        self.port = self._server.sockets[0].getsockname()[1]
        self._idle_sweeper = asyncio.create_task(self._close_idle_connections())
        return self.port

    async def close(self) -> None:
        """Stop accepting, close every connection (parked requests are cancelled), wait for them."""
        if self._server is not None:
            self._server.close()
        if self._idle_sweeper is not None:
            self._idle_sweeper.cancel()
            await asyncio.gather(self._idle_sweeper, return_exceptions=True)
            self._idle_sweeper = None
        tasks = [conn.task for conn in self._connections]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        for conn in list(self._connections):  # cancelled before their request loop started
            conn.transport.close()
        self._connections.clear()
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None

    async def _close_idle_connections(self) -> None:
        # Checking every quarter of a timeout (at most every 5 s) closes a connection within 1.25 x
        # the timeout and costs the request path nothing but a clock read.
        interval = min(self.idle_timeout / 4, self.receive_timeout / 4, 5.0)
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(interval)
            now = loop.time()
            cutoff = now - self.idle_timeout
            for conn in list(self._connections):
                if conn.close_reason is not None:
                    continue
                if conn.receive_deadline is not None and now >= conn.receive_deadline:
                    conn.close_reason = (f"the next step of a request (up to 1 MiB) not received within "
                                         f"{self.receive_timeout * 1000:.0f} ms (the client stopped sending it, "
                                         f"or sends too slowly)")
                    log.warning("closing connection from %s: %s", conn.peer, conn.close_reason)
                    conn.task.cancel()
                elif not conn.busy and conn.last_active < cutoff:
                    conn.close_reason = f"idle for more than {self.idle_timeout * 1000:.0f} ms"
                    log.info("closing connection from %s: %s", conn.peer, conn.close_reason)
                    conn.task.cancel()

    async def _serve(self, conn: _Connection) -> None:
        log.debug("connection from %s", conn.peer)
        reason = "closed by client"
        try:
            reason = await self._request_loop(conn)
        except asyncio.CancelledError:
            reason = conn.close_reason or "broker shutting down"
        except (ConnectionError, TimeoutError) as exc:
            reason = f"connection error: {exc}"
        except Exception:
            log.exception("request from %s failed; closing its connection", conn.peer)
            reason = "internal error"
        finally:
            self._connections.discard(conn)
            conn.transport.close()
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await asyncio.wait_for(asyncio.shield(conn.closed), 1.0)
            log.debug("connection from %s closed: %s", conn.peer, reason)

    async def _request_loop(self, conn: _Connection) -> str:
        """Read, handle and answer requests until the connection ends; returns why it ended.

        The next request is received while the current one is handled. Produce requests in a row are
        also handled concurrently (up to ``PIPELINED_PRODUCE``), so that a client's in-flight batches
        share one fsync; they are appended in arrival order (each handler appends before it first
        waits) and answered in that order. Any other request waits until those are answered, and is
        handled alone, as Kafka does.
        """
        clock = asyncio.get_running_loop().time
        # Handling, in order: the task, its request bytes, what to call once it is answered.
        pipeline: collections.deque[tuple[asyncio.Task, int, list]] = collections.deque()
        next_request: asyncio.Future = asyncio.ensure_future(self._read_request(conn))

        def start(request: Request | memoryview) -> Awaitable[memoryview | None]:
            conn.busy += 1
            conn.handling += 1
            conn.answered.clear()
            return self.dispatch.handle(request)

        async def answer(handling: Awaitable[memoryview | None], held: int, after: list[Callable[[], None]]) -> None:
            try:
                try:
                    response = await handling
                finally:
                    conn.busy -= 1
                    conn.handling -= 1
                    if not conn.handling:
                        conn.answered.set()
                    self.budget.release(held)
                conn.last_active = clock()
                if response is not None and not conn.transport.is_closing():  # nobody to answer once it is gone
                    await conn.write(response)
            finally:
                for done in after:
                    done()

        async def answer_head() -> None:
            await answer(*pipeline.popleft())

        try:
            while True:
                if pipeline and (pipeline[0][0].done() or len(pipeline) == PIPELINED_PRODUCE):
                    await answer_head()
                    continue
                if pipeline and not next_request.done():
                    await asyncio.wait((pipeline[0][0], next_request), return_when=asyncio.FIRST_COMPLETED)
                    continue
                got = await next_request
                if isinstance(got, str):
                    while pipeline:  # answer what came before, in order
                        await answer_head()
                    return got
                frame, held = got
                del got
                try:
                    request = self.dispatch.decode(frame, conn.peer, conn.gone, conn.sasl)
                except CloseConnection:
                    self.budget.release(held)
                    while pipeline:  # answer what came before; nothing after it is handled
                        await answer_head()
                    raise
                del frame  # only its handling holds the request, and only while it is handled
                pipelined = isinstance(request, Request) and request.api.key in _PIPELINED_APIS
                after = request.after_answer if isinstance(request, Request) else []
                while pipeline and not pipelined:  # answer what came before, in order
                    await answer_head()
                next_request = asyncio.ensure_future(self._read_request(conn))
                if pipelined:
                    pipeline.append((asyncio.ensure_future(start(request)), held, after))
                else:
                    await answer(start(request), held, after)
                    if conn.sasl is not None and conn.sasl.failed:
                        return "SASL authentication failed"
                del request
        except CloseConnection as exc:
            log.info("closing connection from %s: %s", conn.peer, exc)
            return str(exc)
        finally:
            for task, held, after in pipeline:
                task.cancel()
                self.budget.release(held)
                for done in after:
                    done()
            if not next_request.done():
                next_request.cancel()
            elif not next_request.cancelled() and isinstance(next_request.result(), tuple):
                self.budget.release(next_request.result()[1])  # received, never handled

    async def _read_request(self, conn: _Connection) -> tuple[bytes | memoryview, int] | str:
        """The next request frame and the request bytes it holds in the budget, or why the connection ends."""
        try:
            prefix = await conn.read(4)
        except asyncio.IncompleteReadError as exc:
            return "closed by client" if not exc.partial else "closed mid size prefix"
        (size,) = _SIZE.unpack(prefix)
        if not MIN_REQUEST_BYTES <= size <= self.max_request_bytes:
            log.info("closing connection from %s: request size %d outside [%d, %d]",
                     conn.peer, size, MIN_REQUEST_BYTES, self.max_request_bytes)
            return f"bad request size {size}"
        held = 0
        try:
            if size <= READ_AHEAD_BYTES:
                # Read first: its bytes fit in the read-ahead, whose memory the connection holds anyway.
                frame = await self._receive(conn, conn.read(size))
                if _API_KEY.unpack_from(frame)[0] in _NEVER_QUEUED:
                    held = size  # a new client must always get started, however full the budget
                    self.budget.take(size)
                else:
                    held = await self._reserve(conn, size)
                return frame, held
            # Reserved step by step as the bytes arrive: announcing a large request holds no more than a step.
            self._requests_started += 1
            order = self._requests_started
            frame = None
            filled = 0
            while filled < size:
                held += await self._reserve(conn, min(RECEIVE_STEP_BYTES, size - held), held, order)
                if frame is None:  # made once its first step is reserved: a heap buffer's memory is held at once
                    frame = conn.start_frame(size)
                filled = await self._receive(conn, conn.fill(frame, held))
            return memoryview(frame).toreadonly(), held
        except asyncio.IncompleteReadError:
            log.info("closing connection from %s: truncated request (%d bytes announced)", conn.peer, size)
            self.budget.release(held)
            return "truncated request"
        except BaseException:
            self.budget.release(held)
            raise

    async def _reserve(self, conn: _Connection, size: int, holding: int = 0, order: int = 0) -> int:
        """Take up to ``size`` bytes from the budget for ``conn``'s request being read; the amount taken."""
        # While this connection's own requests are handled, take bytes only if they are free: queued
        # behind others, this request could wait for its own connection's parked Fetch, and
        # everyone queued behind it with it.
        while conn.handling:
            held = self.budget.try_acquire(size)
            if held is not None:
                return held
            await conn.answered.wait()
        conn.busy += 1  # waiting for the byte budget is the broker's doing, not idleness
        try:
            return await self.budget.acquire(size, holding=holding, order=order)
        finally:
            conn.busy -= 1

    async def _receive(self, conn: _Connection, reading: Awaitable):
        """Await ``reading`` (one step of request bytes from the client) under the receive timeout:
        a progress timeout, so each step has the whole of it."""
        conn.receive_deadline = asyncio.get_running_loop().time() + self.receive_timeout
        try:
            return await reading
        finally:
            conn.receive_deadline = None
