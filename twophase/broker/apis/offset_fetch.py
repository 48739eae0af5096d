"""OffsetFetch (key 9), v1-v7: a group's committed offsets (-1 where nothing was committed).

v2+ may ask for all topics (topics = null). With require_stable (v7), a partition whose offset
has a pending transactional commit answers UNSTABLE_OFFSET_COMMIT (88); read_committed
consumers retry until the transaction completes.
"""

from __future__ import annotations

from kio.schema.errors import ErrorCode

from twophase.wire.api_keys import ApiKey
from twophase.wire.codec import build, nested

from ..protocol import handles
from ._common import NO_THROTTLE, NONE


@handles(ApiKey.OFFSET_FETCH, 1, 7)  # 8+: multi-group requests and KIP-848 member epochs
async def handle(broker, request):
    """Answer OffsetFetch: the group's committed offsets (all if no topic is named).

    With require_stable, a partition with a staged transactional offset gets UNSTABLE_OFFSET_COMMIT.
    """
    body, rt = request.body, request.response_type()
    TopicResponse = nested(rt, "OffsetFetchResponseTopic")
    PartitionResponse = nested(rt, "OffsetFetchResponsePartition")
    groups = broker.groups
    if body.topics is None:
        wanted: dict[str, list[int]] = {}
        for topic, partition in sorted(groups.all_committed(body.group_id)):
            wanted.setdefault(topic, []).append(partition)
    else:
        wanted = {}
        for t in body.topics:
            wanted.setdefault(t.name, []).extend(t.partition_indexes)
    require_stable = getattr(body, "require_stable", False)
    topics = []
    for name, partitions in wanted.items():
        entries = []
        for p in partitions:
            if require_stable and groups.offsets.has_pending(body.group_id, name, p):
                entries.append(build(PartitionResponse, partition_index=p, committed_offset=-1,
                                     committed_leader_epoch=-1, metadata="",
                                     error_code=ErrorCode.unstable_offset_commit))
                continue
            c = groups.committed(body.group_id, name, p)
            entries.append(build(PartitionResponse, partition_index=p,
                                 committed_offset=c.offset if c else -1,
                                 committed_leader_epoch=c.leader_epoch if c else -1,
                                 metadata=(c.metadata if c and c.metadata is not None else ""), error_code=NONE))
        topics.append(build(TopicResponse, name=name, partitions=tuple(entries)))
    return build(rt, throttle_time=NO_THROTTLE, topics=tuple(topics), error_code=NONE)
