"""ListOffsets (key 2), v1-v7: earliest (-2), latest (-1), max timestamp (-3), or by timestamp.

By timestamp, the answer is the first record whose timestamp is at or after the one asked for
(its offset and timestamp), or offset -1 when there is none. The isolation level (v2+) sets the last
fetchable offset, as in Kafka: the last stable offset under read_committed (1), else the high
watermark. Latest answers it, and a by-timestamp answer at or beyond it is offset -1.
"""

from __future__ import annotations

from kio.schema.errors import ErrorCode

from twophase.wire.api_keys import ApiKey
from twophase.wire.codec import build, nested
from twophase.wire.errors import KafkaError

from ..protocol import handles
from ._common import NO_THROTTLE, NONE, READ_COMMITTED, error

LATEST, EARLIEST, MAX_TIMESTAMP = -1, -2, -3


def _lookup(plog, timestamp: int, isolation_level: int) -> tuple[int, int]:
    """(offset, timestamp) for one ListOffsets partition query."""
    if timestamp == EARLIEST:
        return plog.log_start_offset, -1
    last_fetchable = plog.last_stable_offset if isolation_level == READ_COMMITTED else plog.high_watermark
    if timestamp == LATEST:
        return last_fetchable, -1
    found = plog.offset_of_max_timestamp() if timestamp == MAX_TIMESTAMP else plog.timestamp_lookup(timestamp)
    if found is not None and found.offset >= last_fetchable:
        found = None  # not readable at this isolation level (yet)
    return (found.offset, found.timestamp) if found is not None else (-1, -1)


@handles(ApiKey.LIST_OFFSETS, 1, 7)
async def handle(broker, request):
    """Answer ListOffsets: each partition's offset for a timestamp (or earliest/latest), per isolation level."""
    body, rt = request.body, request.response_type()
    TopicResponse = nested(rt, "ListOffsetsTopicResponse")
    PartitionResponse = nested(rt, "ListOffsetsPartitionResponse")
    isolation_level = getattr(body, "isolation_level", 0)  # v1 has none: read_uncommitted
    topics = []
    for topic in body.topics:
        partitions = []
        for part in topic.partitions:
            try:
                plog = broker.partition_log(topic.name, part.partition_index)
                if part.timestamp < MAX_TIMESTAMP:  # -4, -5: tiered-storage lookups (v8+)
                    offset, timestamp, code = -1, -1, ErrorCode.unsupported_version
                else:
                    offset, timestamp = _lookup(plog, part.timestamp, isolation_level)
                    code = NONE
            except KafkaError as exc:
                offset, timestamp, code = -1, -1, error(exc.code)
            partitions.append(build(PartitionResponse, partition_index=part.partition_index, error_code=code,
                                    timestamp=timestamp, offset=offset, leader_epoch=-1))
        topics.append(build(TopicResponse, name=topic.name, partitions=tuple(partitions)))
    return build(rt, throttle_time=NO_THROTTLE, topics=tuple(topics))

