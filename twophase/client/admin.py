"""Admin client: create and delete topics; list, describe and abort transactions; find and abort hanging ones.

Example::

    with Admin("127.0.0.1:9092") as admin:
        admin.create_topics({"orders": 3})
        for txn in admin.list_transactions(states=["Ongoing"]):
            print(txn.transactional_id, txn.state)
        [info] = admin.describe_transactions(["t1"])
        admin.abort_transaction("t1")         # fences the id and aborts what it left open, 2PC too
        admin.list_offsets([("orders", 0)], LATEST, "read_committed")   # {("orders", 0): last stable offset}
        for h in admin.find_hanging(topic="orders", max_transaction_timeout_ms=0):   # KIP-664
            admin.abort_hanging(h.topic, h.partition, h.producer_id, h.producer_epoch)
"""

from __future__ import annotations

import dataclasses
import datetime
import time
from collections.abc import Iterable, Mapping

from kio.schema.errors import ErrorCode

from twophase.wire.api_keys import ApiKey
from twophase.wire.errors import KafkaError

from .cluster import Cluster, CoordinatorType
from .connection import MS, Connection
from .consumer import ISOLATION_LEVELS, LATEST
from .errors import RetriableError, check
from .messages import message, part
from .retry import retry
from .security import SecuritySettings, as_security
from .transactions import init_producer_id

OPEN_STATES = ("Ongoing", "PrepareCommit", "PrepareAbort")  # a transaction the coordinator holds open
_MARKERS_BEING_WRITTEN = ("PrepareCommit", "PrepareAbort")
DEFAULT_MAX_TRANSACTION_TIMEOUT_MS = 15 * 60 * 1000  # Kafka's transaction.max.timeout.ms default
# The timeout a fencing InitProducerId registers: no transaction follows it, and a broker refuses any
# timeout above its transaction.max.timeout.ms (INVALID_TRANSACTION_TIMEOUT), which may be seconds.
_FENCING_TIMEOUT_MS = 1_000
_BROKER_RESOURCE = 4  # DescribeConfigs resource type


@dataclasses.dataclass(frozen=True)
class TransactionListing:
    """One transaction as ListTransactions shows it: transactional id, producer id and state."""
    transactional_id: str
    producer_id: int
    state: str


@dataclasses.dataclass(frozen=True)
class TransactionDescription:
    """One transactional id as DescribeTransactions shows it: state, producer, timeout, start time, partitions."""
    transactional_id: str
    state: str
    producer_id: int
    producer_epoch: int
    timeout_ms: int
    start_time_ms: int | None          # None when no transaction is open
    partitions: tuple[tuple[str, int], ...]

    def age_s(self, now_ms: int | None = None) -> float | None:
        """Seconds since the open transaction started (at ``now_ms``, default now); None if none is open."""
        if self.start_time_ms is None:
            return None
        now_ms = int(time.time() * 1000) if now_ms is None else now_ms
        return max(0.0, (now_ms - self.start_time_ms) / 1000)


@dataclasses.dataclass(frozen=True)
class ProducerState:
    """One producer a partition knows (DescribeProducers): its epoch, last sequence, last append time,
    the coordinator epoch of its last marker and where its open transaction starts (None if none is open)."""
    producer_id: int
    producer_epoch: int
    last_sequence: int
    last_timestamp_ms: int
    coordinator_epoch: int
    txn_start_offset: int | None


@dataclasses.dataclass(frozen=True)
class HangingTransaction:
    """A transaction open on a partition that no transaction coordinator holds open (KIP-664): it holds the
    partition's last stable offset back until someone writes its marker (:meth:`Admin.abort_hanging`)."""
    topic: str
    partition: int
    producer_id: int
    producer_epoch: int
    coordinator_epoch: int
    start_offset: int
    last_timestamp_ms: int


