"""Metadata (key 3), v0-v12: this single broker, the cluster id, the controller, and topic layouts.

Every partition is led by this broker with leader epoch -1, so librdkafka skips
OffsetForLeaderEpoch. Requested topics that do not exist are created when both the client
(v4+: allow_auto_topic_creation) and the broker configuration allow it.
"""

from __future__ import annotations

from kio.schema.errors import ErrorCode

from twophase.wire.api_keys import ApiKey
from twophase.wire.codec import build, nested
from twophase.wire.errors import KafkaError

from ..protocol import handles
from ._common import NO_THROTTLE, NONE, OPERATIONS_OMITTED, error, valid_topic_name


@handles(ApiKey.METADATA, 0, 12)  # 13 adds nothing a client here needs
async def handle(broker, request):
    """Answer Metadata: this broker, and the layout of the topics asked for (auto-creating them where allowed)."""
    body, version = request.body, request.version
    rt = request.response_type()
    Broker_, Topic, Partition = (nested(rt, n) for n in
                                 ("MetadataResponseBroker", "MetadataResponseTopic", "MetadataResponsePartition"))
    node = broker.node_id

    def partitions(count: int) -> tuple:
        return tuple(build(Partition, error_code=NONE, partition_index=p, leader_id=node, leader_epoch=-1,
                           replica_nodes=(node,), isr_nodes=(node,), offline_replicas=())
                     for p in range(count))

    def topic(name, error_code=NONE, info=None):
        return build(Topic, error_code=error_code, name=name, topic_id=info.topic_id if info else None,
                     is_internal=False, partitions=partitions(info.partitions) if info else (),
                     topic_authorized_operations=OPERATIONS_OMITTED)

    known = broker.topics()
    wanted = body.topics
    if wanted is None or (version == 0 and not wanted):  # all topics
        topics = tuple(topic(name, info=info) for name, info in sorted(known.items()))
    else:
        allow = getattr(body, "allow_auto_topic_creation", True)
        topics = []
        for entry in wanted:
            name = entry.name
            if name is None:  # v10+: by topic id
                topic_id = getattr(entry, "topic_id", None)
                found = [(n, i) for n, i in known.items() if i.topic_id == topic_id]
                if found:
                    topics.append(topic(found[0][0], info=found[0][1]))
                else:  # the response may name no topic only from v12 on
                    topics.append(topic(None if version >= 12 else "", ErrorCode.unknown_topic_id))
            elif name in known:
                topics.append(topic(name, info=known[name]))
            elif not valid_topic_name(name):
                topics.append(topic(name, ErrorCode.invalid_topic_exception))
            elif allow and broker.config.auto_create_topics:
                try:
                    topics.append(topic(name, info=await broker.auto_create_topic(name)))
                except KafkaError as exc:
                    topics.append(topic(name, error(exc.code)))
            else:
                topics.append(topic(name, ErrorCode.unknown_topic_or_partition))
        topics = tuple(topics)

    return build(rt, throttle_time=NO_THROTTLE,
                 brokers=(build(Broker_, node_id=node, host=broker.advertised_host, port=broker.port, rack=None),),
                 cluster_id=broker.cluster_id, controller_id=node, topics=topics,
                 cluster_authorized_operations=OPERATIONS_OMITTED)
