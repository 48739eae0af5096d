"""ListOffsets (key 2), v1-v7: earliest (-2), latest (-1), max timestamp (-3), or by timestamp.

By timestamp, the answer is the first record whose timestamp is at or after the one asked for
(its offset and timestamp), or offset -1 when there is none. Latest under read_committed
(isolation level 1) is the last stable offset.
"""

from __future__ import annotations

from kio.schema.errors import ErrorCode

from ..codec import build, nested
from ..storage import KafkaError
from ._common import NO_THROTTLE, NONE, error

LATEST, EARLIEST, MAX_TIMESTAMP = -1, -2, -3


def _lookup(plog, timestamp: int) -> tuple[int, int]:
    """(offset, timestamp) for one ListOffsets partition query."""
    if timestamp == EARLIEST:
        return plog.log_start_offset, -1
    if timestamp == LATEST:
        return plog.high_watermark, -1  # read_committed too: without transactions LSO = HW
    if timestamp == MAX_TIMESTAMP:
        found = _max_timestamp(plog)
        return found if found else (-1, -1)
    found = plog.timestamp_lookup(timestamp)
    return (found.offset, found.timestamp) if found is not None else (-1, -1)


def _max_timestamp(plog) -> tuple[int, int] | None:
    """(offset, timestamp) of the first record carrying the log's largest timestamp."""
    best = None
    for segment in plog.segments:
        if segment.is_empty:
            continue
        ts = segment.max_timestamp
        if best is None or ts > best[1]:
            found = segment.find_timestamp(ts)
            if found is not None:
                best = (found[0], found[1])
    return best


async def handle(broker, request):
    body, rt = request.body, request.response_type()
    TopicResponse = nested(rt, "ListOffsetsTopicResponse")
    PartitionResponse = nested(rt, "ListOffsetsPartitionResponse")
    topics = []
    for topic in body.topics:
        partitions = []
        for part in topic.partitions:
            try:
                plog = broker.partition_log(topic.name, part.partition_index)
                if part.timestamp < MAX_TIMESTAMP:  # -4, -5: tiered-storage lookups (v8+)
                    offset, timestamp, code = -1, -1, ErrorCode.unsupported_version
                else:
                    offset, timestamp = _lookup(plog, part.timestamp)
                    code = NONE
            except KafkaError as exc:
                offset, timestamp, code = -1, -1, error(exc.code)
            partitions.append(build(PartitionResponse, partition_index=part.partition_index, error_code=code,
                                    timestamp=timestamp, offset=offset, leader_epoch=-1))
        topics.append(build(TopicResponse, name=topic.name, partitions=tuple(partitions)))
    return build(rt, throttle_time=NO_THROTTLE, topics=tuple(topics))

