"""AddPartitionsToTxn (key 24), v0-v3: add partitions to the open transaction (opening one if needed).

Per-partition results: an unknown topic or partition gets UNKNOWN_TOPIC_OR_PARTITION and the
others OPERATION_NOT_ATTEMPTED, as in Kafka (nothing is added then); otherwise every partition
gets the coordinator's answer (PRODUCER_FENCED, CONCURRENT_TRANSACTIONS...). v4+ (broker-to-broker
verification, KIP-890) is not served.
"""

from __future__ import annotations

import time

from kio.schema.errors import ErrorCode

from twophase.wire.api_keys import ApiKey
from twophase.wire.codec import build, nested

from ..protocol import handles
from ._common import NO_THROTTLE
from ._txn import txn_error


@handles(ApiKey.ADD_PARTITIONS_TO_TXN, 0, 3)  # 4+ is broker-to-broker verification
async def handle(broker, request):
    """Answer AddPartitionsToTxn: add all the partitions or none (one unknown: the rest get OPERATION_NOT_ATTEMPTED)."""
    body, rt = request.body, request.response_type()
    TopicResult = nested(rt, "AddPartitionsToTxnTopicResult")
    PartitionResult = nested(rt, "AddPartitionsToTxnPartitionResult")
    topics_info = broker.topics()
    wanted = [(t.name, p) for t in body.v3_and_below_topics for p in t.partitions]
    unknown = {(t, p) for t, p in wanted if t not in topics_info or not 0 <= p < topics_info[t].partitions}
    if unknown:
        codes = {key: (ErrorCode.unknown_topic_or_partition if key in unknown else ErrorCode.operation_not_attempted)
                 for key in wanted}
    else:
        code = txn_error(broker.transactions.add_partitions(
            body.v3_and_below_transactional_id, body.v3_and_below_producer_id, body.v3_and_below_producer_epoch,
            wanted, int(time.time() * 1000)), request)
        codes = {key: code for key in wanted}
        broker.transactions.sync_soon()  # its record: the transaction's first Produce awaits that fsync
    by_topic: dict[str, list] = {}
    for (topic, partition), code in codes.items():
        by_topic.setdefault(topic, []).append(build(PartitionResult, partition_index=partition,
                                                    partition_error_code=code))
    return build(rt, throttle_time=NO_THROTTLE, results_by_topic_v3_and_below=tuple(
        build(TopicResult, name=name, results_by_partition=tuple(parts)) for name, parts in by_topic.items()))
