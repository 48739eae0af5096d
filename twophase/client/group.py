"""Consumer group membership (classic protocol): JoinGroup/SyncGroup with a range assignor, a
heartbeat thread, offset commit and fetch, LeaveGroup.

The member that the coordinator names leader computes the assignment: for each topic, the sorted
partitions are split into contiguous ranges over the sorted members subscribed to it (Kafka's
RangeAssignor). Subscription and assignment bytes use Kafka's ConsumerProtocol v0 layout, so
librdkafka (tested) and Java members can share a group with this one.

Example::

    group = GroupMember(cluster, "g1", ["orders"])
    group.ensure_active()                 # joins (or rejoins after a rebalance); returns the assignment
    group.commit({("orders", 0): 42})
    group.committed([("orders", 0)])      # {("orders", 0): 42}
    group.leave()
"""

from __future__ import annotations

import collections
import io
import logging
import struct
import threading
from collections.abc import Iterable

from kio.schema.consumer_protocol_assignment.v0.data import ConsumerProtocolAssignment, TopicPartition
from kio.schema.consumer_protocol_subscription.v0.data import ConsumerProtocolSubscription
from kio.schema.errors import ErrorCode
from kio.serial import entity_reader, entity_writer

from twophase.wire.api_keys import ApiKey
from twophase.wire.errors import KafkaError

from .cluster import Cluster, CoordinatorType
from .connection import MS, Connection
from .errors import RetriableError, check, error_for
from .messages import message, part
from .retry import retry

log = logging.getLogger("twophase.client")

PROTOCOL_TYPE = "consumer"
ASSIGNOR = "range"
_VERSION = struct.Struct(">h")
TopicPartitionKey = tuple[str, int]

# Errors after which the member must join again (a new generation), not just retry.
_REJOIN = {ErrorCode.rebalance_in_progress, ErrorCode.illegal_generation, ErrorCode.unknown_member_id}


def _encode(entity) -> bytes:
    buf = io.BytesIO()
    buf.write(_VERSION.pack(0))
    entity_writer(type(entity))(buf, entity)
    return buf.getvalue()


def _decode(cls, data: bytes):
    # Later versions only append fields, so any version reads as v0.
    entity, _ = entity_reader(cls)(data, _VERSION.size)
    return entity


def encode_subscription(topics: list[str]) -> bytes:
    """The ConsumerProtocol v0 subscription bytes for ``topics``."""
    return _encode(ConsumerProtocolSubscription(topics=tuple(sorted(topics)), user_data=None))


def decode_assignment(data: bytes) -> list[TopicPartitionKey]:
    """The (topic, partition) pairs of ConsumerProtocol v0 assignment bytes, sorted."""
    if not data:
        return []
    assignment = _decode(ConsumerProtocolAssignment, data)
    return sorted((tp.topic, int(p)) for tp in assignment.assigned_partitions for p in tp.partitions)


def range_assign(subscriptions: dict[str, list[str]], partitions: dict[str, list[int]]) -> dict[str, bytes]:
    """member id -> encoded assignment, for ``subscriptions`` (member -> topics)."""
    assigned: dict[str, dict[str, list[int]]] = {m: collections.defaultdict(list) for m in subscriptions}
    for topic, parts in sorted(partitions.items()):
        members = sorted(m for m, topics in subscriptions.items() if topic in topics)
        if not members:
            continue
        per, extra = divmod(len(parts), len(members))
        start = 0
        for i, member in enumerate(members):
            count = per + (1 if i < extra else 0)
            assigned[member][topic] = sorted(parts)[start : start + count]
            start += count
    return {m: _encode(ConsumerProtocolAssignment(
        assigned_partitions=tuple(TopicPartition(topic=t, partitions=tuple(ps)) for t, ps in sorted(a.items()) if ps),
        user_data=None)) for m, a in assigned.items()}


