"""The embeddable broker: storage, the Kafka protocol server and the state the APIs share.

Synchronous use (tests, the demo) runs the asyncio loop in a background thread::

    with Broker("/tmp/data", port=0, default_partitions=3) as broker:
        bootstrap = f"127.0.0.1:{broker.port}"
        ...

Inside a running event loop use the async API instead::

    broker = Broker("/tmp/data")
    await broker.start_async()
    ...
    await broker.stop_async()

What lives in the data directory besides the storage layer's files (``topics.json``,
one ``<topic>-<partition>/`` per partition): ``broker.json`` (cluster id, written once),
``producer-ids.json`` (the next unreserved producer id) and ``groups/`` (committed offsets,
one file per group) and ``transactions/`` (the transaction log, twophase.broker.txn). Producer
ids are reserved in blocks, so the file is rewritten once per
``PRODUCER_ID_BLOCK`` allocations and an id is never handed out twice, even after a crash.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import json
import logging
import os
import ssl
import threading
import time
import uuid
from collections.abc import Iterable
from typing import Literal

from kio.schema.errors import ErrorCode

from .groups import GroupCoordinator
from .server import DEFAULT_MAX_REQUEST_BYTES, DEFAULT_RECEIVE_TIMEOUT_MS, ByteBudget, Dispatcher, KafkaServer
from .group_commit import GroupCommit
from .security import Authenticator, server_ssl_context
from .storage import LogConfig, LogManager, MetadataFileError, TopicInfo, run_flushes
from .txn import TXN_DIR, Failpoint, TransactionCoordinator, TxnSettings, open_transactions
from .users import UsersFile
from twophase.durable import atomic_write
from twophase.wire.errors import KafkaError
from twophase.wire.security import SASL_MECHANISMS, sasl_mechanism, security_protocol, uses_sasl, uses_tls

log = logging.getLogger("twophase.broker")

BROKER_FILE = "broker.json"
PRODUCER_IDS_FILE = "producer-ids.json"
PRODUCER_ID_BLOCK = 1000
# The smallest max_request_bytes allowed: every client's first requests (ApiVersions, Metadata of many
# topics, FindCoordinator, InitProducerId, JoinGroup) fit well within it; below it no client could talk.
MIN_MAX_REQUEST_BYTES = 64 * 1024
GROUPS_DIR = "groups"  # committed offsets (twophase.broker.groups.offsets)
DEFAULT_FETCH_MAX_BYTES = 57_671_680  # Kafka's fetch.max.bytes: 55 MiB


@dataclasses.dataclass(frozen=True)
class BrokerConfig:
    """Broker settings. ``fsync``: "always" (every append) or the maximum ms between fsyncs."""

    host: str = "127.0.0.1"
    port: int = 0
    advertised_host: str | None = None  # what Metadata tells clients; default: host (127.0.0.1 for 0.0.0.0)
    node_id: int = 0
    default_partitions: int = 1
    max_partitions_per_topic: int = 1000  # CreateTopics asking for more gets INVALID_PARTITIONS
    max_partitions: int = 10_000  # all topics together; a create beyond it gets POLICY_VIOLATION
    auto_create_topics: bool = True
    fsync: Literal["always"] | int = "always"
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    log_config: LogConfig | None = None  # base topic config; its flush setting is replaced by ``fsync``
    retention_check_interval_ms: int = 300_000
    # Transactions (Kafka's transaction.max.timeout.ms, transactional.id.expiration.ms, the abort
    # check interval and transaction.two.phase.commit.enable; Kafka defaults that to false, we
    # allow 2PC because the log sink needs it).
    transaction_max_timeout_ms: int = 900_000
    transactional_id_expiration_ms: int = 7 * 24 * 3600 * 1000
    transaction_check_interval_ms: int = 10_000
    transaction_two_phase_commit: bool = True
    connections_max_idle_ms: int = 600_000  # a connection without requests for this long is closed
    queued_max_request_bytes: int = 200 * 1024 * 1024  # request bytes buffered across all connections
    # A request's bytes must all arrive within this once its size is read (else the connection is
    # closed); also the longest a client may leave a response to it unread.
    request_receive_timeout_ms: int = DEFAULT_RECEIVE_TIMEOUT_MS
    fetch_max_bytes: int = DEFAULT_FETCH_MAX_BYTES  # Kafka's fetch.max.bytes: the most one Fetch response holds
    # Record bytes of Fetch responses being read or sent at once, across all connections.
    fetch_bytes_in_flight: int = 4 * DEFAULT_FETCH_MAX_BYTES
    group_initial_rebalance_delay_ms: int = 3_000  # a new group waits this long for more members
    # The listener's security (docs/security.md): Kafka's PLAINTEXT, SSL, SASL_PLAINTEXT or SASL_SSL.
    # TLS needs the broker's certificate (PEM; its key in ssl_key, or in the same file); SASL a
    # users file (twophase.broker.users) and the mechanisms it enables.
    security_protocol: str = "PLAINTEXT"
    ssl_certificate: str | None = None
    ssl_key: str | None = None
    ssl_key_password: str | None = dataclasses.field(default=None, repr=False)
    sasl_mechanisms: tuple[str, ...] = SASL_MECHANISMS
    users_file: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ValueError(f"port must be between 0 and 65535, not {self.port!r}")
        if not isinstance(self.host, str) or not self.host.strip():  # "" would bind every interface unsaid
            raise ValueError(f"host must name an address (0.0.0.0 for every interface), not {self.host!r}")
        if self.max_request_bytes < MIN_MAX_REQUEST_BYTES:
            raise ValueError(f"max_request_bytes must be at least {MIN_MAX_REQUEST_BYTES} (64 KiB) for clients "
                             f"to talk, not {self.max_request_bytes!r}")
        if not 1 <= self.default_partitions <= self.max_partitions_per_topic:
            raise ValueError("default_partitions must be between 1 and max_partitions_per_topic")
        if self.max_partitions < self.default_partitions:
            raise ValueError(f"max_partitions ({self.max_partitions}) must be at least default_partitions "
                             f"({self.default_partitions})")
        for name in ("fetch_max_bytes", "fetch_bytes_in_flight", "request_receive_timeout_ms"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, not {getattr(self, name)!r}")
        if self.fsync != "always" and (isinstance(self.fsync, bool) or not isinstance(self.fsync, int)
                                       or self.fsync < 0):
            raise ValueError(f"fsync must be 'always' or an interval in ms, not {self.fsync!r}")
        self.transaction_settings()  # validates them
        self._check_security()

    def _check_security(self) -> None:
        protocol = security_protocol(self.security_protocol, "security_protocol")
        object.__setattr__(self, "security_protocol", protocol)  # as given, in any case
        if isinstance(self.sasl_mechanisms, str) or not self.sasl_mechanisms:
            raise ValueError(f"sasl_mechanisms must be a non-empty sequence of {', '.join(SASL_MECHANISMS)}, "
                             f"not {self.sasl_mechanisms!r}")
        mechanisms = tuple(dict.fromkeys(sasl_mechanism(m, "sasl_mechanisms") for m in self.sasl_mechanisms))
        object.__setattr__(self, "sasl_mechanisms", mechanisms)
        if uses_tls(protocol) and not self.ssl_certificate:
            raise ValueError(f"security_protocol {protocol} needs ssl_certificate (and ssl_key, unless the "
                             "certificate's file holds the key)")
        if not uses_tls(protocol) and (self.ssl_certificate or self.ssl_key or self.ssl_key_password):
            raise ValueError(f"ssl_certificate/ssl_key are set, but security_protocol {protocol} has no TLS")
        if uses_sasl(protocol) and not self.users_file:
            raise ValueError(f"security_protocol {protocol} needs users_file (add users with: twophase "
                             "broker-users add --users-file FILE NAME)")
        if not uses_sasl(protocol) and self.users_file:
            raise ValueError(f"users_file is set, but security_protocol {protocol} has no SASL")

    def listener_security(self) -> tuple[ssl.SSLContext | None, Authenticator | None]:
        """The listener's TLS context and SASL authenticator (None where the protocol has none);
        ValueError naming the file that does not load."""
        context = (server_ssl_context(self.ssl_certificate, self.ssl_key, self.ssl_key_password)
                   if uses_tls(self.security_protocol) else None)
        authenticator = (Authenticator(UsersFile(self.users_file), self.sasl_mechanisms)
                         if uses_sasl(self.security_protocol) else None)
        return context, authenticator

    def topic_defaults(self) -> LogConfig:
        """The LogConfig new topics start from: ``log_config`` with its flush setting replaced by ``fsync``."""
        return dataclasses.replace(self.log_config or LogConfig(), flush=self.fsync)

    def transaction_settings(self) -> TxnSettings:
        """The transaction coordinator's settings; raises ValueError if they are invalid."""
        return TxnSettings(self.transaction_max_timeout_ms, self.transactional_id_expiration_ms,
                           self.transaction_check_interval_ms, self.transaction_two_phase_commit)


