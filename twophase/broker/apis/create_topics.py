"""CreateTopics (key 19), v2-v7: create topics in the log manager.

A single broker holds every replica, so the replication factor must be 1 (or -1, the default);
manual assignments must name this broker only. num_partitions -1 means the broker default.
Topic configs are passed to storage, which rejects those it does not implement
(INVALID_CONFIG). validate_only runs the checks of a create without creating. A create the disk
refuses part-way (no descriptor or space for a partition log) is undone and answered KAFKA_STORAGE_ERROR.
A create that would take the broker over its ``max_partitions`` (all topics together) is refused
with POLICY_VIOLATION and a message naming the limit. Each topic's directories and files are made
in a worker thread (Broker.create_topic_async): other clients are served meanwhile.
"""

from __future__ import annotations

from kio.schema.errors import ErrorCode

from twophase.wire.api_keys import ApiKey
from twophase.wire.codec import build, nested
from twophase.wire.errors import KafkaError

from ..protocol import handles
from ._common import NO_THROTTLE, NONE, error, valid_topic_name

def _check(broker, topic) -> tuple[ErrorCode, str | None, int]:
    """(error, message, partitions) for one requested topic, before creating it."""
    if not valid_topic_name(topic.name):
        return ErrorCode.invalid_topic_exception, f"illegal topic name {topic.name!r}", 0
    if topic.assignments:
        if topic.num_partitions != -1 or topic.replication_factor != -1:
            return ErrorCode.invalid_request, "both assignments and partitions/replication factor given", 0
        if len(topic.assignments) > broker.config.max_partitions_per_topic:
            return ErrorCode.invalid_partitions, "too many partitions", 0
        indexes = sorted(a.partition_index for a in topic.assignments)
        if indexes != list(range(len(indexes))):
            return ErrorCode.invalid_replica_assignment, "partition indexes must be 0..n-1", 0
        if any(tuple(a.broker_ids) != (broker.node_id,) for a in topic.assignments):
            return ErrorCode.invalid_replica_assignment, f"the only broker is {broker.node_id}", 0
        return NONE, None, len(indexes)
    if topic.replication_factor not in (-1, 1):
        return (ErrorCode.invalid_replication_factor,
                f"replication factor {topic.replication_factor} on a single broker (only 1 is possible)", 0)
    partitions = broker.config.default_partitions if topic.num_partitions == -1 else topic.num_partitions
    if partitions <= 0:
        return ErrorCode.invalid_partitions, f"number of partitions must be positive, not {partitions}", 0
    if partitions > broker.config.max_partitions_per_topic:
        return (ErrorCode.invalid_partitions,
                f"{partitions} partitions exceed this broker's limit of {broker.config.max_partitions_per_topic}", 0)
    return NONE, None, partitions


@handles(ApiKey.CREATE_TOPICS, 2, 7)
async def handle(broker, request):
    """Answer CreateTopics: create (or, with validate_only, only check) each topic; one result per topic."""
    body, rt = request.body, request.response_type()
    Result = nested(rt, "CreatableTopicResult")
    names = [t.name for t in body.topics]
    results = []
    for topic in body.topics:
        if names.count(topic.name) > 1:
            code, message, partitions = ErrorCode.invalid_request, "topic named more than once", 0
        else:
            code, message, partitions = _check(broker, topic)
        info = None
        if code == NONE:
            configs = {c.name: c.value for c in topic.configs}
            try:
                info = await broker.create_topic_async(topic.name, partitions, configs,
                                                       validate_only=body.validate_only)
            except KafkaError as exc:  # validate_only meets the same checks as a create
                code, message = error(exc.code), str(exc)
        results.append(build(
            Result, name=topic.name, topic_id=info.topic_id if info else None, error_code=code,
            error_message=message, topic_config_error_code=0,
            num_partitions=partitions if code == NONE else -1, replication_factor=1 if code == NONE else -1,
            configs=() if code == NONE else None))
    return build(rt, throttle_time=NO_THROTTLE, topics=tuple(results))
