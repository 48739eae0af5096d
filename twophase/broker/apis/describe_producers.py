"""DescribeProducers (key 61), v0 (KIP-664): the active producers of each partition.

For each producer the partition knows: its epoch, last sequence, last append time (the broker's
clock), the coordinator epoch of its last marker and the first offset of its open transaction
(-1 if none). ``twophase txns find-hanging`` and ``kafka-transactions.sh find-hanging`` compare
these with what the transaction coordinator holds open. UNKNOWN_TOPIC_OR_PARTITION for a
partition that does not exist.
"""

from __future__ import annotations

from twophase.wire.api_keys import ApiKey
from twophase.wire.codec import build, nested
from twophase.wire.errors import KafkaError

from ..protocol import handles
from ._common import NO_THROTTLE, NONE, error


@handles(ApiKey.DESCRIBE_PRODUCERS, 0, 0)
async def handle(broker, request):
    """Answer DescribeProducers: each requested partition's producers and open transactions."""
    rt = request.response_type()
    Topic, Partition, State = nested(rt, "TopicResponse"), nested(rt, "PartitionResponse"), nested(rt, "ProducerState")
    topics = []
    for topic in request.body.topics:
        partitions = []
        for index in topic.partition_indexes:
            try:
                producers = broker.partition_log(topic.name, index).producers
            except KafkaError as exc:
                partitions.append(build(Partition, partition_index=index, error_code=error(exc.code),
                                        error_message=str(exc)[:200], active_producers=()))
                continue
            open_txns = producers.open_transactions()
            states = tuple(build(State, producer_id=e.producer_id, producer_epoch=e.epoch, last_sequence=e.last_seq,
                                 last_timestamp=e.last_timestamp, coordinator_epoch=e.coordinator_epoch,
                                 current_txn_start_offset=open_txns.get(e.producer_id, -1))
                           for e in producers.entries())
            partitions.append(build(Partition, partition_index=index, error_code=NONE, error_message=None,
                                    active_producers=states))
        topics.append(build(Topic, name=topic.name, partitions=tuple(partitions)))
    return build(rt, throttle_time=NO_THROTTLE, topics=tuple(topics))

