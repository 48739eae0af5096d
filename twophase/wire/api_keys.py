"""The Kafka API keys this project speaks, defined once for the broker and the client.

Example::

    conn.version(ApiKey.METADATA, 12)           # client: highest Metadata version both speak
    API_BY_KEY[ApiKey.PRODUCE]                  # broker: the Produce handler and its versions
"""

from __future__ import annotations

import enum


class ApiKey(enum.IntEnum):
    """A Kafka request type, as the request header's ``request_api_key`` names it."""

    PRODUCE = 0
    FETCH = 1
    LIST_OFFSETS = 2
    METADATA = 3
    OFFSET_COMMIT = 8
    OFFSET_FETCH = 9
    FIND_COORDINATOR = 10
    JOIN_GROUP = 11
    HEARTBEAT = 12
    LEAVE_GROUP = 13
    SYNC_GROUP = 14
    DESCRIBE_GROUPS = 15
    LIST_GROUPS = 16
    SASL_HANDSHAKE = 17
    API_VERSIONS = 18
    CREATE_TOPICS = 19
    DELETE_TOPICS = 20
    INIT_PRODUCER_ID = 22
    ADD_PARTITIONS_TO_TXN = 24
    ADD_OFFSETS_TO_TXN = 25
    END_TXN = 26
    WRITE_TXN_MARKERS = 27
    TXN_OFFSET_COMMIT = 28
    DESCRIBE_CONFIGS = 32
    SASL_AUTHENTICATE = 36
    DESCRIBE_PRODUCERS = 61
    DESCRIBE_TRANSACTIONS = 65
    LIST_TRANSACTIONS = 66
