"""TxnOffsetCommit (key 28), v0-v3: stage a group's offsets in the open transaction (KIP-98, KIP-447).

The offsets are stored durably as pending and become the group's committed offsets only when the
transaction commits (discarded on abort). v3 carries the consumer's generation and member id
(KIP-447): a generation >= 0 is checked like an OffsetCommit's, except that the group state is
not (a rebalance in progress is no error here, as in Kafka). Unknown partitions get
UNKNOWN_TOPIC_OR_PARTITION, metadata over 4 KiB OFFSET_METADATA_TOO_LARGE.
"""

from __future__ import annotations

import time

from kio.schema.errors import ErrorCode

from twophase.wire.api_keys import ApiKey
from twophase.wire.codec import build, nested

from ..groups.coordinator import MAX_METADATA_BYTES
from ..protocol import handles
from ._common import NO_THROTTLE, NONE, error
from ._txn import txn_error


@handles(ApiKey.TXN_OFFSET_COMMIT, 0, 3)
async def handle(broker, request):
    """Answer TxnOffsetCommit: stage the offsets in the producer's transaction, visible to the group when it commits."""
    body, rt = request.body, request.response_type()
    TopicResponse = nested(rt, "TxnOffsetCommitResponseTopic")
    PartitionResponse = nested(rt, "TxnOffsetCommitResponsePartition")
    generation = getattr(body, "generation_id", -1)
    if not body.group_id:
        check = error(ErrorCode.invalid_group_id.value)
    elif generation >= 0:
        check = error(broker.groups.commit_check(body.group_id, generation, body.member_id,
                                                 getattr(body, "group_instance_id", None), transactional=True))
    else:
        check = NONE
    topics_info = broker.topics()
    accepted = {}
    results = []
    for topic in body.topics:
        info = topics_info.get(topic.name)
        for part in topic.partitions:
            key = (topic.name, part.partition_index)
            if check != NONE:
                code = check
            elif info is None or not 0 <= part.partition_index < info.partitions:
                code = ErrorCode.unknown_topic_or_partition
            elif part.committed_metadata is not None and len(part.committed_metadata.encode()) > MAX_METADATA_BYTES:
                code = ErrorCode.offset_metadata_too_large
            else:
                code = None  # the coordinator's answer
                accepted[key] = (part.committed_offset, getattr(part, "committed_leader_epoch", -1),
                                 part.committed_metadata)
            results.append((key, code))
    if accepted:
        verdict = txn_error(broker.transactions.txn_offset_commit(
            body.transactional_id, body.producer_id, body.producer_epoch, body.group_id, accepted,
            int(time.time() * 1000)), request)
        results = [(key, verdict if code is None else code) for key, code in results]
    by_topic: dict[str, list] = {}
    for (topic, partition), code in results:
        by_topic.setdefault(topic, []).append(build(PartitionResponse, partition_index=partition, error_code=code))
    return build(rt, throttle_time=NO_THROTTLE, topics=tuple(
        build(TopicResponse, name=name, partitions=tuple(parts)) for name, parts in by_topic.items()))
