"""Admin client: create and delete topics, list, describe and abort transactions.

Example::

    with Admin("127.0.0.1:9092") as admin:
        admin.create_topics({"orders": 3})
        for txn in admin.list_transactions(states=["Ongoing"]):
            print(txn.transactional_id, txn.state)
        [info] = admin.describe_transactions(["t1"])
        admin.abort_transaction("t1")         # fences the id and aborts what it left open, 2PC too
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
from .connection import MS, Connection, message, part
from .errors import check
from .retry import retry
from .transactions import init_producer_id


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


def _ms(value) -> int | None:
    """kio hands datetime_i64 fields over as datetimes (None for -1)."""
    if value is None:
        return None
    ms = round(value.timestamp() * 1000) if isinstance(value, datetime.datetime) else int(value)
    return None if ms < 0 else ms


class Admin:
    """An admin client: create and delete topics; list, describe and abort transactions.

    Each call retries retriable errors for up to ``request_timeout_ms`` and
    raises KafkaError otherwise.

    Usage::

        with Admin("127.0.0.1:9092") as admin:
            admin.create_topics({"orders": 3}, exist_ok=True)
            for txn in admin.list_transactions(states=["Ongoing"]):
                print(txn.transactional_id, txn.producer_id, txn.state)
            [info] = admin.describe_transactions(["t1"])
            print(info.state, info.age_s(), info.partitions)
            admin.abort_transaction("t1")
            admin.delete_topics(["orders"])
    """
    def __init__(self, bootstrap: str, *, request_timeout_ms: int = 30_000, client_id: str = "twophase-admin") -> None:
        self.request_timeout_s = request_timeout_ms / 1000
        self.cluster = Cluster(bootstrap, client_id=client_id, request_timeout_s=self.request_timeout_s)

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

    # --- transactions -------------------------------------------------------------------------

    def list_transactions(self, states: Iterable[str] | None = None) -> list[TransactionListing]:
        """Transactions every broker knows, optionally only in the given states (e.g. "Ongoing")."""
        state_filters = tuple(states or ())

        def call(conn: Connection) -> list[TransactionListing]:
            v = conn.version(ApiKey.LIST_TRANSACTIONS, 1)
            response = conn.request(message(ApiKey.LIST_TRANSACTIONS, v, state_filters=state_filters,
                                            producer_id_filters=(), duration_filter=-1))
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

    def abort_transaction(self, transactional_id: str) -> None:
        """Fence ``transactional_id`` and abort whatever it left open, a prepared 2PC transaction too.

        InitProducerId with keep_prepared_txn=False does both; enable2_pc is set so that the broker
        also aborts a 2PC transaction. Where the broker forbids 2PC (it answers
        TRANSACTIONAL_ID_AUTHORIZATION_FAILED, as Kafka 4.1 does) no 2PC transaction can be open,
        and a plain InitProducerId is enough."""
        def call(conn: Connection) -> None:
            two_phase = conn.version(ApiKey.INIT_PRODUCER_ID, 6) >= 6
            try:
                init_producer_id(conn, transactional_id, 60_000, enable_2pc=two_phase)
            except KafkaError as e:
                if not two_phase or e.code != ErrorCode.transactional_id_authorization_failed:
                    raise
                init_producer_id(conn, transactional_id, 60_000)

        self.cluster.coordinator_call(transactional_id, CoordinatorType.TRANSACTION, call, self.request_timeout_s,
                                       f"aborting {transactional_id!r}")

    def close(self) -> None:
        """Close every connection."""
        self.cluster.close()

    def __enter__(self) -> Admin:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
