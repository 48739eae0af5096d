"""The API registry: which Kafka APIs this broker serves, in which versions, by which module.

Each handler module in :mod:`twophase.broker.apis` has ``async def handle(broker, request)``
returning a kio response object (or None when no response is due, as for Produce with
acks=0). The table below is the only place that names version ranges; ApiVersions advertises
exactly it, and the server refuses anything outside it.

Example::

    api = API_BY_KEY.get(api_key)            # None: unknown key, the connection is closed
    if api and api.supports(version):
        request_type = api.request_type(version)

Why these ranges (docs/kafka-protocol.md): Produce starts at 3 (RecordBatch v2, idempotence);
Fetch stops at 12 because 13+ addresses topics by id; Metadata stops at 12 (13 adds nothing a
client here needs); ApiVersions stops at 3, so kafka-python's v4 gets the v0-shaped
UNSUPPORTED_VERSION answer it falls back on. Consumer groups: OffsetCommit stops at 8 and
OffsetFetch at 7 (9+ and 8+ are KIP-848 member epochs and multi-group requests); JoinGroup stops
at 7 (8 adds only a reason, 9 static-member assignment skipping). Transactions: every client
needs min version 0 (aiokafka sends v0 only); InitProducerId goes to 6 (KIP-939 2PC),
AddPartitionsToTxn stops at 3 (4+ is broker-to-broker verification) and EndTxn at 4 (5 is
KIP-890's epoch bump per transaction).
"""

from __future__ import annotations

import dataclasses
import functools
from types import ModuleType
from typing import Any

from kio.index import load_request_schema, load_response_schema

from .apis import (
    add_offsets_to_txn,
    add_partitions_to_txn,
    api_versions,
    create_topics,
    delete_topics,
    describe_groups,
    describe_transactions,
    end_txn,
    fetch,
    find_coordinator,
    heartbeat,
    init_producer_id,
    join_group,
    leave_group,
    list_groups,
    list_offsets,
    list_transactions,
    metadata,
    offset_commit,
    offset_fetch,
    produce,
    sync_group,
    txn_offset_commit,
)


@dataclasses.dataclass(frozen=True)
class Api:
    key: int
    name: str
    handler: ModuleType
    min_version: int
    max_version: int

    def supports(self, version: int) -> bool:
        return self.min_version <= version <= self.max_version

    def request_type(self, version: int) -> type:
        return _request_type(self.key, version)

    def response_type(self, version: int) -> type:
        return _response_type(self.key, version)


@functools.cache
def _request_type(key: int, version: int) -> type:
    return load_request_schema(key, version)


@functools.cache
def _response_type(key: int, version: int) -> type:
    return load_response_schema(key, version)


APIS: tuple[Api, ...] = (
    Api(0, "Produce", produce, 3, 9),
    Api(1, "Fetch", fetch, 4, 12),
    Api(2, "ListOffsets", list_offsets, 1, 7),
    Api(3, "Metadata", metadata, 0, 12),
    Api(8, "OffsetCommit", offset_commit, 2, 8),
    Api(9, "OffsetFetch", offset_fetch, 1, 7),
    Api(10, "FindCoordinator", find_coordinator, 0, 4),
    Api(11, "JoinGroup", join_group, 0, 7),
    Api(12, "Heartbeat", heartbeat, 0, 4),
    Api(13, "LeaveGroup", leave_group, 0, 5),
    Api(14, "SyncGroup", sync_group, 0, 5),
    Api(15, "DescribeGroups", describe_groups, 0, 5),
    Api(16, "ListGroups", list_groups, 0, 4),
    Api(18, "ApiVersions", api_versions, 0, 3),
    Api(19, "CreateTopics", create_topics, 2, 7),
    Api(20, "DeleteTopics", delete_topics, 1, 6),
    Api(22, "InitProducerId", init_producer_id, 0, 6),
    Api(24, "AddPartitionsToTxn", add_partitions_to_txn, 0, 3),
    Api(25, "AddOffsetsToTxn", add_offsets_to_txn, 0, 3),
    Api(26, "EndTxn", end_txn, 0, 4),
    Api(28, "TxnOffsetCommit", txn_offset_commit, 0, 3),
    Api(65, "DescribeTransactions", describe_transactions, 0, 0),
    Api(66, "ListTransactions", list_transactions, 0, 2),
)

API_BY_KEY: dict[int, Api] = {api.key: api for api in APIS}


@dataclasses.dataclass(slots=True)
class Request:
    """One decoded request as handlers see it."""

    api: Api
    version: int
    correlation_id: int
    client_id: str | None
    body: Any
    peer: str = ""
    gone: Any = None  # asyncio.Future done once the client has gone away (None outside the server)

    def response_type(self) -> type:
        return self.api.response_type(self.version)