class Broker:
    """A single-node Kafka-protocol broker over a data directory."""

    def __init__(self, data_dir: str, host: str | None = None, port: int | None = None, *,
                 config: BrokerConfig | None = None, **options) -> None:
        """``host`` (default 127.0.0.1), ``port`` (default 0: any free port) and ``options`` (any
        BrokerConfig field) override the corresponding fields of ``config``."""
        self.data_dir = os.path.abspath(data_dir)
        if host is not None:
            options["host"] = host
        if port is not None:
            options["port"] = port
        self.config = dataclasses.replace(config or BrokerConfig(), **options)
        self.cluster_id = ""
        self.logs: LogManager | None = None
        self.groups: GroupCoordinator | None = None
        self.transactions: TransactionCoordinator | None = None
        self.group_commit = GroupCommit()
        self.fetch_budget = ByteBudget(self.config.fetch_bytes_in_flight)  # see apis/fetch.py
        self._server: KafkaServer | None = None
        self._waiters: dict[tuple[str, int], set[asyncio.Future]] = {}
        self._tasks: list[asyncio.Task] = []
        self._flushing: asyncio.Future | None = None  # the periodic flush running in a worker thread
        self._next_producer_id = 0
        self._reserved_producer_ids = 0
        # Background-thread mode.
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle (async) -----------------------------------------------------------------------

    @property
    def port(self) -> int:
        """The port listened on once started (the bound one with port 0), else the configured one."""
        return self._server.port if self._server else self.config.port

    @property
    def node_id(self) -> int:
        """This broker's node id, the leader of every partition."""
        return self.config.node_id

    @property
    def advertised_host(self) -> str:
        """The host Metadata and FindCoordinator give clients (127.0.0.1 when listening on any address)."""
        if self.config.advertised_host:
            return self.config.advertised_host
        return "127.0.0.1" if self.config.host in ("", "0.0.0.0", "::") else self.config.host

    @property
    def bootstrap(self) -> str:
        """``host:port`` for clients' bootstrap.servers."""
        return f"{self.advertised_host}:{self.port}"

    async def start_async(self) -> None:
        """Start listening, then open the data directory (in the running event loop).

        Binding comes first, so a busy port or an unknown host fails before the data directory is
        touched. Everything after the bind is synchronous: the event loop serves no connection
        before storage is open.
        """
        ssl_context, authenticator = self.config.listener_security()
        server = KafkaServer(Dispatcher(self), self.config.host, self.config.port, self.config.max_request_bytes,
                             idle_timeout_ms=self.config.connections_max_idle_ms,
                             max_queued_request_bytes=self.config.queued_max_request_bytes,
                             receive_timeout_ms=self.config.request_receive_timeout_ms,
                             ssl_context=ssl_context, authenticator=authenticator)
        await server.start()
        self._server = server
        try:
            os.makedirs(self.data_dir, exist_ok=True)
            self.logs = LogManager(self.data_dir, self.config.topic_defaults(), max_partitions=self.config.max_partitions)
            self._load_broker_file()
            self._load_producer_ids()
            self.groups = GroupCoordinator(os.path.join(self.data_dir, GROUPS_DIR))
            self.transactions = TransactionCoordinator(
                os.path.join(self.data_dir, TXN_DIR), partition_log=self.logs.partition, offsets=self.groups.offsets,
                allocate_producer_id=self.allocate_producer_id, data_arrived=self.data_arrived,
                settings=self.config.transaction_settings(), failpoint=Failpoint.from_env(),
                producer_id_issued=self.producer_id_issued, group_commit=self.group_commit)
            self.transactions.recover(int(time.time() * 1000))  # before any request is served
            # Transactions partitions hold open that the coordinator will not end (torn marker, lost log).
            self.transactions.resolve_open_transactions(open_transactions(self.logs.partitions()),
                                                        int(time.time() * 1000))
        except BaseException:
            await self.stop_async()  # closes whatever was opened, and the server
            self._server = None
            raise
        self._tasks = [asyncio.create_task(self._periodic()), asyncio.create_task(self.transactions.run_periodic())]
        topics = self.logs.topics()
        log.info("broker %d listening on %s:%d (advertised %s), %s, data %s, %d topics, fsync %s, cluster %s",
                 self.node_id, self.config.host, self.port, self.bootstrap, self._listener_description(authenticator),
                 self.data_dir, len(topics), self.config.fsync, self.cluster_id)

    def _listener_description(self, authenticator: Authenticator | None) -> str:
        if authenticator is None:
            return self.config.security_protocol
        return (f"{self.config.security_protocol} ({', '.join(authenticator.mechanisms)}; "
                f"{len(authenticator.users)} users in {authenticator.users.path})")

    async def stop_async(self) -> None:
        """Close every connection, flush and close storage. Idempotent. Storage is closed (its files and
        the data directory's lock released) even if an earlier step fails."""
        try:
            for task in self._tasks:
                task.cancel()
            for task in self._tasks:
                try:
                    await task
                except (asyncio.CancelledError, Exception):
                    pass
            self._tasks = []
            if self._flushing is not None:  # the worker thread goes on after its task is cancelled
                [failed] = await asyncio.gather(self._flushing, return_exceptions=True)
                for partition_log, exc in failed if isinstance(failed, list) else ():
                    partition_log.flush_failed(exc)  # closed below without trusting what did not sync
                self._flushing = None
            if self.groups is not None:
                self.groups.close()  # answers parked JoinGroup/SyncGroup requests
            if self._server is not None:
                await self._server.close()
            self.groups = None
            if self.transactions is not None:
                transactions, self.transactions = self.transactions, None
                transactions.close()
            for waiters in self._waiters.values():
                for fut in waiters:
                    if not fut.done():
                        fut.cancel()
            self._waiters.clear()
            await self.group_commit.drain()
        finally:
            if self.logs is not None:
                logs, self.logs = self.logs, None
                logs.close()
                log.info("broker %d on port %d stopped", self.node_id, self.port)

    async def __aenter__(self) -> Broker:
        await self.start_async()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.stop_async()

    async def _periodic(self) -> None:
        next_retention = time.monotonic() + self.config.retention_check_interval_ms / 1000
        while True:
            # Every log keeps its own interval (a topic's flush.ms may differ from the broker's --fsync).
            shortest = self.logs.shortest_flush_interval_ms()
            await asyncio.sleep(1.0 if shortest is None else max(0.01, min(shortest, 1000) / 1000))
            now_ms = int(time.time() * 1000)
            try:
                if due := self.logs.flush_due(now_ms):
                    # fsync in a worker thread: produce and fetch go on meanwhile, as with Kafka's log flusher.
                    self._flushing = asyncio.ensure_future(asyncio.to_thread(run_flushes, due))
                    for partition_log, exc in await asyncio.shield(self._flushing):
                        partition_log.flush_failed(exc)
                if time.monotonic() >= next_retention:
                    next_retention = time.monotonic() + self.config.retention_check_interval_ms / 1000
                    self.logs.enforce_retention(now_ms)
            except Exception:
                log.exception("periodic flush/retention failed")

    # -- lifecycle (sync, background thread) -----------------------------------------------------

    def start(self) -> Broker:
        """Start the broker in a background thread; returns once it is listening."""
        if self._thread is not None:
            raise RuntimeError("broker already started")
        ready = threading.Event()
        failure: list[BaseException] = []
        loop = asyncio.new_event_loop()

        def run() -> None:
            asyncio.set_event_loop(loop)
            try:
                loop.run_until_complete(self.start_async())
            except BaseException as exc:  # reported to start()'s caller
                failure.append(exc)
                loop.run_until_complete(loop.shutdown_default_executor())
                loop.close()
                ready.set()
                return
            ready.set()
            try:
                loop.run_forever()
            finally:
                loop.run_until_complete(loop.shutdown_asyncgens())
                # Joins the worker threads of asyncio.to_thread (fsyncs): close() alone leaves them running.
                loop.run_until_complete(loop.shutdown_default_executor())
                loop.close()

        self._loop = loop
        self._thread = threading.Thread(target=run, name=f"twophase-broker-{id(self):x}", daemon=True)
        self._thread.start()
        ready.wait()
        if failure:
            self._thread.join()
            self._thread = self._loop = None
            raise failure[0]
        return self

    def stop(self) -> None:
        """Stop a broker started with start(). Idempotent."""
        if self._thread is None or self._loop is None:
            return
        loop = self._loop
        try:
            asyncio.run_coroutine_threadsafe(self.stop_async(), loop).result(timeout=30)
        finally:
            loop.call_soon_threadsafe(loop.stop)
            self._thread.join(timeout=30)
            self._thread = self._loop = None

    def __enter__(self) -> Broker:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def call(self, fn, *args):
        """Run ``fn(*args)`` on the broker's event loop thread and return its result (thread mode)."""
        if self._loop is None:
            return fn(*args)

        async def run():
            return fn(*args)

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(timeout=30)

    # -- persistent broker state -----------------------------------------------------------------

    def _load_broker_file(self) -> None:
        path = os.path.join(self.data_dir, BROKER_FILE)
        try:
            with open(path) as f:
                self.cluster_id = json.load(f)["cluster_id"]
            return
        except FileNotFoundError:
            pass
        self.cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).rstrip(b"=").decode()
        atomic_write(path, json.dumps({"version": 1, "cluster_id": self.cluster_id}).encode())
        log.info("new data directory %s: cluster id %s", self.data_dir, self.cluster_id)

    def _load_producer_ids(self) -> None:
        path = os.path.join(self.data_dir, PRODUCER_IDS_FILE)
        try:
            with open(path) as f:
                raw = json.load(f)
        except FileNotFoundError:
            raw = {"next_unreserved": 0}
        except (OSError, ValueError) as exc:
            raise MetadataFileError(f"{path} is unreadable ({exc}): restore it") from exc
        next_id = raw.get("next_unreserved") if isinstance(raw, dict) else None
        if isinstance(next_id, bool) or not isinstance(next_id, int) or next_id < 0:
            # Guessing could hand out an id twice: the operator restores the file or sets it above every id issued.
            raise MetadataFileError(f"{path} holds no \"next_unreserved\" integer >= 0: restore it, or write "
                                    '{"version": 1, "next_unreserved": N} with N above every producer id issued')
        self._next_producer_id = next_id
        self._reserved_producer_ids = self._next_producer_id

    def allocate_producer_id(self) -> int:
        """A producer id never handed out before by this data directory."""
        if self._next_producer_id >= self._reserved_producer_ids:
            reserved = self._next_producer_id + PRODUCER_ID_BLOCK
            atomic_write(os.path.join(self.data_dir, PRODUCER_IDS_FILE),
                         json.dumps({"version": 1, "next_unreserved": reserved}).encode())
            self._reserved_producer_ids = reserved
        producer_id = self._next_producer_id
        self._next_producer_id += 1
        return producer_id

    def producer_id_issued(self, producer_id: int) -> bool:
        """Whether ``producer_id`` may have been handed out (ids at or above the next one never were)."""
        return 0 <= producer_id < self._next_producer_id

    # -- topics and partitions (for the API handlers; event-loop thread only) ---------------------

    def topics(self) -> dict[str, TopicInfo]:
        """Every topic, by name."""
        return self.logs.topics()

    def has_topic(self, name: str) -> bool:
        """Whether ``name`` is a topic."""
        return self.logs.has_topic(name)

    def create_topic(self, name: str, partitions: int, configs: dict | None = None, *,
                     validate_only: bool = False) -> TopicInfo | None:
        """Create a topic (None with ``validate_only``); raises the KafkaError a create meets."""
        if validate_only:
            self.logs.check_new_topic(name, partitions, configs)
            return None
        return self.logs.create_topic(name, partitions, configs or None)

    async def create_topic_async(self, name: str, partitions: int, configs: dict | None = None, *,
                                 validate_only: bool = False) -> TopicInfo | None:
        """Like create_topic, but the topic's directories and files are made in a worker thread, so the
        event loop serves other requests meanwhile (a topic of many partitions takes seconds)."""
        if validate_only:
            return self.create_topic(name, partitions, configs, validate_only=True)
        logs = self.logs
        info = logs.begin_topic(name, partitions, configs or None)
        work = asyncio.ensure_future(asyncio.to_thread(logs.create_topic_files, name, info))
        try:
            opened = await asyncio.shield(work)
        except asyncio.CancelledError:
            # The request was given up (its client left, the broker stops). The thread cannot be
            # stopped, so its files are undone once it ends, even if this task is cancelled again.
            work.add_done_callback(lambda done: logs.abandon_topic(
                name, [] if done.cancelled() or done.exception() else done.result()))
            with contextlib.suppress(Exception):
                await asyncio.shield(work)
            raise
        except BaseException:
            logs.abandon_topic(name, [])
            raise
        return logs.finish_topic(name, info, opened)

    async def auto_create_topic(self, name: str) -> TopicInfo:
        """Create ``name`` with the default partition count, off the event loop (Metadata and Produce
        to a new topic); raises KafkaError. While another request creates it, LEADER_NOT_AVAILABLE:
        retriable, Kafka's answer for a topic being created (CreateTopics answers TOPIC_ALREADY_EXISTS)."""
        if self.logs.being_created(name):
            raise KafkaError(f"topic {name!r} is being created", ErrorCode.leader_not_available)
        info = await self.create_topic_async(name, self.config.default_partitions)
        log.info("auto-created topic %r with %d partitions", name, info.partitions)
        return info

    def delete_topic(self, name: str) -> None:
        """Delete the topic and the groups' offsets for it, and wake the fetches parked on it; raises KafkaError."""
        info = self.logs.topics().get(name)
        self.logs.delete_topic(name)
        self.groups.offsets.delete_topic(name)
        if info is not None:
            for p in range(info.partitions):
                self.data_arrived(name, p)  # parked fetches re-read and see the topic gone

    def partition_log(self, topic: str, partition: int):
        """The PartitionLog; raises KafkaError (UnknownTopicOrPartitionError...)."""
        return self.logs.partition(topic, partition)

    # -- long-poll wake-ups ----------------------------------------------------------------------

    def data_waiter(self, keys: Iterable[tuple[str, int]]) -> asyncio.Future:
        """A future completed by the next data_arrived() on any of ``keys``."""
        fut = asyncio.get_running_loop().create_future()
        for key in keys:
            self._waiters.setdefault(key, set()).add(fut)
        return fut

    def drop_waiter(self, keys: Iterable[tuple[str, int]], fut: asyncio.Future) -> None:
        """Unregister a future data_waiter() returned (done or not)."""
        for key in keys:
            waiters = self._waiters.get(key)
            if waiters is not None:
                waiters.discard(fut)
                if not waiters:
                    del self._waiters[key]

    def data_arrived(self, topic: str, partition: int) -> None:
        """Wake the fetches parked on this partition. Event-loop thread only."""
        waiters = self._waiters.pop((topic, partition), None)
        if waiters:
            for fut in waiters:
                if not fut.done():
                    fut.set_result(None)

