"""Cluster view: bootstrap, connections per broker, topic metadata, partition leaders, coordinators.

Example::

    cluster = Cluster("127.0.0.1:9092")
    partitions = cluster.partitions("topic", create=True)     # auto-creates where the broker allows it
    conn = cluster.leader_connection("topic", 0)
    txn_conn = cluster.coordinator("my-txn-id", CoordinatorType.TRANSACTION)
    cluster.close()
"""

from __future__ import annotations

import enum
import threading

from kio.schema.errors import ErrorCode

from twophase.wire.api_keys import ApiKey
from twophase.wire.errors import KafkaError

from .connection import Connection
from .errors import KafkaConnectionError, RetriableError, check
from .messages import message, part
from .retry import retry
from .security import PLAINTEXT, SecuritySettings


class CoordinatorType(enum.IntEnum):
    """FindCoordinator's key type: a consumer group or a transactional id."""
    GROUP = 0
    TRANSACTION = 1


def parse_bootstrap(bootstrap: str) -> list[tuple[str, int]]:
    """"h1:9092,h2:9093" -> [(h1, 9092), (h2, 9093)]; ValueError on anything else."""
    servers = []
    for item in bootstrap.split(","):
        host, sep, port = item.strip().rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"bootstrap server {item!r} is not HOST:PORT")
        servers.append((host, int(port)))
    return servers