class GroupMember:
    """This client's membership in a consumer group (classic protocol, range assignor).

    Used by :class:`~twophase.client.consumer.Consumer`: ensure_active() joins
    from the caller's thread; once joined, a daemon thread heartbeats and asks
    for a rejoin when the group rebalances.

    Usage::

        group = GroupMember(cluster, "g1", ["orders"])
        assignment = group.ensure_active()    # [("orders", 0), ...] after a (re)join, else None
        group.commit({("orders", 0): 42})
        group.committed([("orders", 0)])      # {("orders", 0): 42}
        group.leave()
    """
    def __init__(self, cluster: Cluster, group_id: str, topics: list[str] | None = None, *,
                 session_timeout_ms: int = 10_000, rebalance_timeout_ms: int = 30_000,
                 heartbeat_interval_ms: int = 1_000) -> None:
        self.cluster = cluster
        self.group_id = group_id
        self.topics = list(topics or [])
        self.session_timeout_ms = session_timeout_ms
        self.rebalance_timeout_ms = rebalance_timeout_ms
        self.heartbeat_interval_s = heartbeat_interval_ms / 1000
        self.member_id = ""
        self.generation = -1
        self.assignment: list[TopicPartitionKey] = []
        self._rejoin = threading.Event()
        self._rejoin.set()
        self._stop = threading.Event()
        self._lock = threading.Lock()  # member id and generation, read by the heartbeat thread
        self._heartbeat: threading.Thread | None = None

    @property
    def timeout_s(self) -> float:
        """How long a call to the coordinator is retried: the cluster's request timeout."""
        return self.cluster.request_timeout_s

    def _call(self, call, what: str, timeout_s: float | None = None):
        return self.cluster.coordinator_call(self.group_id, CoordinatorType.GROUP, call,
                                             timeout_s or self.timeout_s, what)

    def subscribe(self, topics: Iterable[str]) -> None:
        """Set the topics and rejoin at the next ensure_active()."""
        self.topics = sorted(set(topics))
        self._rejoin.set()

    # --- membership ---------------------------------------------------------------------------

    def ensure_active(self) -> list[TopicPartitionKey] | None:
        """Join if needed; the new assignment after a (re)join, else None."""
        if not self._rejoin.is_set():
            return None
        while self._rejoin.is_set():
            self._rejoin.clear()
            try:
                self._join_and_sync()
            except KafkaError as exc:
                if exc.code not in _REJOIN:
                    self._rejoin.set()
                    raise
                log.info("group %s: %s, joining again", self.group_id, exc)
                self._rejoin.set()
        if self._heartbeat is None:
            self._heartbeat = threading.Thread(target=self._heartbeat_loop, daemon=True,
                                               name=f"twophase-heartbeat-{self.group_id}")
            self._heartbeat.start()
        return self.assignment

    def _join_and_sync(self) -> None:
        timeout_s = self.timeout_s + self.rebalance_timeout_ms / 1000

        def join(conn: Connection):
            v = conn.version(ApiKey.JOIN_GROUP, 7)
            response = conn.request(message(
                ApiKey.JOIN_GROUP, v, group_id=self.group_id, session_timeout=self.session_timeout_ms * MS,
                rebalance_timeout=self.rebalance_timeout_ms * MS, member_id=self.member_id,
                group_instance_id=None, protocol_type=PROTOCOL_TYPE,
                protocols=(part(ApiKey.JOIN_GROUP, v, "JoinGroupRequestProtocol", name=ASSIGNOR,
                                metadata=encode_subscription(self.topics)),)), timeout_s)
            if response.error_code == ErrorCode.member_id_required:
                self.member_id = response.member_id
                raise RetriableError("member id assigned, joining with it")
            if response.error_code == ErrorCode.unknown_member_id:
                self.member_id = ""
            check(response.error_code, f"JoinGroup({self.group_id})")
            return response

        joined = self._call(join, f"joining group {self.group_id}", timeout_s)
        with self._lock:
            self.member_id, self.generation = joined.member_id, int(joined.generation_id)
        assignments = {}
        if joined.leader == joined.member_id:
            subscriptions = {m.member_id: list(_decode(ConsumerProtocolSubscription, m.metadata).topics)
                             for m in joined.members}
            topics = sorted({t for ts in subscriptions.values() for t in ts})
            # Topics that do not exist (yet) get no partitions; a later rejoin picks them up.
            codes = retry(lambda: self.cluster.refresh(topics), self.timeout_s, "Metadata")
            exist = [t for t, code in codes.items() if code == ErrorCode.none]
            assignments = range_assign(subscriptions, {t: self.cluster.partitions(t) for t in exist})

        def sync(conn: Connection):
            v = conn.version(ApiKey.SYNC_GROUP, 5)
            response = conn.request(message(
                ApiKey.SYNC_GROUP, v, group_id=self.group_id, generation_id=self.generation,
                member_id=self.member_id, group_instance_id=None, protocol_type=PROTOCOL_TYPE,
                protocol_name=ASSIGNOR,
                assignments=tuple(part(ApiKey.SYNC_GROUP, v, "SyncGroupRequestAssignment", member_id=m,
                                       assignment=a) for m, a in assignments.items())), timeout_s)
            check(response.error_code, f"SyncGroup({self.group_id})")
            return response

        synced = self._call(sync, f"syncing group {self.group_id}", timeout_s)
        self.assignment = decode_assignment(synced.assignment)
        log.info("group %s generation %d member %s: %s", self.group_id, self.generation, self.member_id,
                 self.assignment)

    def _heartbeat_loop(self) -> None:
        conn: Connection | None = None
        try:
            while not self._stop.wait(self.heartbeat_interval_s):
                with self._lock:
                    member_id, generation = self.member_id, self.generation
                if self._rejoin.is_set() or generation < 0:
                    continue
                try:
                    if conn is None or conn.closed:
                        conn = self.cluster.dedicated_connection(
                            self.cluster.coordinator_id(self.group_id, CoordinatorType.GROUP))
                    v = conn.version(ApiKey.HEARTBEAT, 4)
                    response = conn.request(message(ApiKey.HEARTBEAT, v, group_id=self.group_id,
                                                    generation_id=generation, member_id=member_id,
                                                    group_instance_id=None))
                except KafkaError as exc:
                    log.info("group %s heartbeat failed: %s", self.group_id, exc)
                    self.cluster.forget_coordinator(self.group_id, CoordinatorType.GROUP)
                    if conn is not None:
                        conn.close()  # a new one to the coordinator found next time
                    conn = None
                    continue
                if response.error_code in _REJOIN:
                    log.info("group %s: %s, rejoin", self.group_id, ErrorCode(response.error_code).name)
                    self._rejoin.set()
        finally:
            if conn is not None:
                conn.close()

    def leave(self) -> None:
        """Stop heartbeating and leave the group; a failure is only logged (the session timeout removes us anyway)."""
        self._stop.set()
        if self._heartbeat is not None:
            self._heartbeat.join()
        if self.generation < 0 or not self.member_id:
            return

        def call(conn: Connection):
            v = conn.version(ApiKey.LEAVE_GROUP, 5)
            response = conn.request(message(
                ApiKey.LEAVE_GROUP, v, group_id=self.group_id, member_id=self.member_id,
                members=(part(ApiKey.LEAVE_GROUP, v, "MemberIdentity", member_id=self.member_id,
                              group_instance_id=None, reason="closing"),)))
            if response.error_code not in (ErrorCode.none, ErrorCode.unknown_member_id):
                raise error_for(response.error_code, f"LeaveGroup({self.group_id})")

        try:
            self._call(call, f"leaving group {self.group_id}")
        except KafkaError as exc:  # the session timeout removes us anyway
            log.warning("group %s: leaving failed: %s", self.group_id, exc)
        self.generation, self.member_id = -1, ""

    # --- offsets ------------------------------------------------------------------------------

    def commit(self, offsets: dict[TopicPartitionKey, int]) -> None:
        """Commit ``offsets`` for the current generation; KafkaError (and a rejoin asked for) if the group moved on."""
        by_topic: dict[str, list[tuple[int, int]]] = collections.defaultdict(list)
        for (topic, partition), offset in sorted(offsets.items()):
            by_topic[topic].append((partition, offset))

        def call(conn: Connection):
            v = conn.version(ApiKey.OFFSET_COMMIT, 8, 2)
            topics = tuple(part(ApiKey.OFFSET_COMMIT, v, "OffsetCommitRequestTopic", name=t, partitions=tuple(
                part(ApiKey.OFFSET_COMMIT, v, "OffsetCommitRequestPartition", partition_index=p, committed_offset=o,
                     committed_leader_epoch=-1, committed_metadata="", commit_timestamp=-1) for p, o in ps))
                for t, ps in by_topic.items())
            response = conn.request(message(
                ApiKey.OFFSET_COMMIT, v, group_id=self.group_id, generation_id_or_member_epoch=self.generation,
                member_id=self.member_id, group_instance_id=None, retention_time_ms=-1, topics=topics))
            for t in response.topics:
                for p in t.partitions:
                    if p.error_code in _REJOIN:
                        self._rejoin.set()
                    check(p.error_code, f"OffsetCommit({t.name}-{p.partition_index})")

        self._call(call, f"committing offsets of group {self.group_id}")

    def committed(self, partitions: list[TopicPartitionKey]) -> dict[TopicPartitionKey, int]:
        """Committed offsets (-1: none). Waits out pending transactional commits (require_stable)."""
        by_topic: dict[str, list[int]] = collections.defaultdict(list)
        for topic, partition in partitions:
            by_topic[topic].append(partition)

        def call(conn: Connection):
            v = conn.version(ApiKey.OFFSET_FETCH, 7, 1)
            response = conn.request(message(
                ApiKey.OFFSET_FETCH, v, group_id=self.group_id, require_stable=True,
                topics=tuple(part(ApiKey.OFFSET_FETCH, v, "OffsetFetchRequestTopic", name=t,
                                  partition_indexes=tuple(ps)) for t, ps in by_topic.items())))
            check(getattr(response, "error_code", 0), f"OffsetFetch({self.group_id})")
            result = {}
            for t in response.topics:
                for p in t.partitions:
                    check(p.error_code, f"OffsetFetch({t.name}-{p.partition_index})")  # 88 is retried
                    result[(t.name, int(p.partition_index))] = int(p.committed_offset)
            return result

        return self._call(call, f"fetching offsets of group {self.group_id}")
