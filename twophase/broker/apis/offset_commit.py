"""OffsetCommit (key 8), v2-v8: store a group's consumed offsets durably before answering.

A member of an active group must name the current generation (ILLEGAL_GENERATION,
UNKNOWN_MEMBER_ID, REBALANCE_IN_PROGRESS otherwise); generation -1 is a commit outside group
management, allowed while the group has no members. Unknown partitions get
UNKNOWN_TOPIC_OR_PARTITION, metadata over 4 KiB OFFSET_METADATA_TOO_LARGE; the rest of the
request is still committed. retention_time (v2-v4) is ignored: offsets are kept until the topic
is deleted.
"""

from __future__ import annotations

from kio.schema.errors import ErrorCode

from twophase.wire.api_keys import ApiKey
from twophase.wire.codec import build, nested

from ..groups.coordinator import MAX_METADATA_BYTES
from ..protocol import handles
from ._common import NO_THROTTLE, NONE, error


@handles(ApiKey.OFFSET_COMMIT, 2, 8)  # 9+: KIP-848 member epochs
async def handle(broker, request):
    """Answer OffsetCommit: check the member's generation, store the valid offsets, one error code per partition."""
    body, rt = request.body, request.response_type()
    TopicResponse = nested(rt, "OffsetCommitResponseTopic")
    PartitionResponse = nested(rt, "OffsetCommitResponsePartition")
    groups = broker.groups
    check = groups.commit_check(body.group_id, body.generation_id_or_member_epoch, body.member_id,
                                getattr(body, "group_instance_id", None)) \
        if body.group_id else ErrorCode.invalid_group_id.value
    topics_info = broker.topics()
    accepted = {}
    results = []
    for topic in body.topics:
        info = topics_info.get(topic.name)
        partitions = []
        for part in topic.partitions:
            if check:
                code = error(check)
            elif info is None or not 0 <= part.partition_index < info.partitions:
                code = ErrorCode.unknown_topic_or_partition
            elif part.committed_metadata is not None and len(part.committed_metadata.encode()) > MAX_METADATA_BYTES:
                code = ErrorCode.offset_metadata_too_large
            else:
                code = NONE
                accepted[(topic.name, part.partition_index)] = (
                    part.committed_offset, getattr(part, "committed_leader_epoch", -1), part.committed_metadata)
            partitions.append((part.partition_index, code))
        results.append((topic.name, partitions))
    if accepted:
        groups.commit_offsets(body.group_id, accepted)
    return build(rt, throttle_time=NO_THROTTLE, topics=tuple(
        build(TopicResponse, name=name, partitions=tuple(
            build(PartitionResponse, partition_index=p, error_code=code) for p, code in partitions))
        for name, partitions in results))