class Cluster:
    """Metadata and connections, shared by a client's threads (a lock guards the caches)."""

    def __init__(self, bootstrap: str, *, client_id: str = "twophase", request_timeout_s: float = 30.0,
                 security: SecuritySettings = PLAINTEXT) -> None:
        self.bootstrap = parse_bootstrap(bootstrap)
        self.security = security
        self.client_id = client_id
        self.request_timeout_s = request_timeout_s
        self._lock = threading.RLock()
        self._brokers: dict[int, tuple[str, int]] = {}
        self._connections: dict[int, Connection] = {}
        self._any: Connection | None = None
        self._leaders: dict[str, dict[int, int]] = {}
        self._coordinators: dict[tuple[str, int], int] = {}
        self._closed = False

    def _connect(self, host: str, port: int) -> Connection:
        if self._closed:  # a client thread still running after close() must not open what nobody closes
            raise KafkaConnectionError(f"cannot connect to {host}:{port}: the client is closed")
        return Connection(host, port, client_id=self.client_id, timeout_s=self.request_timeout_s,
                          security=self.security)

    def any_connection(self) -> Connection:
        """A live connection to some broker (known brokers first, then the bootstrap list)."""
        with self._lock:
            if self._any is not None and not self._any.closed:
                return self._any
            errors = []
            for host, port in list(self._brokers.values()) + self.bootstrap:
                try:
                    self._any = self._connect(host, port)
                    return self._any
                except KafkaConnectionError as exc:
                    errors.append(str(exc))
            raise KafkaConnectionError("no broker reachable: " + "; ".join(errors))

    def connection(self, node_id: int) -> Connection:
        """The connection to broker ``node_id``, opened if needed; RetriableError if metadata does not know it."""
        with self._lock:
            conn = self._connections.get(node_id)
            if conn is None or conn.closed:
                if node_id not in self._brokers:
                    self.refresh([])
                if node_id not in self._brokers:
                    raise RetriableError(f"broker {node_id} is not in the cluster metadata")
                conn = self._connections[node_id] = self._connect(*self._brokers[node_id])
            return conn

    def dedicated_connection(self, node_id: int) -> Connection:
        """A new connection of the caller's own (e.g. for heartbeats beside a long-polling fetch)."""
        with self._lock:
            if node_id not in self._brokers:
                self.refresh([])
            if node_id not in self._brokers:
                raise RetriableError(f"broker {node_id} is not in the cluster metadata")
            return self._connect(*self._brokers[node_id])

    # --- metadata -----------------------------------------------------------------------------

    def refresh(self, topics: list[str] | None, create: bool = False) -> dict[str, int]:
        """Fetch metadata for ``topics`` (None: all); returns the error code per topic."""
        conn = self.any_connection()
        v = conn.version(ApiKey.METADATA, 12)
        if topics is None:
            request_topics = None if v >= 1 else ()
        else:
            request_topics = tuple(part(ApiKey.METADATA, v, "MetadataRequestTopic", name=t, topic_id=None)
                                   for t in topics)
        response = conn.request(message(ApiKey.METADATA, v, topics=request_topics, allow_auto_topic_creation=create,
                                        include_cluster_authorized_operations=False,
                                        include_topic_authorized_operations=False))
        errors = {}
        with self._lock:
            self._brokers = {int(b.node_id): (b.host, int(b.port)) for b in response.brokers}
            for t in response.topics:
                errors[t.name] = int(t.error_code)
                if t.error_code == ErrorCode.none:
                    self._leaders[t.name] = {int(p.partition_index): int(p.leader_id) for p in t.partitions}
                else:
                    self._leaders.pop(t.name, None)
        return errors

    def broker_ids(self) -> list[int]:
        """The ids of the brokers known from metadata, sorted."""
        with self._lock:
            return sorted(self._brokers)

    def partitions(self, topic: str, create: bool = False) -> list[int]:
        """The partition numbers of ``topic``; retries while it is unknown or has no leader yet."""
        with self._lock:
            known = self._leaders.get(topic)
        if known is not None:
            return sorted(known)

        def lookup() -> list[int]:
            check(self.refresh([topic], create).get(topic, ErrorCode.unknown_topic_or_partition),
                  f"metadata for topic {topic!r}")
            with self._lock:
                return sorted(self._leaders[topic])

        return retry(lookup, self.request_timeout_s, f"metadata for {topic!r}")

    def leader(self, topic: str, partition: int) -> int:
        """The leader's node id of the partition; RetriableError (and the topic's metadata dropped) if none is known."""
        self.partitions(topic)  # metadata of a topic not seen yet
        with self._lock:
            leader = self._leaders.get(topic, {}).get(partition, -1)
        if leader < 0:
            self.invalidate(topic)
            raise RetriableError(f"no leader known for {topic}-{partition}", ErrorCode.leader_not_available)
        return leader

    def leader_connection(self, topic: str, partition: int) -> Connection:
        """The connection to the partition's leader."""
        return self.connection(self.leader(topic, partition))

    def invalidate(self, topic: str) -> None:
        """Forget ``topic``'s metadata (after NOT_LEADER and the like): the next lookup refreshes it."""
        with self._lock:
            self._leaders.pop(topic, None)

    # --- coordinators -------------------------------------------------------------------------

    def coordinator_id(self, key: str, kind: CoordinatorType) -> int:
        """The node id of the coordinator of ``key``, cached; looked up with retries on a miss."""
        with self._lock:
            node = self._coordinators.get((key, kind))
        if node is not None:
            return node

        def find() -> int:
            conn = self.any_connection()
            v = conn.version(ApiKey.FIND_COORDINATOR, 3)
            response = conn.request(message(ApiKey.FIND_COORDINATOR, v, key=key, key_type=int(kind)))
            check(response.error_code, f"FindCoordinator({kind.name.lower()} {key!r})")
            with self._lock:
                self._brokers[int(response.node_id)] = (response.host, int(response.port))
                self._coordinators[(key, kind)] = int(response.node_id)
            return int(response.node_id)

        return retry(find, self.request_timeout_s, f"finding the {kind.name.lower()} coordinator of {key!r}")

    def coordinator(self, key: str, kind: CoordinatorType) -> Connection:
        """The connection to the coordinator of ``key``."""
        return self.connection(self.coordinator_id(key, kind))

    def forget_coordinator(self, key: str, kind: CoordinatorType) -> None:
        """Drop the cached coordinator of ``key``, so the next call looks it up again."""
        with self._lock:
            self._coordinators.pop((key, kind), None)

    def coordinator_call(self, key: str, kind: CoordinatorType, call, timeout_s: float, what: str):
        """``call(conn)`` on the coordinator with retries; NOT_COORDINATOR and connection errors
        trigger a new lookup, other retriable errors a backoff."""
        def attempt():
            try:
                return call(self.coordinator(key, kind))
            except KafkaError as exc:
                if isinstance(exc, KafkaConnectionError) or exc.code in (
                        ErrorCode.not_coordinator, ErrorCode.coordinator_not_available):
                    self.forget_coordinator(key, kind)
                raise

        return retry(attempt, timeout_s, what)

    def close(self) -> None:
        """Close every connection."""
        with self._lock:
            self._closed = True
            for conn in list(self._connections.values()) + ([self._any] if self._any else []):
                conn.close()
            self._connections.clear()
            self._any = None