# What WriteTxnMarkers' refusals of an operator's abort mean here (twophase.broker.apis.write_txn_markers).
_ABORT_REFUSALS = {
    ErrorCode.invalid_txn_state: "the producer has no transaction open on the partition",
    ErrorCode.invalid_producer_epoch: "the partition holds another epoch for the producer (see find-hanging)",
    ErrorCode.concurrent_transactions: ("the transaction coordinator holds this transaction open: "
                                        "abort it by its transactional id instead"),
}


def _ms(value) -> int | None:
    """kio hands datetime_i64 fields over as datetimes (None for -1)."""
    if value is None:
        return None
    ms = round(value.timestamp() * 1000) if isinstance(value, datetime.datetime) else int(value)
    return None if ms < 0 else ms


class Admin:
    """An admin client: create and delete topics; list, describe and abort transactions; find and abort
    hanging transactions (KIP-664).

    Each call retries retriable errors for up to ``request_timeout_ms`` and
    raises KafkaError otherwise. ``security``: TLS and SASL settings, as the
    :class:`~twophase.client.Producer` takes them.

    Usage::

        with Admin("127.0.0.1:9092") as admin:
            admin.create_topics({"orders": 3}, exist_ok=True)
            for txn in admin.list_transactions(states=["Ongoing"]):
                print(txn.transactional_id, txn.producer_id, txn.state)
            [info] = admin.describe_transactions(["t1"])
            print(info.state, info.age_s(), info.partitions)
            admin.abort_transaction("t1")
            for h in admin.find_hanging(topic="orders"):     # open longer than 15 minutes, no coordinator's
                admin.abort_hanging(h.topic, h.partition, h.producer_id, h.producer_epoch)
            admin.delete_topics(["orders"])
    """
    def __init__(self, bootstrap: str, *, request_timeout_ms: int = 30_000, client_id: str = "twophase-admin",
                 security: SecuritySettings | Mapping[str, str] | str | None = None) -> None:
        self.request_timeout_s = request_timeout_ms / 1000
        self.cluster = Cluster(bootstrap, client_id=client_id, request_timeout_s=self.request_timeout_s,
                               security=as_security(security))

    def _any(self, call, what: str):
        return retry(lambda: call(self.cluster.any_connection()), self.request_timeout_s, what)

    # --- topics -------------------------------------------------------------------------------

    def create_topics(self, topics: Mapping[str, int], configs: Mapping[str, str] | None = None,
                      exist_ok: bool = False) -> None:
        """Create each topic with its number of partitions; TOPIC_ALREADY_EXISTS is an error unless ``exist_ok``."""
        def call(conn: Connection) -> None:
            v = conn.version(ApiKey.CREATE_TOPICS, 7, 2)
            entries = tuple(part(ApiKey.CREATE_TOPICS, v, "CreatableTopic", name=name, num_partitions=n,
                                 replication_factor=-1 if v >= 4 else 1, assignments=(),  # -1: broker default
                                 configs=tuple(part(ApiKey.CREATE_TOPICS, v, "CreatableTopicConfig", name=k,
                                                    value=val) for k, val in (configs or {}).items()))
                            for name, n in topics.items())
            response = conn.request(message(ApiKey.CREATE_TOPICS, v, topics=entries,
                                            timeout=int(self.request_timeout_s * 1000) * MS, validate_only=False))
            for t in response.topics:
                if not (exist_ok and t.error_code == ErrorCode.topic_already_exists):
                    check(t.error_code, f"CreateTopics({t.name})" + (f": {t.error_message}" if t.error_message else ""))

        self._any(call, "CreateTopics")

    def delete_topics(self, topics: Iterable[str]) -> None:
        """Delete the topics and forget their cached metadata; KafkaError (not retried) if one does not exist."""
        names = list(topics)

        def call(conn: Connection) -> None:
            v = conn.version(ApiKey.DELETE_TOPICS, 6, 1)
            response = conn.request(message(
                ApiKey.DELETE_TOPICS, v, topic_names=tuple(names), timeout=int(self.request_timeout_s * 1000) * MS,
                topics=tuple(part(ApiKey.DELETE_TOPICS, v, "DeleteTopicState", name=n, topic_id=None) for n in names)))
            for t in response.responses:
                if t.error_code == ErrorCode.unknown_topic_or_partition:  # retrying would not make it exist
                    raise KafkaError(f"DeleteTopics({t.name}): no such topic", ErrorCode(t.error_code))
                check(t.error_code, f"DeleteTopics({t.name})")

        try:
            self._any(call, "DeleteTopics")
        finally:  # also when one name failed: the others of the request may be gone
            for name in names:
                self.cluster.invalidate(name)

    # --- offsets ------------------------------------------------------------------------------

    def list_offsets(self, partitions: Iterable[tuple[str, int]], timestamp: int = LATEST,
                     isolation_level: str = "read_uncommitted") -> dict[tuple[str, int], int]:
        """Each partition's offset for ``timestamp``: EARLIEST (-2, the log start offset), LATEST (-1: the
        high watermark, or under ``isolation_level="read_committed"`` the last stable offset, never past
        an open transaction) or a time in ms (the first offset at or after it, -1 if none).

        One ListOffsets request per leader broker, however many partitions; retriable errors (no leader,
        NOT_LEADER, a topic being created) are retried for up to ``request_timeout_ms``.

        Example::

            ends = admin.list_offsets([("orders", 0), ("orders", 1)], LATEST, "read_committed")
            # {("orders", 0): 120, ("orders", 1): 98}
        """
        if isolation_level not in ISOLATION_LEVELS:
            raise ValueError(f"isolation_level must be read_committed or read_uncommitted, not {isolation_level!r}")
        wanted = sorted(set(partitions))
        found: dict[tuple[str, int], int] = {}

        def call() -> None:
            by_leader: dict[int, dict[str, list[int]]] = {}
            for topic, partition in wanted:
                if (topic, partition) not in found:
                    by_leader.setdefault(self.cluster.leader(topic, partition), {}).setdefault(topic, []).append(
                        partition)
            for node, topics in sorted(by_leader.items()):
                conn = self.cluster.connection(node)
                v = conn.version(ApiKey.LIST_OFFSETS, 7, 2)
                response = conn.request(message(
                    ApiKey.LIST_OFFSETS, v, replica_id=-1, isolation_level=ISOLATION_LEVELS[isolation_level],
                    topics=tuple(part(ApiKey.LIST_OFFSETS, v, "ListOffsetsTopic", name=t, partitions=tuple(
                        part(ApiKey.LIST_OFFSETS, v, "ListOffsetsPartition", partition_index=p,
                             current_leader_epoch=-1, timestamp=timestamp) for p in ps)) for t, ps in topics.items())))
                for t in response.topics:
                    for p in t.partitions:
                        if p.error_code:
                            self.cluster.invalidate(t.name)
                            check(p.error_code, f"ListOffsets({t.name}-{p.partition_index})")
                        found[(t.name, int(p.partition_index))] = int(p.offset)
            # Partitions answered before an error are kept: a retry asks only for the others.

        retry(call, self.request_timeout_s, "ListOffsets")
        return {tp: found[tp] for tp in wanted}

    # --- transactions -------------------------------------------------------------------------

    def list_transactions(self, states: Iterable[str] | None = None,
                          producer_ids: Iterable[int] | None = None) -> list[TransactionListing]:
        """Transactions every broker knows, optionally only in the given states (e.g. "Ongoing") or of the
        given producer ids."""
        state_filters = tuple(states or ())
        producer_id_filters = tuple(producer_ids or ())

        def call(conn: Connection) -> list[TransactionListing]:
            v = conn.version(ApiKey.LIST_TRANSACTIONS, 1)
            response = conn.request(message(ApiKey.LIST_TRANSACTIONS, v, state_filters=state_filters,
                                            producer_id_filters=producer_id_filters, duration_filter=-1))
            check(response.error_code, "ListTransactions")
            if response.unknown_state_filters:
                raise KafkaError(f"unknown transaction states: {', '.join(response.unknown_state_filters)}")
            return [TransactionListing(t.transactional_id, int(t.producer_id), t.transaction_state)
                    for t in response.transaction_states]

        retry(lambda: self.cluster.refresh([]), self.request_timeout_s, "Metadata")
        listings: list[TransactionListing] = []
        for node in self.cluster.broker_ids():
            listings += retry(lambda: call(self.cluster.connection(node)), self.request_timeout_s, "ListTransactions")
        return sorted(listings, key=lambda t: t.transactional_id)

    def describe_transactions(self, transactional_ids: Iterable[str]) -> list[TransactionDescription]:
        """One description per id, in order; an id the coordinator does not know raises
        TRANSACTIONAL_ID_NOT_FOUND."""
        return [self.cluster.coordinator_call(tid, CoordinatorType.TRANSACTION, lambda c, t=tid: self._describe(c, t),
                                               self.request_timeout_s, f"DescribeTransactions({tid!r})")
                for tid in transactional_ids]

    @staticmethod
    def _describe(conn: Connection, transactional_id: str) -> TransactionDescription:
        v = conn.version(ApiKey.DESCRIBE_TRANSACTIONS, 0)
        response = conn.request(message(ApiKey.DESCRIBE_TRANSACTIONS, v, transactional_ids=(transactional_id,)))
        [t] = response.transaction_states
        check(t.error_code, f"DescribeTransactions({transactional_id!r})")
        timeout = t.transaction_timeout
        return TransactionDescription(
            t.transactional_id, t.transaction_state, int(t.producer_id), int(t.producer_epoch),
            int(timeout.total_seconds() * 1000) if isinstance(timeout, datetime.timedelta) else int(timeout),
            _ms(t.transaction_start_time),
            tuple(sorted((topic.topic, int(p)) for topic in t.topics for p in topic.partitions)))

    def describe_settled(self, transactional_id: str) -> TransactionDescription | None:
        """The coordinator's view of ``transactional_id`` once no markers are being written (it waits
        out PrepareCommit and PrepareAbort); None if the coordinator does not know the id (expired or
        never registered: nothing is open)."""
        def describe() -> TransactionDescription | None:
            try:
                [described] = self.describe_transactions([transactional_id])
            except KafkaError as exc:
                if exc.code != ErrorCode.transactional_id_not_found:
                    raise
                return None
            if described.state in _MARKERS_BEING_WRITTEN:
                raise RetriableError(f"{transactional_id} is in {described.state}")
            return described

        return retry(describe, self.request_timeout_s, f"describing {transactional_id}")

    def abort_transaction(self, transactional_id: str) -> None:
        """Fence ``transactional_id`` and abort whatever it left open, a prepared 2PC transaction too.

        InitProducerId with keep_prepared_txn=False does both; enable2_pc is set so that the broker
        also aborts a 2PC transaction. Where the broker forbids 2PC (it answers
        TRANSACTIONAL_ID_AUTHORIZATION_FAILED, as Kafka 4.1 does) no 2PC transaction can be open,
        and a plain InitProducerId is enough."""
        def call(conn: Connection) -> None:
            two_phase = conn.version(ApiKey.INIT_PRODUCER_ID, 6) >= 6
            try:
                init_producer_id(conn, transactional_id, _FENCING_TIMEOUT_MS, enable_2pc=two_phase)
            except KafkaError as e:
                if not two_phase or e.code != ErrorCode.transactional_id_authorization_failed:
                    raise
                init_producer_id(conn, transactional_id, _FENCING_TIMEOUT_MS)

        self.cluster.coordinator_call(transactional_id, CoordinatorType.TRANSACTION, call, self.request_timeout_s,
                                       f"aborting {transactional_id!r}")

    # --- configs ------------------------------------------------------------------------------

    def describe_broker_configs(self, names: Iterable[str] | None = None) -> dict[str, str]:
        """The settings of the broker this client is connected to, by Kafka's names (all, or ``names``
        that it has): DescribeConfigs on the broker resource. KafkaError if the broker refuses (no
        DESCRIBE_CONFIGS permission, or a broker without the API).

        Example::

            admin.describe_broker_configs(["transaction.max.timeout.ms"])   # {"transaction.max.timeout.ms": "900000"}
        """
        keys = None if names is None else tuple(names)

        def call() -> dict[str, str]:
            if not self.cluster.broker_ids():
                self.cluster.refresh([])
            node = min(self.cluster.broker_ids())  # cluster-wide settings: any broker answers for all
            conn = self.cluster.connection(node)
            v = conn.version(ApiKey.DESCRIBE_CONFIGS, 4, 1)
            resource = part(ApiKey.DESCRIBE_CONFIGS, v, "DescribeConfigsResource", resource_type=_BROKER_RESOURCE,
                            resource_name=str(node), configuration_keys=keys)
            [result] = conn.request(message(ApiKey.DESCRIBE_CONFIGS, v, resources=(resource,))).results
            check(result.error_code, f"DescribeConfigs(broker {node})")
            return {c.name: c.value for c in result.configs}

        return retry(call, self.request_timeout_s, "DescribeConfigs")

    # --- hanging transactions (KIP-664) -------------------------------------------------------

    def partitions_of(self, topic: str | None = None, partition: int | None = None,
                      broker_id: int | None = None) -> list[tuple[str, int]]:
        """The partitions to look at: one, a topic's, those ``broker_id`` leads, or all; sorted."""
        if partition is not None and topic is None:
            raise ValueError("a partition needs its topic")
        if topic is not None:
            found = [(topic, p) for p in self.cluster.partitions(topic)]
            if partition is not None:
                if (topic, partition) not in found:
                    raise KafkaError(f"no partition {topic}-{partition}", ErrorCode.unknown_topic_or_partition)
                found = [(topic, partition)]
        else:
            codes = retry(lambda: self.cluster.refresh(None), self.request_timeout_s, "Metadata")
            found = [(t, p) for t, code in codes.items() if code == ErrorCode.none for p in self.cluster.partitions(t)]
        if broker_id is not None:
            found = [tp for tp in found if self.cluster.leader(*tp) == broker_id]
        return sorted(found)

    def describe_producers(self, partitions: Iterable[tuple[str, int]]) -> dict[tuple[str, int], list[ProducerState]]:
        """The producers each partition's leader knows (DescribeProducers, KIP-664), by partition."""
        by_leader: dict[int, dict[str, list[int]]] = {}
        for topic, partition in partitions:
            by_leader.setdefault(self.cluster.leader(topic, partition), {}).setdefault(topic, []).append(partition)
        found: dict[tuple[str, int], list[ProducerState]] = {}
        for node, topics in sorted(by_leader.items()):
            def call(conn: Connection, topics=topics) -> None:
                v = conn.version(ApiKey.DESCRIBE_PRODUCERS, 0)
                response = conn.request(message(ApiKey.DESCRIBE_PRODUCERS, v, topics=tuple(
                    part(ApiKey.DESCRIBE_PRODUCERS, v, "TopicRequest", name=t, partition_indexes=tuple(ps))
                    for t, ps in topics.items())))
                for t in response.topics:
                    for p in t.partitions:
                        check(p.error_code, f"DescribeProducers({t.name}-{p.partition_index})"
                              + (f": {p.error_message}" if p.error_message else ""))
                        found[(t.name, int(p.partition_index))] = [ProducerState(
                            int(s.producer_id), int(s.producer_epoch), int(s.last_sequence), int(s.last_timestamp),
                            int(s.coordinator_epoch),
                            None if s.current_txn_start_offset < 0 else int(s.current_txn_start_offset))
                            for s in p.active_producers]

            retry(lambda: call(self.cluster.connection(node)), self.request_timeout_s, "DescribeProducers")
        return found

    def find_hanging(self, topic: str | None = None, partition: int | None = None, broker_id: int | None = None,
                     max_transaction_timeout_ms: int = DEFAULT_MAX_TRANSACTION_TIMEOUT_MS,
                     now_ms: int | None = None) -> list[HangingTransaction]:
        """Transactions open on the partitions (as :meth:`partitions_of` picks them) longer than
        ``max_transaction_timeout_ms`` that no coordinator holds open, as ``kafka-transactions.sh
        find-hanging`` finds them: the producer's transactional id is unknown, or its transaction is
        not open, or it does not include the partition."""
        now_ms = int(time.time() * 1000) if now_ms is None else now_ms
        candidates = [HangingTransaction(t, p, s.producer_id, s.producer_epoch, s.coordinator_epoch,
                                         s.txn_start_offset, s.last_timestamp_ms)
                      for (t, p), states in sorted(self.describe_producers(
                          self.partitions_of(topic, partition, broker_id)).items())
                      for s in states
                      if s.txn_start_offset is not None and now_ms - s.last_timestamp_ms >= max_transaction_timeout_ms]
        holding: dict[int, set[tuple[str, int]]] = {}  # producer id -> partitions a coordinator holds open for it
        for producer_id in sorted({c.producer_id for c in candidates}):
            listings = self.list_transactions(states=OPEN_STATES, producer_ids=[producer_id])
            held = holding.setdefault(producer_id, set())
            for d in self.describe_transactions([t.transactional_id for t in listings]):
                if d.state in OPEN_STATES:
                    held.update(d.partitions)
        return [c for c in candidates if (c.topic, c.partition) not in holding[c.producer_id]]

    def abort_hanging(self, topic: str, partition: int, producer_id: int, producer_epoch: int,
                      coordinator_epoch: int = 0) -> None:
        """Write an ABORT marker for the producer's hanging transaction on the partition (WriteTxnMarkers to
        its leader, as ``kafka-transactions.sh abort --topic ... --producer-id ...`` does); KafkaError
        with the broker's reason if it refuses."""
        def call(conn: Connection) -> None:
            v = conn.version(ApiKey.WRITE_TXN_MARKERS, 2, 1)
            marker = part(ApiKey.WRITE_TXN_MARKERS, v, "WritableTxnMarker", producer_id=producer_id,
                          producer_epoch=producer_epoch, transaction_result=False, coordinator_epoch=coordinator_epoch,
                          topics=(part(ApiKey.WRITE_TXN_MARKERS, v, "WritableTxnMarkerTopic", name=topic,
                                       partition_indexes=(partition,)),))
            response = conn.request(message(ApiKey.WRITE_TXN_MARKERS, v, markers=(marker,)))
            [m] = response.markers
            [t] = m.topics
            [p] = t.partitions
            if p.error_code:  # a refusal with its reason; not retried (CONCURRENT_TRANSACTIONS would be)
                code = ErrorCode(p.error_code)
                raise KafkaError(f"aborting producer {producer_id} epoch {producer_epoch} on {topic}-{partition}: "
                                 f"{code.name.upper()} ({int(code)})"
                                 + (f": {_ABORT_REFUSALS[code]}" if code in _ABORT_REFUSALS else ""), code)

        retry(lambda: call(self.cluster.leader_connection(topic, partition)), self.request_timeout_s,
              f"WriteTxnMarkers({topic}-{partition})")

    def close(self) -> None:
        """Close every connection."""
        self.cluster.close()

    def __enter__(self) -> Admin:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
